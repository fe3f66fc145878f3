"""One decode step compiled for an accelerator by any source tree's own ``decode_cost``: bytes per
generated token and the optimised HLO text, so that two versions of the code (``--tree``) can be
compared on a GPU in one call, and their programs read afterwards on a machine without one.

    python experiments/bench/decode_hlo.py --out bench_results/decode_hlo        # this tree, default device
    python experiments/bench/decode_hlo.py --tree ../old --out bench_results/old  # another checkout's code

``bench.step --cost-only`` compiles the same step for the CPU. Here the tree's ``decode_cost`` runs
unchanged with its CPU device swapped for ``--device``'s (default: the first device jax sees), and
its HLO is kept (``HLO_DIR/<dtype>_<window>.hlo.txt``) beside a JSON of the figures. Run it as a
file, not a module, so that ``--tree``'s packages are the ones imported.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tree", default=os.path.join(os.path.dirname(__file__), "..", ".."),
                   help="root of the source tree whose decode step is compiled (default: this one)")
    p.add_argument("--device", default=None, help="jax backend to compile for (default: jax's default)")
    p.add_argument("--model", default="qwen2.5-0.5b", help="model preset (abstract shapes, no weights)")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--max-len", type=int, default=3600, help="cache size: every decode window of it is compiled")
    p.add_argument("--out", default="bench_results/decode_hlo", help="folder for figures.json and the HLO texts")
    args = p.parse_args(argv)  # checked here, without this tree's packages: --tree's are imported later
    if not os.path.isdir(os.path.join(args.tree, "starpo_jax")):
        p.error(f"--tree {args.tree} has no starpo_jax package: give the root of a starpo-jax checkout")
    if args.batch < 1 or args.max_len < 1:
        p.error(f"--batch and --max-len must be positive whole numbers, not {args.batch} and {args.max_len}")
    if not set(args.dtypes.split(",")) <= {"float32", "bfloat16"}:
        p.error(f"--dtypes takes float32 and bfloat16, separated by commas, not {args.dtypes!r}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, os.path.abspath(args.tree))
    import jax

    target = jax.devices(args.device)[0]
    all_devices = jax.devices
    # The tree's decode_cost asks for jax.devices("cpu"): give it the target's instead.
    jax.devices = lambda backend=None: all_devices(target.platform if backend == "cpu" else backend)

    from experiments.bench import step  # noqa: E402  (the tree's own)
    from starpo_jax.models import PRESETS, preset  # noqa: E402
    from starpo_jax.rollout.sampling import decode_windows  # noqa: E402

    if args.model not in PRESETS:  # the tree's own presets, before anything compiles
        print(f"error: unknown model {args.model!r} in --model; choose from: {', '.join(sorted(PRESETS))}",
              file=sys.stderr)
        sys.exit(2)
    os.makedirs(args.out, exist_ok=True)
    count_bytes, name = step.hlo_bytes, [""]

    def saving_hlo_bytes(text, *rest):
        with open(os.path.join(args.out, f"{name[0]}.hlo.txt"), "w") as f:
            f.write(text)
        return count_bytes(text, *rest)

    step.hlo_bytes = saving_hlo_bytes
    records = []
    for dtype in args.dtypes.split(","):
        config = preset(args.model, dtype=dtype, param_dtype=dtype)
        for window in decode_windows(args.max_len):
            name[0] = f"{dtype}_{window}"
            start = time.perf_counter()
            record = step.decode_cost(config, args.batch, window, top=True)
            record |= {"dtype": dtype, "compile_s": time.perf_counter() - start, "device": target.device_kind,
                       "tree": os.path.abspath(args.tree), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
            records.append(record)
            print(f"{dtype:9} window {window:5}: {record['bytes_per_token'] / 2**20:8.2f} MiB/token, "
                  f"{record['over_ideal']:.2f}x ideal, compiled in {record['compile_s']:.1f} s", flush=True)
            with open(os.path.join(args.out, "figures.json"), "w") as f:
                json.dump(records, f, indent=1)
    return records


if __name__ == "__main__":
    main()
