"""The embedded engine in a subprocess, as the rollout tests start it (`start_engine`,
`stop_engine`), the toy model it serves (`toy_model`), the teacher-forced log-probs its replies are
checked against (`teacher_forced`), and the HTTP calls the tests make to it (`post`, `get`,
`wait_for`)."""

import asyncio
import atexit
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

import aiohttp
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from sao_jax.models import CausalLM
from sao_jax.models.config import preset
from sao_jax.train.processes import listening_socket
from tests import one_device_flags

MAX_BATCH = 8  # the engine's flags, unless a test passes its own
MAX_SEQ_LEN = 512
TF_LEN = 64  # teacher-forced sequences are padded to this length


def toy_model(seed: int) -> CausalLM:
    """The toy preset with a smaller embedding, so that next-token distributions are spread out
    (at the preset's scale, the tied embedding makes them nearly one-hot)."""
    model = CausalLM(preset("toy"), nnx.Rngs(seed))
    emb = model.backbone.embed.embedding
    emb.set_value(emb[...] * 0.2)
    return model


def engine_command(model_dir, port: int, *extra) -> list[str]:
    return [sys.executable, "-m", "sao_jax.engine.server", "--model-path", str(model_dir),
            "--port", str(port), "--max-batch", str(MAX_BATCH), "--max-seq-len",
            str(MAX_SEQ_LEN), "--log-level", "WARNING", *extra]


# Engines of this test process share one JAX cache (fresh per process): the modules that start
# an engine of the same shapes read its compiled programs back instead of compiling them again.
_COMPILATION_CACHE = tempfile.mkdtemp(prefix="sao_jax_test_engines_")
atexit.register(shutil.rmtree, _COMPILATION_CACHE, ignore_errors=True)


def engine_env() -> dict:
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=_COMPILATION_CACHE,
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.2")
    env["XLA_FLAGS"] = one_device_flags(env.get("XLA_FLAGS", ""))  # one device is enough
    return env


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 120.0):
    """Returns once the engine at `url` answers `/health_generate` (another server that took
    the port would not)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"engine exited with {proc.returncode} before serving")
        try:
            with urllib.request.urlopen(url + "/health_generate", timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"engine at {url} not up after {timeout_s} s")


def start_engine(model_dir, *extra):
    """`(process, url)` of a ready engine serving `model_dir`, on a socket bound here before it
    starts (so that no other test's server can take its port meanwhile)."""
    sock = listening_socket()
    port = sock.getsockname()[1]
    try:
        proc = subprocess.Popen(engine_command(model_dir, port, "--listen-fd", str(sock.fileno()),
                                               *extra),
                                env=engine_env(), pass_fds=(sock.fileno(),))
    finally:
        sock.close()
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc)
    except BaseException:
        proc.kill()
        raise
    return proc, url


def stop_engine(proc: subprocess.Popen):
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_forward = nnx.jit(lambda m, x: jax.nn.log_softmax(m(x), axis=-1))


def teacher_forced(model, prompt, tokens, length: int = TF_LEN) -> np.ndarray:
    """`[len(tokens), V]` log-softmax of the positions that predict `tokens` after `prompt`."""
    seq = np.zeros((1, length), np.int32)  # one padded length: one compilation
    n, m = len(prompt), len(tokens)
    assert n + m <= length
    seq[0, :n + m] = np.concatenate([prompt, tokens]).astype(np.int32)
    logp = np.asarray(_forward(model, jnp.asarray(seq)))[0]
    return logp[n - 1:n - 1 + m]


def run(coro):
    return asyncio.run(coro)


async def post(url, path, body=None, raw=None):
    async with aiohttp.ClientSession() as s:
        data = raw if raw is not None else json.dumps(body if body is not None else {})
        async with s.post(url + path, data=data) as r:
            return r.status, await r.json(content_type=None)


async def get(url, path):
    async with aiohttp.ClientSession() as s:
        async with s.get(url + path) as r:
            return r.status, await r.json(content_type=None)


async def wait_for(url, predicate, timeout_s=30.0):
    """Polls /get_server_info until `predicate(info)`; returns that info."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        _, info = await get(url, "/get_server_info")
        if predicate(info):
            return info
        await asyncio.sleep(0.005)
    raise TimeoutError(f"server info never satisfied the condition: {info}")
