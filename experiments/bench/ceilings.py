"""This machine's two ceilings, which every phase of an iteration is read against.

- **Compute**: float32 matrix products of two ``--size`` × ``--size`` operands (2·n³ FLOPs each),
  as XLA runs them on its device (on a CPU: every core, its threads splitting the product).
- **Memory**: copy bandwidth, a float32 array of ``--copy-mib`` MiB read and written in place
  (``x + 1``, its buffer donated: 2 × its bytes a pass, the whole array far larger than the caches).

A phase whose products dominate cannot run faster than the first; one that streams its operands
(a decode step reading every weight for a few rows) cannot beat the second times its arithmetic
intensity, FLOPs per byte moved. Each figure is the median of ``--repeats`` timed runs, after a
compile and a warm-up run; ``cpu_per_wall`` is the process's CPU time over wall time (the cores kept
busy). Other work on the machine lowers both: the report records the load average, and a figure
taken under load is not this machine's ceiling.

    python -m experiments.bench.ceilings                   # writes bench_results/bench_ceilings.json
    python -m experiments.bench.ceilings --quick           # smoke run
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp

from experiments.bench.common import machine, markdown_table, write_markdown, write_report


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.ceilings", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, help="rows and columns of each matrix (default 2048; --quick 256)")
    p.add_argument("--copy-mib", type=int, help="MiB of the array copied in place (default 512; --quick 16)")
    p.add_argument("--repeats", type=int, help="timed runs of each, median reported (default 5; --quick 2)")
    p.add_argument("--quick", action="store_true", help="smoke run: smaller sizes, fewer repeats")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else ran)")
    p.add_argument("--out", default="bench_results/bench_ceilings.json")
    args = p.parse_args(argv)
    defaults = {"size": 256, "copy_mib": 16, "repeats": 2} if args.quick else {"size": 2048, "copy_mib": 512, "repeats": 5}
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("size", "copy_mib", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive whole number, not {getattr(args, name)}")
    return args


def timed_runs(run, repeats: int) -> tuple[list[float], float]:
    """Wall seconds of ``repeats`` calls of ``run`` (each blocked on), after one untimed warm-up
    call, and the process's CPU seconds per wall second over the timed calls."""
    jax.block_until_ready(run())
    seconds, cpu0, wall0 = [], time.process_time(), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        seconds.append(time.perf_counter() - t0)
    return seconds, (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def matmul_ceiling(size: int, repeats: int) -> dict:
    """GFLOP/s of one float32 ``size`` × ``size`` product."""
    a, b = jax.random.normal(jax.random.PRNGKey(0), (2, size, size), jnp.float32)
    product = jax.jit(jnp.matmul)
    seconds, cpu_per_wall = timed_runs(lambda: product(a, b), repeats)
    flops = 2 * size**3
    return {"size": size, "flops": flops, "runs_s": seconds, "gflop_per_s": flops / statistics.median(seconds) / 1e9,
            "cpu_per_wall": cpu_per_wall}


def copy_ceiling(mib: int, repeats: int) -> dict:
    """GB/s of an in-place pass over a float32 array of ``mib`` MiB: read once, written once."""
    x = jnp.zeros((mib * 2**20 // 4,), jnp.float32)
    add_one = jax.jit(lambda y: y + 1.0, donate_argnums=0)  # donated: written where it was read

    def run():
        nonlocal x
        x = add_one(x)
        return x

    seconds, cpu_per_wall = timed_runs(run, repeats)
    moved = 2 * x.size * 4
    return {"bytes": x.size * 4, "bytes_moved": moved, "runs_s": seconds,
            "gb_per_s": moved / statistics.median(seconds) / 1e9, "cpu_per_wall": cpu_per_wall}


def markdown(report: dict) -> str:
    m, mm, cp = report["machine"], report["matmul"], report["copy"]
    head = (f"bench_ceilings, {m['device_kind']} ({m['jax_platform']}, {m['cpu_count']} cores, jax {m['jax']}), "
            f"load average {m['load_average'][0]:.1f} at the start")
    rows = [
        [f"float32 product {mm['size']} x {mm['size']}", f"{mm['gflop_per_s']:.1f} GFLOP/s",
         f"{min(mm['runs_s']):.4f}-{max(mm['runs_s']):.4f}", f"{mm['cpu_per_wall']:.2f}"],
        [f"in-place pass over {cp['bytes'] / 2**20:.0f} MiB", f"{cp['gb_per_s']:.1f} GB/s",
         f"{min(cp['runs_s']):.4f}-{max(cp['runs_s']):.4f}", f"{cp['cpu_per_wall']:.2f}"],
    ]
    return head + "\n\n" + markdown_table(["ceiling", "median", "runs (s)", "cores busy"], rows)


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = {"machine": machine(args.note), "matmul": matmul_ceiling(args.size, args.repeats),
              "copy": copy_ceiling(args.copy_mib, args.repeats)}
    report["machine_balance_flop_per_byte"] = report["matmul"]["gflop_per_s"] / report["copy"]["gb_per_s"]
    text = markdown(report)
    print(text, flush=True)
    write_report(report, args.out)
    write_markdown(text, args.out)
    return report


if __name__ == "__main__":
    main()
