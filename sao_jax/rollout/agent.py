"""The multi-turn agent loop: generate an action, let the environment answer, repeat.

History lives as token ids and is never re-tokenised from text: the action is exactly the ids the
engine sampled (with their log-probs and weight versions), the observation is tokenised once and
appended with action mask 0. So every rollout log-prob lines up with the token the learner trains
on. With a chat template (`chat`, a `text.ChatDeltas`) the observation is the template's delta
after the action (the masked `<|im_end|>` of a cut action, then `\\n<|im_start|>user\\n...` up to
the next generation prompt), so the history is the template's rendering of the conversation;
without one it is the plain encoded text. Rewards go on the last token of the action that earned
them. An episode ends when the environment says done, at the turn limit
(`finish_reason="turn_limit"`, truncated) or when the response budget, or the engine's context
after the prompt (`max_context_tokens`), runs out (`"length"`, truncated). An environment that
raises ends the episode without a trajectory (`EnvironmentFailure`). The protocol an environment
speaks is in `envs/base.py`, a tokenizer's in `text/__init__.py`.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from collections.abc import Callable

import numpy as np

from sao_jax.envs.base import Environment
from sao_jax.rollout.trajectory import Trajectory, new_trajectory_id
from sao_jax.text import ChatDeltas, Tokenizer


class EnvironmentFailure(RuntimeError):
    """The environment raised (in `reset` or `step`): the episode has no trajectory. The original
    exception is the `__cause__`."""


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Limits and sampling of one episode."""

    max_turns: int = 8
    max_response_tokens: int = 512  # actions and observations together
    max_action_tokens: int = 64
    # prompt + response the engine holds (its --max-seq-len / context length); None: unbounded.
    # A long prompt leaves the response less room: the episode ends ("length") where the next
    # request would not fit, rather than the engine refusing it.
    max_context_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: tuple[int, ...] = ()
    # routing replay: (layers, top_k) of the engine's model; each turn asks for the experts the
    # engine routed the new tokens to, and the trajectory carries them (`routed_experts`)
    routed_experts: tuple[int, int] | None = None

    def __post_init__(self):
        for name in ("max_turns", "max_response_tokens", "max_action_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"AgentConfig.{name} must be >= 1, got {getattr(self, name)}.")
        if self.routed_experts is not None and (
                len(self.routed_experts) != 2 or min(self.routed_experts) < 1):
            raise ValueError("AgentConfig.routed_experts must be (layers, top_k), each >= 1, or "
                             f"None, got {self.routed_experts}.")
        if self.max_context_tokens is not None and self.max_context_tokens < 2:
            raise ValueError("AgentConfig.max_context_tokens must be >= 2 or None, got "
                             f"{self.max_context_tokens}.")

    def sampling_params(self, max_new_tokens: int) -> dict:
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k or -1,
                    max_new_tokens=max_new_tokens, stop_token_ids=list(self.stop_token_ids))


async def close_env(env) -> None:
    """Frees what an environment holds (an SWE workspace) once its episode is over, however it
    ended; a no-op for environments without `aclose` / `close`."""
    close = getattr(env, "aclose", None)
    if close is not None:
        await close()
    elif callable(getattr(env, "close", None)):
        env.close()


async def run_episode(generator, env: Environment, tokenizer: Tokenizer, *, prompt_id: str,
                      config: AgentConfig, lease_id: str = "", group_id: int | None = None,
                      prompt_index: int | None = None, bos_id: int | None = None,
                      trajectory_id: str | None = None,
                      render_prompt: Callable[[str], list[int]] | None = None,
                      chat: ChatDeltas | None = None) -> Trajectory:
    """Plays one episode against `generator` (an `SGLangClient` or anything with its `generate`).

    A generator with `session(key)` (`SGLangClient`) plays the whole episode in one session keyed
    by the trajectory id, so every turn goes to the same engine while it answers. Each action
    token's version is `result.versions` (the learner's numbers; the client maps the engines'
    labels, which may be "default", `client.VersionMap`).

    Args:
      prompt_id, lease_id, group_id, prompt_index: the trajectory's (`LeasedPrompt`'s, when it
        answers a lease: the learner refuses an answer whose fields differ from its lease's).
      bos_id: put before the encoded `env.reset()` text, when `render_prompt` and `chat` are None.
      render_prompt: the prompt ids from the `env.reset()` text, e.g. the text rendered in a chat
        template and encoded; None: `chat.prompt_ids` of the text as a user message, or without
        `chat`, `[bos_id] + tokenizer.encode(text)`. Not with `bos_id`.
      chat: the chat template's deltas: each observation is appended as
        `chat.end_of_turn_ids(action) + chat.observation_ids(text)` (all masked). None: as
        `tokenizer.encode(text)`.

    Returns:
      The `Trajectory`; call `validate` before sending it (a missing log-prob, say, fails there).

    Raises:
      EnvironmentFailure: `env.reset` or `env.step` raised. Errors of the generator propagate
        as they are.
    """
    if (render_prompt is not None or chat is not None) and bos_id is not None:
        raise ValueError("run_episode: give render_prompt or bos_id, not both (render_prompt "
                         "writes the whole prompt; so does chat).")
    trajectory_id = trajectory_id or new_trajectory_id()
    started = time.perf_counter()
    try:
        text = env.reset()
    except Exception as e:
        raise EnvironmentFailure(f"reset raised {type(e).__name__}: {e}") from e
    prompt = _prompt_ids(text, tokenizer, bos_id=bos_id, render_prompt=render_prompt, chat=chat)
    response = _Response()
    routes = _Routes(config.routed_experts)
    metadata: dict = {}
    generate_s = env_s = 0.0
    finish, truncated = "turn_limit", True
    response_limit = config.max_response_tokens
    if config.max_context_tokens is not None:
        response_limit = min(response_limit, config.max_context_tokens - len(prompt))
    # One engine for the whole episode while it answers: its prefix cache holds the history.
    open_session = getattr(generator, "session", None)
    engine = open_session(trajectory_id) if callable(open_session) else None
    try:
        for turn in range(config.max_turns):
            budget = min(config.max_action_tokens, response_limit - len(response.ids))
            if budget < 1:
                finish = "length"
                break
            t0 = time.perf_counter()
            result = await (engine or generator).generate(
                prompt + response.ids, config.sampling_params(budget),
                rid=f"{trajectory_id}-{turn}", **routes.asked())
            generate_s += time.perf_counter() - t0
            action = response.add_action(result)
            routes.add(result, len(prompt) + len(response.ids) - 1)
            if result.finish_reason == "abort":  # the client gave up: keep what came back
                finish = "abort"
                break
            if result.finish_reason == "length" and len(response.ids) >= response_limit:
                finish = "length"  # cut by the response budget, not finished: the env never sees it
                break
            t0 = time.perf_counter()
            step = await _env_step(env, tokenizer.decode(action), turn)
            env_s += time.perf_counter() - t0
            response.reward_last(step.reward)
            metadata.update({k: v for k, v in step.info.items()
                             if isinstance(v, str | int | float | bool)})
            if step.done:
                truncated = bool(step.info.get("truncated", False))
                finish = "turn_limit" if truncated else "stop"
                break
            if chat is None:
                observation = tokenizer.encode(step.observation)
            else:  # the masked end of a cut action, then the template's delta
                observation = chat.end_of_turn_ids(action) + chat.observation_ids(step.observation)
            if len(response.ids) + len(observation) > response_limit:
                finish = "length"
                break
            response.add_observation(observation)
    finally:
        if engine is not None:
            engine.close()
    metadata["turns"] = turn + 1
    return response.trajectory(
        prompt, truncated=truncated, finish_reason=finish, prompt_id=prompt_id,
        trajectory_id=trajectory_id, lease_id=lease_id, group_id=group_id,
        prompt_index=prompt_index, env_metadata=metadata,
        timings={"generate": generate_s, "env": env_s, "total": time.perf_counter() - started},
        routed_experts=routes.array(len(prompt) + len(response.ids)))


def _prompt_ids(text: str, tokenizer: Tokenizer, *, bos_id: int | None,
                render_prompt: Callable[[str], list[int]] | None,
                chat: ChatDeltas | None) -> list[int]:
    """The prompt's ids from the `env.reset()` text (`run_episode`'s arguments say how)."""
    if render_prompt is not None:
        return list(render_prompt(text))
    if chat is not None:
        return chat.prompt_ids([{"role": "user", "content": text}])
    return ([bos_id] if bos_id is not None else []) + tokenizer.encode(text)


async def _env_step(env: Environment, action: str, turn: int):
    """`env.step(action)`, awaited if the environment's step is async; what it raises comes
    back as an `EnvironmentFailure`."""
    try:
        step = env.step(action)
        if inspect.isawaitable(step):
            step = await step
    except Exception as e:
        raise EnvironmentFailure(f"step {turn} raised {type(e).__name__}: {e}") from e
    return step


@dataclasses.dataclass
class _Response:
    """The response as it grows, token by token: actions (mask 1, with the engine's log-probs
    and versions) and observations (mask 0, no log-prob, version -1), rewards on the last token
    of the action that earned them."""

    ids: list[int] = dataclasses.field(default_factory=list)
    mask: list[bool] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    rewards: list[float] = dataclasses.field(default_factory=list)

    def add_action(self, result) -> list[int]:
        """Appends a generation's tokens; returns them."""
        action = list(result.output_ids)
        self.ids += action
        self.mask += [True] * len(action)
        self.logprobs += [math.nan if lp is None else float(lp) for lp in result.logprobs]
        self.versions += result.versions  # the learner's numbers, mapped by the client
        self.rewards += [0.0] * len(action)
        return action

    def add_observation(self, observation: list[int]) -> None:
        self.ids += observation
        self.mask += [False] * len(observation)
        self.logprobs += [math.nan] * len(observation)
        self.versions += [-1] * len(observation)
        self.rewards += [0.0] * len(observation)

    def reward_last(self, reward) -> None:
        """Adds `reward` (if any) to the last token so far."""
        if reward and self.rewards:
            self.rewards[-1] += float(reward)

    def trajectory(self, prompt: list[int], **fields) -> Trajectory:
        """The `Trajectory` of `prompt` and this response, with the other `fields` given."""
        return Trajectory(
            prompt_ids=np.asarray(prompt, np.int32),
            response_ids=np.asarray(self.ids, np.int32),
            action_mask=np.asarray(self.mask, bool),
            rollout_logprobs=np.asarray(self.logprobs, np.float32),
            weight_versions=np.asarray(self.versions, np.int32),
            rewards=np.asarray(self.rewards, np.float32),
            **fields)


@dataclasses.dataclass
class _Routes:
    """The experts the engine routed an episode's tokens to, turn by turn (routing replay;
    `shape` None: not asked for, and every method a no-op)."""

    shape: tuple[int, int] | None  # (layers, top_k)
    positions: int = 0  # routed so far, from the first token
    chunks: list = dataclasses.field(default_factory=list)

    def asked(self) -> dict:
        """The `generate` arguments that ask for the routes of the positions not yet routed."""
        return {} if self.shape is None else {"routed_experts_from": self.positions}

    def add(self, result, upto: int) -> None:
        """A turn's routes (`result.routed_experts`), of positions `positions` .. `upto - 1`:
        every position but the last, which the engine never ran."""
        if self.shape is None:
            return
        width = self.shape[0] * self.shape[1]
        flat = result.routed_experts
        flat = np.asarray(flat if flat is not None else [], np.int32)
        if flat.size != (upto - self.positions) * width:
            raise ValueError(f"the engine routed {flat.size // width} positions, the turn needs "
                             f"{upto - self.positions} of [layers, top_k] = {list(self.shape)}: "
                             "does it serve the policy's model?")
        self.chunks.append(flat.reshape(-1, *self.shape))
        self.positions = upto

    def array(self, tokens: int) -> np.ndarray:
        """`[tokens, layers, top_k]`, -1 past the positions routed (the last token); not asked
        for, empty."""
        if self.shape is None:
            return np.zeros((0, 0, 0), np.int16)
        out = np.full((tokens, *self.shape), -1, np.int16)
        out[:self.positions] = np.concatenate(self.chunks) if self.chunks else 0
        return out
