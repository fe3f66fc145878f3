"""``sampling.append`` in the smallest cache window against the whole cache: the first turn's
prefill and a later turn's append into a rollout-sized cache, each compiled apart and timed.

    python -m experiments.bench.append_window                   # Qwen2.5-0.5B shape, batch 128, cache 2,779
    python -m experiments.bench.append_window --model tiny-qwen2 --batch 4 --repeats 2   # seconds, any CPU

Workload (random weights, the compute dtype of the device: bfloat16 on a GPU): ``--prompt`` tokens
into an empty cache of ``--cache`` slots (the rollout's first turn), then ``--turn`` tokens appended
to rows already holding ``--held`` (a later turn). The attention of an append reads every slot of
the cache it is given; the window bounds that to the slots the rows can reach.
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np
from flax import nnx

from experiments.bench.common import require_positive, require_presets
from experiments.bench.generation_timing import median_time
from starpo_jax.models import Decoder, ModelState, preset
from starpo_jax.rollout import sampling
from starpo_jax.runtime import allocator


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench.append_window",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-0.5b", help="model preset (random weights)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--cache", type=int, default=2779, help="slots per row (bench.step's paper-size rollout: 2,779)")
    p.add_argument("--prompt", type=int, default=267, help="first turn's tokens")
    p.add_argument("--held", type=int, default=1200, help="tokens each row holds before the later turn")
    p.add_argument("--turn", type=int, default=64, help="later turn's tokens")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per setting (median)")
    args = p.parse_args(argv)
    require_presets(p, [args.model])
    require_positive(p, args, "batch", "cache", "prompt", "held", "turn", "repeats")
    if max(args.prompt, args.held + args.turn) > args.cache:
        p.error(f"--prompt {args.prompt}, or --held {args.held} + --turn {args.turn}, does not fit --cache {args.cache}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    dtype = "bfloat16" if jax.default_backend() == "gpu" else "float32"
    config = preset(args.model, dtype=dtype, param_dtype=dtype)
    model = ModelState.split(Decoder(config, rngs=nnx.Rngs(0)))
    rng = np.random.default_rng(0)
    B = args.batch
    empty = sampling.init_cache(config, B, args.cache)
    held = empty.replace(lengths=np.full((B,), args.held, np.int32))
    cases = {
        "first turn": (empty, rng.integers(0, config.vocab_size, (B, args.prompt), np.int32)),
        "later turn": (held, rng.integers(0, config.vocab_size, (B, args.turn), np.int32)),
    }
    records = []
    for name, (cache, tokens) in cases.items():
        num_new = np.full((B,), tokens.shape[1], np.int32)
        for windowed in (True, False):
            start = time.perf_counter()
            jitted = jax.jit(lambda m, c, t, n, w=windowed: sampling.append(m, c, t, n, windowed=w))
            program = jitted.lower(model, cache, tokens, num_new).compile()
            compile_s = time.perf_counter() - start
            run = lambda i, p=program: jax.block_until_ready(p(model, cache, tokens, num_new))  # noqa: E731
            run(0)  # warm-up
            seconds, _ = median_time(run, args.repeats)
            records.append({"case": name, "windowed": windowed, "seconds": seconds, "compile_s": compile_s})
            print(f"{name}: {'window' if windowed else 'whole cache':12} {seconds * 1e3:9.2f} ms "
                  f"(compile {compile_s:.1f} s)", flush=True)
    print(f"{jax.devices()[0].device_kind}, {args.model} {dtype}, "
          f"batch {B}, cache {args.cache}")
    return records


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
