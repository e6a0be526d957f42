"""Real SGLang servers started on this host: SGLang's own virtualenv, made once per machine,
and each server's command line and environment (`rollout.engine = "sglang"` without
`rollout.engine_urls`; `make sglang` makes the virtualenv alone).

    python -m sao_jax.engine.sglang_server            # make the virtualenv (make sglang)
    python -m sao_jax.engine.sglang_server --check    # say whether it is there

SGLang pins its own torch, transformers and numpy, so it cannot share the project's virtualenv:
it gets one of its own, `$SAO_SGLANG_VENV` or `$XDG_CACHE_HOME/sao_jax/sglang-<version>` (by
default `~/.cache/sao_jax/sglang-0.5.23`), shared by every clone on the machine. Making it takes
about 5 minutes and 11 GB; a lock keeps two runs from making it at once, and a marker file,
written last, says it is complete.

The server runs under `sglang_child.py` (it dies with the learner). With `device="cpu"` it gets
what SGLang needs to serve on a CPU: `SGLANG_USE_CPU_ENGINE=1`, the CPU stand-in for
`sgl_kernel` (`sgl_kernel_cpu/`) first on its PYTHONPATH, and the plain-torch backends
(`CPU_FLAGS`). On every device it returns the temperature-1 log-probs DIS needs
(`SGLANG_RETURN_ORIGINAL_LOGPROB=1`: the model's own full-softmax log-prob of each sampled token,
whatever temperature, top-p or top-k sampled it; `sao_jax.rl.dis_loss`), answers token ids
(`--skip-tokenizer-init`) and names its launch weights as the learner's version.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shlex
import shutil
import subprocess
import sys
import time

SGLANG_VERSION = "0.5.23"
MARKER = ".sao_jax_complete"
DEVICES = ("cpu", "cuda")
STAND_IN_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sgl_kernel_cpu")
CHILD_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang_child.py")
# Serving on a CPU: SGLang's plain-torch attention, sampling and no CUDA graphs or grammar
# backend (those need kernels the CPU lacks). The KV cache is sized by max_total_tokens. Without
# --sleep-on-idle an idle scheduler polls its sockets at 50-75% of a core, which a CPU host's
# learner needs.
CPU_FLAGS = ("--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
             "--sampling-backend", "pytorch", "--grammar-backend", "none",
             "--mem-fraction-static", "0.05", "--sleep-on-idle")


class SGLangUnavailable(RuntimeError):
    """SGLang's virtualenv cannot be made here; the message says why."""


def venv_dir() -> str:
    """Where SGLang's virtualenv lives: `$SAO_SGLANG_VENV`, else the shared cache."""
    if os.environ.get("SAO_SGLANG_VENV"):
        return os.environ["SAO_SGLANG_VENV"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "sao_jax", f"sglang-{SGLANG_VERSION}")


def python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def is_ready(venv: str) -> bool:
    return os.path.exists(os.path.join(venv, MARKER)) and os.access(python(venv), os.X_OK)


def ensure_venv(venv: str | None = None, log=print) -> str:
    """SGLang's interpreter, making its virtualenv first if it is not complete (minutes; the
    pip log goes to `<venv>.log`). Raises `SGLangUnavailable` naming the log when it fails."""
    venv = venv or venv_dir()
    if is_ready(venv):
        return python(venv)
    os.makedirs(os.path.dirname(venv) or ".", exist_ok=True)
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another run may be making it: wait for that one
        if is_ready(venv):
            return python(venv)
        log(f"making SGLang {SGLANG_VERSION}'s virtualenv in {venv} (once per machine: about 5 "
            f"minutes and 11 GB; pip's log: {venv}.log)")
        start = time.monotonic()
        shutil.rmtree(venv, ignore_errors=True)  # an earlier attempt that did not finish
        # pip in this process's environment; the import check as a CPU server starts (the
        # stand-in kernels on its path: `server_env`)
        steps = [([sys.executable, "-m", "venv", venv], None),
                 ([python(venv), "-m", "pip", "install", "--upgrade", "pip"], None),
                 ([python(venv), "-m", "pip", "install", f"sglang=={SGLANG_VERSION}"], None),
                 ([python(venv), "-c", "import sglang.srt.entrypoints.http_server"],
                  server_env("cpu"))]
        with open(f"{venv}.log", "w") as out:
            for argv, env in steps:
                out.write(f"$ {shlex.join(argv)}\n")
                out.flush()
                code = subprocess.call(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
                if code:
                    raise SGLangUnavailable(
                        f"making SGLang's virtualenv failed ({shlex.join(argv[-3:])} exited "
                        f"with {code}); see {venv}.log")
        with open(os.path.join(venv, MARKER), "w") as f:
            f.write(f"sglang=={SGLANG_VERSION}\n")
        log(f"SGLang's virtualenv is ready ({time.monotonic() - start:.0f} s)")
    return python(venv)


def check_servable(hf_config: dict) -> None:
    """Raises ValueError, naming the fields, for a model (its `config.json` as a dict) that
    SGLang 0.5.23 loads without complaint but computes differently from the learner: its
    Qwen3-MoE makes every layer MoE and gives the LM head weights of its own, whatever
    `mlp_only_layers`, `decoder_sparse_step` and `tie_word_embeddings` say, so such a model
    would sample from a policy the learner never had."""
    if hf_config.get("model_type") != "qwen3_moe":
        return
    wrong = [f"{field} = {hf_config[field]!r}" for field, fine in (
        ("tie_word_embeddings", False), ("mlp_only_layers", []), ("decoder_sparse_step", 1))
        if field in hf_config and hf_config[field] not in (fine, None, ())]
    if wrong:
        raise ValueError(
            f"SGLang {SGLANG_VERSION}'s Qwen3-MoE would serve this model wrongly: it ignores "
            f"{', '.join(wrong)} (every layer MoE, an LM head of its own). Use a model without "
            "them (config.model.preset = 'toy_moe' for the toy) or "
            "config.rollout.engine = 'embedded'.")


def server_env(device: str, calls_file: str | None = None, base: dict | None = None) -> dict:
    """The environment of an SGLang server on `device` (see the module doc); `calls_file`
    records any call of the CPU stand-in kernels."""
    if device not in DEVICES:
        raise ValueError(f"config.rollout.sglang.device must be one of {DEVICES}, got "
                         f"{device!r}.")
    env = dict(os.environ if base is None else base)
    env["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"
    for name in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):  # the project's, not SGLang's
        env.pop(name, None)
    if device == "cpu":
        env["SGLANG_USE_CPU_ENGINE"] = "1"
        env["PYTHONPATH"] = STAND_IN_DIR
        env["CUDA_VISIBLE_DEVICES"] = ""
        if calls_file:
            env["SAO_SGL_KERNEL_CALLS"] = calls_file
    return env


def server_argv(model_path: str, *, port: int, weight_version: int, device: str = "cpu",
                max_running_requests: int = 8, context_length: int = 1024,
                max_total_tokens: int | None = None, seed: int = 0, dtype: str = "float32",
                extra_args: str = "", routed_experts: bool = False) -> list[str]:
    """The arguments of `sglang_child.py` (after the interpreter) for one server on
    127.0.0.1:`port` serving `model_path`, its weights named `weight_version`;
    `routed_experts`: it reports the experts of every token on request (routing replay)."""
    argv = [CHILD_SCRIPT, "--model-path", os.path.abspath(model_path),
            "--host", "127.0.0.1", "--port", str(port),
            "--weight-version", str(weight_version), "--skip-tokenizer-init",
            "--dtype", dtype, "--random-seed", str(seed),
            "--max-running-requests", str(max_running_requests),
            "--context-length", str(context_length),
            "--max-total-tokens", str(max_total_tokens or max_running_requests * context_length),
            "--log-level", "warning"]
    if device == "cpu":
        argv += CPU_FLAGS
    if routed_experts:
        argv.append("--enable-return-routed-experts")
    return argv + shlex.split(extra_args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 0 when the virtualenv is complete, 1 when not (makes nothing)")
    parser.add_argument("--venv", default=None, help=f"default {venv_dir()}")
    args = parser.parse_args(argv)
    venv = args.venv or venv_dir()
    if args.check:
        print(f"{venv}: {'ready' if is_ready(venv) else 'not made'}")
        return 0 if is_ready(venv) else 1
    with contextlib.suppress(KeyboardInterrupt):
        try:
            print(ensure_venv(venv))
            return 0
        except SGLangUnavailable as e:
            print(e, file=sys.stderr)
            return 1
    return 130


if __name__ == "__main__":
    sys.exit(main())
