"""Token-exact chat histories: the prompt rendered in the chat template, and the template's deltas
appended to the ids the engine sampled.

`prompt_renderer(tok)` turns an environment's first text into prompt ids (the chat's first user
message rendered with the generation prompt where the tokenizer has a chat template, else
`bos + encode(text)`), and `chat_deltas(tok)` gives the `ChatDeltas` of the later observations (or
None: plain encoded text). The rollout worker, the learner's task and the warm start all render
through these two, so the learner trains on the ids a worker's episode holds.

A multi-turn history is `prompt + action + observation + action + ...` as token ids. The actions
are the engine's sampled ids, never decoded and encoded again (BPE would often merge them into
other ids, and the learner would train on tokens the policy never sampled). Each observation is
the text the chat template writes for the new messages, from the end of the previous assistant
turn to the next generation prompt, encoded once and appended with action mask 0:

    base   = [user "base"]                          the fixed conversation the deltas hang from
    head   = render(base, add_generation_prompt=True)
    before = head + "base" + END_OF_TURN           the history up to a finished assistant turn
    delta  = render(base + [assistant "base"] + new, add_generation_prompt=True)[len(before):]

For ChatML (`<|im_start|>user\\n...<|im_end|>\\n`) the end-of-turn token is `<|im_end|>`, which
the model samples; the `\\n` the template writes after it is the first character of the delta,
so it is masked. An action cut before its end-of-turn token (by the token budget, or by a stop
token that is not the end of the turn, such as a closing code fence) gets the end-of-turn token
appended, masked (`end_of_turn_ids`), so that the history keeps the template's form.

`ChatDeltas` raises `ChatTemplateError` when a template does not have this prefix property (it
renders earlier turns differently once later ones exist, say): training on such a history
would not match what the model sees at inference.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jinja2

_BASE_USER = "base"
_BASE_REPLY = "base"


class ChatTemplateError(ValueError):
    """The chat template cannot give token-exact deltas (see the module docstring)."""


class ChatDeltas:
    """The chat-template pieces of a token-exact history, for one tokenizer.

    Args:
      tokenizer: an `HFTokenizer` (or anything with `encode`, `id`, `apply_chat_template`,
        `chat_template` and `special_tokens`) with a chat template.
      end_of_turn: the token that ends an assistant turn in the template; default the eos token
        (`<|im_end|>` for ChatML). The engine must stop at it (it is the model's eos, or add it
        to the stop ids).
      observation_role: the role of an environment's observation; "user" by default (a template
        with a "tool" role may take "tool").

    Raises:
      ChatTemplateError: the tokenizer has no chat template, or its template does not write an
        earlier assistant turn as generation prompt + content + end-of-turn token (checked with
        a user message after it).
    """

    def __init__(self, tokenizer, *, end_of_turn: str | None = None,
                 observation_role: str = "user"):
        if not has_chat_template(tokenizer):
            raise ChatTemplateError(f"{getattr(tokenizer, 'source', tokenizer)!s} has no chat "
                                    "template: token-exact chat deltas need one.")
        self.tokenizer = tokenizer
        self.observation_role = observation_role
        self.end_of_turn = end_of_turn or tokenizer.special_tokens["eos_token"]
        self.end_of_turn_id = tokenizer.id(self.end_of_turn)
        self._base = ({"role": "user", "content": _BASE_USER},)
        head = self.render(self._base, add_generation_prompt=True)
        self._before = head + _BASE_REPLY + self.end_of_turn  # cached: every delta starts here
        self.delta_text([{"role": "user", "content": _BASE_USER}])  # raises if no prefix property
        # What the template writes after the end-of-turn token when the conversation ends on an
        # assistant turn ("\n" for ChatML); None when it writes that last turn differently
        # (Qwen3's thinking block, say) — the history never holds such a rendering.
        finished = self.render([*self._base, self._assistant(_BASE_REPLY)],
                               add_generation_prompt=False)
        self.after_end_of_turn = (finished[len(self._before):]
                                  if finished.startswith(self._before) else None)

    @staticmethod
    def _assistant(content: str) -> dict:
        return {"role": "assistant", "content": content}

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(list(messages),
                                                      add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"the chat template rejected the messages: {e}") from e

    def prompt_ids(self, messages: Sequence[Mapping]) -> list[int]:
        """The first prompt: `messages` rendered with the generation prompt, encoded."""
        return self.tokenizer.encode(self.render(messages, add_generation_prompt=True))

    def delta_text(self, messages: Sequence[Mapping]) -> str:
        """The text from the end-of-turn token of an assistant turn to the generation prompt after
        the non-assistant `messages` that follow it.

        Raises:
          ChatTemplateError: the template rewrites the earlier turns once `messages` follow them
            (no prefix property), or rejects the messages.
        """
        for m in messages:
            if m.get("role") == "assistant":
                raise ChatTemplateError("an observation delta holds no assistant message: "
                                        "assistant turns are the sampled ids.")
        full = self.render([*self._base, self._assistant(_BASE_REPLY), *messages],
                           add_generation_prompt=True)
        if not full.startswith(self._before):
            raise ChatTemplateError(
                f"the chat template has no prefix property for roles "
                f"{[m.get('role') for m in messages]}: with them appended, the conversation "
                f"before them renders as {full[:len(self._before)]!r}, not {self._before!r}.")
        return full[len(self._before):]

    def delta_ids(self, messages: Sequence[Mapping]) -> list[int]:
        """`delta_text(messages)`, encoded once (mask these ids: the policy did not sample them)."""
        return self.tokenizer.encode(self.delta_text(messages))

    def observation_ids(self, text: str, role: str | None = None) -> list[int]:
        """The delta of one observation message (`role` default: `observation_role`)."""
        role = self.observation_role if role is None else role
        return self.delta_ids([{"role": role, "content": text}])

    def end_of_turn_ids(self, action_ids: Sequence[int]) -> list[int]:
        """`[]` when the action ends with its sampled end-of-turn token, else `[end_of_turn_id]`:
        the masked token that closes a cut action before the next delta."""
        if len(action_ids) and int(action_ids[-1]) == self.end_of_turn_id:
            return []
        return [self.end_of_turn_id]

    def content(self, action_ids: Sequence[int]) -> str:
        """The assistant message of an action: its text without the final end-of-turn token."""
        ids = list(action_ids)
        if ids and int(ids[-1]) == self.end_of_turn_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)


def has_chat_template(tok) -> bool:
    """Whether `tok` renders chats (an `HFTokenizer` whose directory has a chat template)."""
    return getattr(tok, "chat_template", None) is not None


def prompt_renderer(tok, chat_template: bool = True) -> Callable[[str], list[int]]:
    """Prompt ids from an environment's first text.

    With `chat_template` and a tokenizer that has one: the text as the user message of a chat,
    rendered with the assistant's generation prompt, then encoded (special tokens the template
    writes become their ids; no BOS is added, a template that wants one writes it). Otherwise
    `[bos_id] + encode(text)` (no BOS if the tokenizer has none).
    """
    if chat_template and has_chat_template(tok):
        def render(text: str) -> list[int]:
            chat = [{"role": "user", "content": text}]
            return tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True))
        return render
    bos = [] if tok.bos_id is None else [tok.bos_id]
    return lambda text: bos + tok.encode(text)


def chat_deltas(tok, chat_template: bool = True) -> ChatDeltas | None:
    """The observations' renderer that goes with `prompt_renderer(tok, chat_template)`: the chat
    template's deltas where the prompt is a chat, None (plain encoded text) otherwise."""
    return ChatDeltas(tok) if chat_template and has_chat_template(tok) else None
