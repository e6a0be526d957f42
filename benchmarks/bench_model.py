"""Model throughput: training tokens/s and decode tokens/s, per preset and expert dispatch.

    make bench                                       # runs this after bench_gae.py
    python benchmarks/bench_model.py --presets toy 100m --batch 4 --length 256

Training: one jitted policy step (forward, cross-entropy, backward, AdamW) on B x T tokens, timed
as the median of repeats after compilation. Decode: `generate` with the KV cache, B prompts of 16
tokens, N new tokens each, greedy. On a GPU it also prints MFU against the device's peak
(`--peak-tflops`), counting 6 * active parameters * tokens for training.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from _table import print_header
from flax import nnx

from sao_jax.models import CausalLM
from sao_jax.models.config import preset
from sao_jax.models.sampling import SamplingParams, generate
from sao_jax.train import make_optimizer, policy_optimizer_config


def active_params(model: CausalLM) -> tuple[int, int]:
    """(total parameters, parameters a token passes through: top-k of the experts)."""
    cfg = model.cfg
    total = active = 0
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        size = var.get_value().size
        total += size
        expert = "moe" in path and path[-1] in ("gate_proj", "up_proj", "down_proj")
        active += size * cfg.num_experts_per_tok // cfg.num_experts if expert else size
    return total, active


def median_seconds(fn, repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def bench_train(model: CausalLM, batch: int, length: int, dispatch: str, repeats: int) -> float:
    optimizer = nnx.Optimizer(model, make_optimizer(policy_optimizer_config(1e-4),
                                                    nnx.state(model, nnx.Param)), wrt=nnx.Param)
    ids = jax.random.randint(jax.random.key(0), (batch, length), 0, model.cfg.vocab_size)

    def loss_fn(m, ids):
        logp = jax.nn.log_softmax(m(ids, dispatch=dispatch), axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp[:, :-1], ids[:, 1:, None], axis=-1))

    @nnx.jit
    def step(m, opt, ids):
        loss, grads = nnx.value_and_grad(loss_fn)(m, ids)
        opt.update(m, grads)
        return loss

    return median_seconds(lambda: step(model, optimizer, ids), repeats)


def bench_decode(model: CausalLM, batch: int, new_tokens: int, repeats: int) -> float:
    prompts = jax.random.randint(jax.random.key(1), (batch, 16), 0, model.cfg.vocab_size)
    params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    return median_seconds(
        lambda: generate(model, prompts, jnp.full((batch,), 16), params, jax.random.key(2)),
        repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="+", default=["toy", "100m"])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--decode-batch", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--peak-tflops", type=float, default=0.0,
                        help="device peak for MFU (e.g. 989 for an H100/H200 in bf16)")
    args = parser.parse_args()

    header = (f"{'preset':>7} {'params':>8} {'active':>8} {'dispatch':>9} {'train tok/s':>12} "
              f"{'step s':>7} {'decode tok/s':>13}" + (f" {'MFU':>6}" if args.peak_tflops else ""))
    print_header(header)
    for name in args.presets:
        model = CausalLM(preset(name), nnx.Rngs(0))
        total, active = active_params(model)
        decode_s = bench_decode(model, args.decode_batch, args.new_tokens, args.repeats)
        decode_rate = args.decode_batch * args.new_tokens / decode_s
        for dispatch in ("dense", "ragged", "capacity"):
            fresh = CausalLM(preset(name), nnx.Rngs(0))
            step_s = bench_train(fresh, args.batch, args.length, dispatch, args.repeats)
            tokens = args.batch * args.length
            line = (f"{name:>7} {total / 1e6:>7.2f}M {active / 1e6:>7.2f}M {dispatch:>9} "
                    f"{tokens / step_s:>12.0f} {step_s:>7.3f} {decode_rate:>13.0f}")
            if args.peak_tflops:
                line += f" {6 * active * tokens / step_s / (args.peak_tflops * 1e12):>6.1%}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
