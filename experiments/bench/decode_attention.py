"""A decode loop with its attention scores keys-first (what a CPU runs) against
queries-first (the other order), side by side in one process.

    python -m experiments.bench.decode_attention                      # the three workloads below
    python -m experiments.bench.decode_attention --quick              # tiny-llama, seconds, any machine

A decode step's attention has a few queries per (row, kv head) (Qwen2.5: 7, SmolLM2: 3) against
every cached key. XLA:CPU gives the score product to YNNPACK, which runs queries @ keys^T far below
the speed of reading the keys once they are large, and keys @ queries^T (the same sums, another
order) at the speed of reading them (``models.decoder._keys_lead_the_product``; docs/benchmarks.md,
"Decode attention on CPU", has the figures). Each workload decodes ``new`` tokens for
``batch`` rows that already hold ``held`` tokens in a ``cache``-slot cache (random weights, float32,
stop tokens off), once per orientation per repeat, alternating (ABBA); medians reported.

- ``frozen-lake``: ``configs/learn_frozen_lake.py``'s decode (SmolLM2-135M, 64 rows, 640 slots).
- ``generate``: ``bench.generate``'s CPU row (SmolLM2-135M, 32 rows, a 256-token prompt), 64 new tokens.
- ``qwen``: Qwen2.5-0.5B's shape at 128 rows in a 896-slot window (``bench.step --cost-only``'s).
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments.bench.common import machine, markdown_table, require_positive, write_markdown, write_report
from starpo_jax.models import Decoder, ModelState, decoder, preset
from starpo_jax.rollout import sampling

WORKLOADS = {  # name: (model, batch, cache slots, tokens held, new tokens)
    "frozen-lake": ("smollm2-135m-instruct", 64, 640, 300, 48),
    "generate": ("smollm2-135m-instruct", 32, 512, 256, 64),
    "qwen": ("qwen2.5-0.5b", 128, 896, 512, 16),
}
QUICK = {"tiny": ("tiny-llama", 4, 64, 16, 8)}
ORIENTATIONS = {"keys-first": decoder.KEYS_LEAD_MAX_QUERIES, "queries-first": 0}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=1, help="ABBA rounds per workload (each times both twice)")
    p.add_argument("--quick", action="store_true", help="tiny-llama only, one round: a smoke run")
    p.add_argument("--note", default="", help="free text for the report (machine load, ...)")
    p.add_argument("--out", default="bench_results/decode_attention.json")
    args = p.parse_args(argv)
    require_positive(p, args, "repeats")
    return args


def decode_program(config, batch: int, cache_slots: int, held: int, new: int, max_queries: int):
    """The decode call compiled with the scores oriented by ``max_queries``, and its arguments."""
    model = ModelState.split(Decoder(config, rngs=nnx.Rngs(0)))
    cache = sampling.init_cache(config, batch, cache_slots).replace(lengths=np.full((batch,), held, np.int32))
    logits = np.random.default_rng(0).standard_normal((batch, config.vocab_size)).astype(np.float32)
    args = (model, cache, logits, jax.random.key(0))
    with mock.patch.object(decoder, "KEYS_LEAD_MAX_QUERIES", max_queries):
        jax.clear_caches()  # sampling.decode is jitted: without this it reuses the other orientation's trace
        start = time.perf_counter()
        compiled = jax.jit(lambda m, c, logits, k: sampling.decode(m, c, logits, k, max_new_tokens=new)).lower(*args).compile()
    return compiled, args, time.perf_counter() - start


def run_workload(spec, repeats: int) -> dict:
    name, batch, cache_slots, held, new = spec
    config = preset(name, dtype="float32", param_dtype="float32")
    programs = {o: decode_program(config, batch, cache_slots, held, new, q) for o, q in ORIENTATIONS.items()}
    outputs: dict = {}  # orientation -> the warm-up's decoded output
    times: dict[str, list[float]] = {o: [] for o in ORIENTATIONS}
    order = list(ORIENTATIONS)
    for o in order:  # warm-up; keeps the tokens to compare
        compiled, args, _ = programs[o]
        outputs[o] = jax.block_until_ready(compiled(*args))
    for _ in range(repeats):
        for o in order + order[::-1]:
            compiled, args, _ = programs[o]
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times[o].append(time.perf_counter() - start)
    a, b = (outputs[o] for o in order)
    return {
        "model": name, "batch": batch, "cache": cache_slots, "held": held, "new_tokens": new,
        "seconds": {o: times[o] for o in order},
        "median_s": {o: statistics.median(times[o]) for o in order},
        "compile_s": {o: programs[o][2] for o in order},
        "speedup": statistics.median(times["queries-first"]) / statistics.median(times["keys-first"]),
        "same_tokens": float(np.mean(np.asarray(a.tokens) == np.asarray(b.tokens))),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    specs = QUICK if args.quick else {w: WORKLOADS[w] for w in args.workloads}
    repeats = 1 if args.quick else args.repeats
    results = {}
    for workload, spec in tqdm(specs.items(), desc="workloads", unit="workload"):
        results[workload] = run_workload(spec, repeats)
        r = results[workload]
        tqdm.write(f"{workload}: keys-first {r['median_s']['keys-first']:.2f} s, queries-first "
                   f"{r['median_s']['queries-first']:.2f} s ({r['speedup']:.2f}x)")
    report = {"machine": machine(args.note), "repeats": repeats, "results": results}
    path = write_report(report, args.out)
    rows = [[w, f"{r['model']}, {r['batch']} rows, {r['cache']} slots ({r['held']} held), {r['new_tokens']} new",
             f"{r['median_s']['queries-first']:.2f}", f"{r['median_s']['keys-first']:.2f}", f"{r['speedup']:.2f}x",
             f"{r['same_tokens']:.3f}"] for w, r in results.items()]
    write_markdown(markdown_table(["workload", "decode", "queries-first s", "keys-first s", "speed-up",
                                   "tokens alike"], rows), path)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
