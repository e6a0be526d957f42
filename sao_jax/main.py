"""Entry point: train (or evaluate) one experiment.

    python -m sao_jax.main --config=experiments/toy.py [--workdir=runs/toy] [--config.x=y ...]
    python -m sao_jax.main --config=experiments/toy.py --eval=runs/toy     # a checkpoint's score
    python -m sao_jax.main --config=experiments/swe.py --plan [--topology=v5p:2x4x4]
                                            # the learner step compiled for a TPU slice
    python -m sao_jax.main --config=... --coordinator=host0:1234 --num_processes=4 \
        --process_id=<i>                     # one learner process per host
                                            # (docs/scale.md, "A learner across hosts")

`make train EXP=<name> ARGS='...'`, `make eval EXP=<name> CKPT=<dir>` and `make plan EXP=<name>
[TOPOLOGY=...]` run these; `--plan` exits 1 when the step does not fit (`sao_jax.train.plan`).
The config file is locked: overriding a field that does not exist fails. The workdir defaults to
`runs/<name>`; re-running the same command resumes from its latest checkpoint.
"""

from __future__ import annotations

import json
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment file (get_config())",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (default: runs/<config.name>)")
_EVAL = flags.DEFINE_string("eval", None, "evaluate this checkpoint instead of training")
_PLAN = flags.DEFINE_bool("plan", False, "compile the learner step for a TPU topology and "
                          "report its memory and FLOPs instead of training")
_TOPOLOGY = flags.DEFINE_string("topology", None, "the TPU topology for --plan (default: "
                                "config.plan.topology)")
_PLAN_JSON = flags.DEFINE_string("plan_json", None, "with --plan, also write the figures here")
_COORDINATOR = flags.DEFINE_string("coordinator", None, "a multi-process learner: host:port of "
                                   "process 0 (default $JAX_COORDINATOR_ADDRESS; a TPU VM "
                                   "slice needs none of these three)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "processes of the learner "
                                      "(default $JAX_NUM_PROCESSES)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index (default "
                                   "$JAX_PROCESS_ID)")


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax and grain narrate every call at INFO
    config = _CONFIG.value
    if config is None:
        raise app.UsageError("--config=experiments/<name>.py is required")
    from sao_jax.train import distributed

    try:
        processes = distributed.settings(_COORDINATOR.value, _NUM_PROCESSES.value,
                                         _PROCESS_ID.value)
    except ValueError as e:
        print(f"sao_jax: {e}", file=sys.stderr)
        return 2
    if processes.num_processes > 1 and (_PLAN.value or _EVAL.value):
        print("sao_jax: --plan and --eval run in one process: drop the multi-process flags "
              "(or JAX_NUM_PROCESSES).", file=sys.stderr)
        return 2
    distributed.initialize(processes)  # before anything else touches JAX
    from sao_jax.train import learner  # after flags: keeps --help fast
    from sao_jax.train.build import setup_compilation_cache
    from sao_jax.train.console import TrainingError
    from sao_jax.train.processes import ChildExited

    if _PLAN.value:
        from sao_jax.train import plan as planning

        try:
            plan = planning.make_plan(config, _TOPOLOGY.value)
        except ValueError as e:
            print(f"sao_jax: {e}", file=sys.stderr)
            return 1
        print(plan.report())
        if _PLAN_JSON.value:
            planning.write_json(plan, _PLAN_JSON.value)
        return 0 if plan.fits else 1
    setup_compilation_cache(config)
    if _EVAL.value:
        result = learner.evaluate_checkpoint(config, _EVAL.value)
        print(json.dumps(result, indent=2))
        return 0
    workdir = _WORKDIR.value or os.path.join("runs", config.name)
    cluster = distributed.Cluster(processes)
    try:
        summary = learner.train(config, workdir, cluster=cluster)
    except KeyboardInterrupt:
        print("stopped; re-run the same command to resume from the last checkpoint",
              file=sys.stderr)
        return 130
    except (ValueError, TrainingError, ChildExited) as e:
        print(f"sao_jax: {e}", file=sys.stderr)
        return 1
    if not cluster.leader:
        return 0
    print(json.dumps(summary, indent=2))
    print(f"summary written to {os.path.join(workdir, 'summary.json')}; "
          f"tensorboard --logdir {os.path.join(workdir, 'tb')}")
    return 0


def run() -> None:
    app.run(lambda argv: sys.exit(main(argv)))


if __name__ == "__main__":
    run()
