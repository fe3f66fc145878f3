"""A decode loop with its attention as the CPU kernel (what a CPU runs), and as XLA's products
with the scores keys-first and queries-first, side by side in one process.

    python -m experiments.bench.decode_attention                      # the three workloads below
    python -m experiments.bench.decode_attention --quick              # tiny-llama, seconds, any machine

A decode step's attention has a few queries per (row, kv head) (Qwen2.5: 7, SmolLM2: 3) against
every cached key. XLA:CPU gives the score product to YNNPACK, which runs queries @ keys^T far below
the speed of reading the keys once they are large, and keys @ queries^T (the same sums, another
order) at the speed of reading them (``models.decoder._keys_lead_the_product``), but on one core;
the kernel (``models.cpu_kernels``) spreads it over the cores and reads only the held slots
(docs/benchmarks.md, "Decode attention on CPU", has the figures). Each workload decodes ``new``
tokens for ``batch`` rows that already hold ``held`` tokens in a ``cache``-slot cache (random
weights, float32, stop tokens off), once per variant per repeat, in the order A B C C B A; medians
reported. The kernel is timed where it is available (a CPU with a C++ compiler).

- ``frozen-lake``: ``configs/learn_frozen_lake.py``'s decode (SmolLM2-135M, 64 rows, 640 slots).
- ``generate``: ``bench.generate``'s CPU row (SmolLM2-135M, 32 rows, a 256-token prompt), 64 new tokens.
- ``qwen``: Qwen2.5-0.5B's shape at 128 rows in a 896-slot window (``bench.step --cost-only``'s).
- ``bandit``: ``configs/learn_bandit.py``'s first turn (SmolLM2-135M, 128 rows, 225 slots, 209 held).

The kernel runs twice: each row reading its own held slots, and (``kernel-shared``) the rows in
prefix groups of ``SHARED_ROWS`` that share their held slots (a first prompt copied to the rows
that read it, ``KVCache.prefix_group``), which the kernel reads once for a few rows. Every row of
the benchmark's cache holds the same (zeros), so both decode the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from unittest import mock

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from experiments.bench.common import machine, markdown_table, require_positive, write_markdown, write_report
from starpo_jax.models import Decoder, ModelState, cpu_kernels, decoder, preset
from starpo_jax.rollout import sampling
from starpo_jax.runtime import allocator

WORKLOADS = {  # name: (model, batch, cache slots, tokens held, new tokens)
    "frozen-lake": ("smollm2-135m-instruct", 64, 640, 300, 48),
    "generate": ("smollm2-135m-instruct", 32, 512, 256, 64),
    "qwen": ("qwen2.5-0.5b", 128, 896, 512, 16),
    "bandit": ("smollm2-135m-instruct", 128, 225, 209, 16),
}
QUICK = {"tiny": ("tiny-llama", 4, 64, 16, 8)}
SHARED_ROWS = 16  # rows of a prefix group in ``kernel-shared`` (a FrozenLake preset's group)
VARIANTS = {  # name: (the most queries per kv head whose scores are keys-first, the CPU kernel on, prefix groups)
    "kernel": (decoder.KEYS_LEAD_MAX_QUERIES, True, False),
    "kernel-shared": (decoder.KEYS_LEAD_MAX_QUERIES, True, True),
    "keys-first": (decoder.KEYS_LEAD_MAX_QUERIES, False, False),
    "queries-first": (0, False, False),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench.decode_attention",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--repeats", type=int, default=1, help="ABBA rounds per workload (each times both twice)")
    p.add_argument("--quick", action="store_true", help="tiny-llama only, one round: a smoke run")
    p.add_argument("--note", default="", help="free text for the report (machine load, ...)")
    p.add_argument("--out", default="bench_results/decode_attention.json")
    args = p.parse_args(argv)
    require_positive(p, args, "repeats")
    return args


def decode_program(config, batch: int, cache_slots: int, held: int, new: int, max_queries: int, kernel: bool,
                   shared: bool):
    """The decode call compiled with the scores oriented by ``max_queries``, or with the CPU kernel
    (``shared``: its rows in prefix groups of ``SHARED_ROWS`` sharing their held slots), and its
    arguments."""
    model = ModelState.split(Decoder(config, rngs=nnx.Rngs(0)))
    cache = sampling.init_cache(config, batch, cache_slots).replace(lengths=np.full((batch,), held, np.int32))
    if shared:
        cache = cache.replace(prefix_group=np.arange(batch, dtype=np.int32) // SHARED_ROWS,
                              prefix_length=np.full((batch,), held, np.int32))
    logits = np.random.default_rng(0).standard_normal((batch, config.vocab_size)).astype(np.float32)
    args = (model, cache, logits, jax.random.key(0))
    with mock.patch.object(decoder, "KEYS_LEAD_MAX_QUERIES", max_queries), \
            (contextlib.nullcontext() if kernel else cpu_kernels.xla_only(cpu_kernels.TARGET)):
        jax.clear_caches()  # sampling.decode is jitted: without this it reuses the other variant's trace
        start = time.perf_counter()
        compiled = jax.jit(lambda m, c, logits, k: sampling.decode(m, c, logits, k, max_new_tokens=new)).lower(*args).compile()
    return compiled, args, time.perf_counter() - start


def run_workload(spec, repeats: int) -> dict:
    name, batch, cache_slots, held, new = spec
    config = preset(name, dtype="float32", param_dtype="float32")
    order = [v for v, (_, kernel, _) in VARIANTS.items() if not kernel or cpu_kernels.available()]
    programs = {o: decode_program(config, batch, cache_slots, held, new, *VARIANTS[o]) for o in order}
    outputs: dict = {}  # variant -> the warm-up's decoded output
    times: dict[str, list[float]] = {o: [] for o in order}
    for o in order:  # warm-up; keeps the tokens to compare
        compiled, args, _ = programs[o]
        outputs[o] = jax.block_until_ready(compiled(*args))
    for _ in range(repeats):
        for o in order + order[::-1]:
            compiled, args, _ = programs[o]
            start = time.perf_counter()
            jax.block_until_ready(compiled(*args))
            times[o].append(time.perf_counter() - start)
    def alike(a, b):
        return float(np.mean(np.asarray(outputs[a].tokens) == np.asarray(outputs[b].tokens)))

    median = {o: statistics.median(times[o]) for o in order}
    kernel = {"kernel_speedup": median["keys-first"] / median["kernel"],
              "kernel_same_tokens": alike("kernel", "keys-first"),
              "shared_speedup": median["kernel"] / median["kernel-shared"],
              "shared_same_tokens": alike("kernel-shared", "kernel")} if "kernel" in order else {}
    return {
        "model": name, "batch": batch, "cache": cache_slots, "held": held, "new_tokens": new,
        "seconds": {o: times[o] for o in order},
        "median_s": median,
        "compile_s": {o: programs[o][2] for o in order},
        "speedup": median["queries-first"] / median["keys-first"],
        "same_tokens": alike("keys-first", "queries-first"),
        **kernel,
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    specs = QUICK if args.quick else {w: WORKLOADS[w] for w in args.workloads}
    repeats = 1 if args.quick else args.repeats
    results = {}
    for workload, spec in tqdm(specs.items(), desc="workloads", unit="workload"):
        results[workload] = run_workload(spec, repeats)
        r = results[workload]
        tqdm.write(f"{workload}: " + ", ".join(f"{o} {s:.2f} s" for o, s in r["median_s"].items()))
    report = {"machine": machine(args.note), "repeats": repeats, "results": results}
    path = write_report(report, args.out)
    def kernel_cells(r):
        return [f"{r['median_s']['kernel']:.2f}", f"{r['kernel_speedup']:.2f}x", f"{r['kernel_same_tokens']:.3f}",
                f"{r['median_s']['kernel-shared']:.2f}", f"{r['shared_speedup']:.2f}x",
                f"{r['shared_same_tokens']:.3f}"] if "kernel" in r["median_s"] else [""] * 6

    rows = [[w, f"{r['model']}, {r['batch']} rows, {r['cache']} slots ({r['held']} held), {r['new_tokens']} new",
             f"{r['median_s']['queries-first']:.2f}", f"{r['median_s']['keys-first']:.2f}", f"{r['speedup']:.2f}x",
             f"{r['same_tokens']:.3f}", *kernel_cells(r)] for w, r in results.items()]
    write_markdown(markdown_table(["workload", "decode", "queries-first s", "keys-first s", "keys-first speed-up",
                                   "tokens alike", "kernel s", "kernel over keys-first", "tokens alike (kernel)",
                                   f"kernel, groups of {SHARED_ROWS} s", "over the kernel", "tokens alike (groups)"],
                                  rows), path)
    print(f"wrote {path}")
    return report


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
