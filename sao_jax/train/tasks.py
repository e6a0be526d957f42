"""What an experiment trains on: prompt rows for training and evaluation, environment, tokenizer.

A task turns `config.env` into what the entry of `config.env.name` in `envs.registry.REGISTRY`
says: rows (mappings leased to workers as prompt data), an environment factory and stop tokens,
the environment's options (the same mapping workers get as `--env-options`); and a tokenizer,
with the prompt and observation rendering the workers use (`sao_jax.text`).
Training rows carry `index` (the running-mean slot) and `prompt_id`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence

from sao_jax.envs import registry
from sao_jax.rollout.agent import AgentConfig
from sao_jax.text import ChatDeltas, chat_deltas, load_tokenizer, prompt_renderer


@dataclasses.dataclass(frozen=True)
class Task:
    env: str  # the name of its entry in `envs.registry.REGISTRY` (`spec`)
    train_rows: Sequence[Mapping]
    eval_rows: Sequence[Mapping]
    tokenizer_path: str | None  # None: the toy CharTokenizer
    tokenizer: object
    make_env: Callable
    render_prompt: Callable[[str], list[int]]
    agent: AgentConfig  # training episodes (temperature of config.rollout)
    env_options: Mapping = dataclasses.field(default_factory=dict)  # JSON-able, for workers
    chat: ChatDeltas | None = None  # observations as chat-template deltas (as the workers do)

    def eval_agent(self, temperature: float) -> AgentConfig:
        return dataclasses.replace(self.agent, temperature=temperature)

    @property
    def spec(self) -> registry.EnvSpec:
        """The environment's registry entry."""
        return registry.get(self.env)


def make_task(config) -> Task:
    """The task of `config.env`; errors name the field to fix."""
    name = config.env.name
    if name not in registry.REGISTRY:
        raise ValueError(f"config.env.name = {name!r}: choose one of "
                         f"{sorted(registry.REGISTRY)}.")
    spec = registry.REGISTRY[name]
    train, evals = spec.rows(config)
    options = spec.options(config) if spec.options is not None else {}
    tokenizer_path = config.env.tokenizer or None
    tokenizer = load_tokenizer(tokenizer_path)
    agent = AgentConfig(max_turns=config.env.max_turns,
                        max_response_tokens=config.env.max_response_tokens,
                        max_action_tokens=config.env.max_action_tokens,
                        max_context_tokens=config.rollout.engine_max_seq_len,
                        temperature=config.rollout.temperature,
                        stop_token_ids=tuple(spec.stop_token_ids(tokenizer)))
    return Task(env=name, train_rows=train, eval_rows=evals, tokenizer_path=tokenizer_path,
                tokenizer=tokenizer, make_env=functools.partial(spec.make_env, options=options),
                render_prompt=prompt_renderer(tokenizer), agent=agent,
                env_options=options, chat=chat_deltas(tokenizer))
