"""The one list of rollout engines: `ENGINES`, the kinds `config.rollout.engine` names.

An entry carries what the supervisor (`train/supervisor.py`) and the config's checks
(`build.check_config`) need to know about a kind of engine: the model it refuses to serve, how
its servers are prepared, on which ports they start, how long a start may take, their command
line, whether it serves servers the user started (`rollout.engine_urls`) and whether it drains
running requests before a weight update (`rollout.update_drain_s`). Neither of them names an
engine; they read the entry (`tests/test_structure.py` checks that no module compares an
engine's name).

    embedded  the JAX engine of this repository (`python -m sao_jax.engine.server`), on a socket
              bound here and handed to the child; starts within 300 s; drains
    sglang    real SGLang servers (`engine/sglang_server.py`) under SGLang's interpreter, on
              ports picked here; those of `rollout.engine_urls` when set
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from sao_jax.engine import sglang_server
from sao_jax.train.processes import (
    Command,
    embedded_engine_command,
    free_port,
    free_ports,
    port_is_free,
)


def reports_routes(config) -> bool:
    """Whether the engines report, and trajectories carry, the experts of every token:
    `config.rl.routing_replay` (the learner replays them) or `config.rl.engine_routes` (it
    only compares its own routing with them)."""
    return bool(config.rl.get("routing_replay", False) or config.rl.get("engine_routes", False))


def _no_python(rollout, log) -> None:
    return None


def _any_ports(n: int) -> list[int]:
    return [0] * n


@dataclasses.dataclass(frozen=True)
class EngineKind:
    """One kind of rollout engine, as the supervisor starts and restarts its servers.

    Args:
      name: `config.rollout.engine`.
      title: what a sentence calls its servers ("SGLang servers have no drain").
      command: `(config, i, path, version, port, *, python, cache_dir, calls_file) -> Command`:
        server `i`'s command, serving the weights at `path` (`version`) on `port`, or on
        another port if `port` is 0 or taken (`Command.port` says which); `python` is what
        `prepare` returned, `cache_dir` the compilation cache (`build.compilation_cache_dir`),
        `calls_file` where a server on a CPU records calls of SGLang's stand-in kernels.
      startup_timeout_s: `(config.rollout) -> seconds` a server may take to answer.
      ports: `(n) -> [port, ...]`, the ports `n` servers start on (0: any, bound by `command`).
      prepare: `(config.rollout, log) -> python`: readies what the servers run under, once per
        run, before the first starts; None: this interpreter.
      check_model: `(hf_config) -> None` raises ValueError for a model (its `config.json` as a
        dict) the engine would serve wrongly; None: it serves any.
      takes_urls: it serves through servers the user started (`rollout.engine_urls`).
      drains: a weight update can let running requests finish first (`rollout.update_drain_s`).
    """

    name: str
    title: str
    command: Callable[..., Command]
    startup_timeout_s: Callable[..., float]
    ports: Callable[[int], list[int]] = _any_ports
    prepare: Callable[..., str | None] = _no_python
    check_model: Callable[[dict], None] | None = None
    takes_urls: bool = False
    drains: bool = False


def _embedded_command(config, i: int, path: str, version: int, port: int, *, python,
                      cache_dir, calls_file) -> Command:
    # With `precompile_steps`, every prefill compiled before the engine answers: a run's
    # requests never wait for a compile (once compiled, the persistent cache makes later starts
    # quick). Without, the smallest: larger prompts compile theirs on first use.
    rollout = config.rollout
    options = dict(weight_version=version, max_batch=rollout.engine_max_batch,
                   max_seq_len=rollout.engine_max_seq_len, seed=config.seed + i,
                   compilation_cache_dir=cache_dir, warmup_prefills=config.precompile_steps,
                   routed_experts=reports_routes(config))
    try:
        return embedded_engine_command(path, port=port, **options)
    except OSError:  # taken while the engine was down
        return embedded_engine_command(path, port=0, **options)


def _sglang_command(config, i: int, path: str, version: int, port: int, *, python,
                    cache_dir, calls_file) -> Command:
    rollout = config.rollout
    port = port if port and port_is_free(port) else free_port()
    device = rollout.sglang.device
    return Command(
        tuple(sglang_server.server_argv(
            path, port=port, weight_version=version, device=device,
            max_running_requests=rollout.engine_max_batch,
            context_length=rollout.engine_max_seq_len, seed=config.seed + i,
            dtype=config.model.dtype, extra_args=rollout.sglang.extra_args,
            routed_experts=reports_routes(config))),
        python=python, env=sglang_server.server_env(device, calls_file))


def _sglang_python(rollout, log) -> str:
    return sglang_server.ensure_venv(rollout.sglang.venv or None, log=log)


ENGINES: dict[str, EngineKind] = {kind.name: kind for kind in (
    EngineKind(name="embedded", title="embedded engines", command=_embedded_command,
               startup_timeout_s=lambda rollout: 300.0, drains=True),
    # An SGLang server binds the port picked for it; it starts SGLang's own interpreter.
    EngineKind(name="sglang", title="SGLang servers", command=_sglang_command,
               startup_timeout_s=lambda rollout: rollout.sglang.startup_timeout_s,
               ports=free_ports, prepare=_sglang_python,
               check_model=sglang_server.check_servable, takes_urls=True),
)}


def engine_of(config) -> EngineKind:
    """The entry of `config.rollout.engine`; a ValueError naming the kinds if there is none."""
    name = config.rollout.engine
    if name not in ENGINES:
        raise ValueError(f"config.rollout.engine must be "
                         f"{' or '.join(repr(n) for n in ENGINES)}, got {name!r}.")
    return ENGINES[name]
