"""The benchmarks' tables as PNG charts (matplotlib), written beside their JSON.

``experiments.bench.common.write_report`` calls :func:`write_chart` for every benchmark; to redraw
the charts of JSON files already written:

    python -m experiments.bench.charts bench_results/*.json

Each chart is recognised by the shape of its report (each benchmark writes a different table) and
drawn from the measured figures only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def kind_of(report: dict) -> str | None:
    """Which benchmark wrote ``report``: envs, generate, rollout, train, step, decode_attention, or None."""
    results = report.get("results")
    if isinstance(results, dict) and results and all("speedup" in r for r in results.values()):
        return "decode_attention"
    if "decode_cost" in report or (isinstance(results, list) and results and "phases_s" in results[0]):
        return "step"
    if "numpy" in report and isinstance(results, list):
        return "envs"
    if isinstance(results, dict) and {"full", "lora"} <= set(results):
        return "train"
    if isinstance(results, list) and results and isinstance(results[0], dict):
        if "jax" in results[0]:
            return "generate"
        if "compiled" in results[0]:
            return "rollout"
    return None


def _figure(ncols: int = 1, width: float = 5.2, height: float = 3.6):
    import matplotlib  # here: seconds to import (every benchmark imports this module), the backend set before pyplot

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def _machine_line(report: dict) -> str:
    m = report.get("machine") or report.get("meta") or {}
    load = m.get("load_average") or [None]
    parts = [str(m.get("device_kind", "?")), f"{m.get('device_count', '?')} device(s)",
             f"load {load[0]:.1f}" if isinstance(load[0], (int, float)) else "",
             str(report.get("date") or m.get("date") or "")]
    return ", ".join(p for p in parts if p)


def draw_envs(report: dict):
    """Steps/s against batch size per env, one line per mode and device count, NumPy dashed."""
    envs = list(report["numpy"])
    fig, axes = _figure(len(envs))
    for ax, env in zip(axes, envs):
        rows = [r for r in report["results"] if r["env"] == env]
        for mode in dict.fromkeys(r["mode"] for r in rows):
            for devices in sorted({r["devices"] for r in rows if r["mode"] == mode}):
                pts = sorted((r["batch"], r["steps_per_s"]) for r in rows if r["mode"] == mode and r["devices"] == devices)
                ax.plot(*zip(*pts), marker="o", label=f"JAX {mode}, {devices} device(s)")
            ax.axhline(report["numpy"][env][mode], linestyle="--", color="grey", linewidth=1)
            ax.annotate(f"NumPy {mode}", (1, report["numpy"][env][mode]), xycoords=("axes fraction", "data"),
                        ha="right", va="bottom", fontsize=7, color="grey")
        ax.set(xscale="log", yscale="log", xlabel="batch (envs stepped together)", ylabel="env steps / s", title=env)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def draw_generate(report: dict):
    """Generated tokens/s against batch size per model: starpo-jax and transformers."""
    models = list(dict.fromkeys(r["model"] for r in report["results"]))
    fig, axes = _figure(len(models))
    for ax, model in zip(axes, models):
        rows = sorted((r for r in report["results"] if r["model"] == model), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in rows], [r["jax"]["tokens_per_s"] for r in rows], marker="o", label="starpo-jax")
        whole = [r for r in rows if "jax_whole_cache" in r]
        if whole:
            ax.plot([r["batch"] for r in whole], [r["jax_whole_cache"]["tokens_per_s"] for r in whole], marker="s",
                    label="starpo-jax, whole cache")
        hf = [r for r in rows if "transformers" in r]
        if hf:
            ax.plot([r["batch"] for r in hf], [r["transformers"]["tokens_per_s"] for r in hf], marker="^",
                    label="transformers generate")
        ax.set(xscale="log", yscale="log", xlabel="batch", ylabel="generated tokens / s", title=model)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    return fig


def draw_rollout(report: dict):
    """Tokens/s of the compiled rollout and the host loop, per model."""
    rows = report["results"]
    fig, (ax,) = _figure()
    modes = [m for m in ("compiled", "baseline") if any(m in r for r in rows)]
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        xs = [j + i * width for j, r in enumerate(rows) if mode in r]
        ax.bar(xs, [r[mode]["tokens_per_s"] for r in rows if mode in r], width,
               label={"compiled": "compiled rollout", "baseline": "host loop (re-prefill)"}[mode])
    ax.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(rows))], [r["model"] for r in rows])
    ax.set(ylabel="generated tokens / s", title=f"multi-turn rollout, {report.get('workload', {}).get('env', '')}")
    ax.legend(fontsize=7)
    return fig


def draw_train(report: dict):
    """Memory (MB) and wall time of one update: full fine-tuning (whole rows, the batch's layout) against LoRA."""
    results = report["results"]
    fig, (mem, wall) = _figure(2)
    parts = [("trained", lambda r: r["state_bytes"]["trained"]), ("frozen", lambda r: r["state_bytes"]["frozen"]),
             ("optimizer", lambda r: r["state_bytes"]["optimizer"]),
             ("learn args + temporaries", lambda r: r["learn_bytes"]["arguments"] + r["learn_bytes"]["temporaries"])]
    modes = list(results)
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        mem.bar([j + i * width for j in range(len(parts))], [f(results[mode]) / 2**20 for _, f in parts], width, label=mode)
    mem.set_xticks([j + width * (len(modes) - 1) / 2 for j in range(len(parts))], [p for p, _ in parts], fontsize=7)
    mem.set(ylabel="MB", title="memory of one update")
    mem.legend(fontsize=7)
    wall.bar(modes, [results[m]["wall_s"] for m in modes], color=[f"C{i}" for i in range(len(modes))])
    wall.set(ylabel="seconds", title="wall time of one update")
    return fig


def draw_step(report: dict):
    """Seconds per StarPO-S iteration split by phase, one stacked bar per forced response length N;
    with a cost analysis, XLA's bytes per decode token against the ideal per cache window."""
    results, cost = report.get("results") or [], (report.get("decode_cost") or {}).get("steps") or []
    fig, axes = _figure(bool(results) + bool(cost))
    if results:
        ax, bottom = axes[0], [0.0] * len(results)
        labels = [f"N = {r['response_tokens']}" for r in results]
        for phase in ("rollout", "logprobs_values", "critic_update", "actor_update"):
            heights = [max(r["phases_s"][phase], 0.0) for r in results]
            ax.bar(labels, heights, bottom=bottom, label=phase.replace("_", " "))
            bottom = [b + h for b, h in zip(bottom, heights)]
        ax.set(ylabel="seconds", title="one StarPO-S iteration by phase")
        ax.legend(fontsize=7)
    if cost:
        ax = axes[-1]
        for dtype in dict.fromkeys(c["dtype"] for c in cost):
            rows = [c for c in cost if c["dtype"] == dtype]
            windows = [c["window"] for c in rows]
            ax.plot(windows, [c["bytes_per_token"] / 2**20 for c in rows], "o-", label=f"{dtype} XLA")
            ax.plot(windows, [c["ideal_bytes_per_token"] / 2**20 for c in rows], "--", label=f"{dtype} ideal")
        ax.set(xlabel="cache window (tokens)", ylabel="MiB per generated token", title="decode step, batch 128")
        ax.legend(fontsize=7)
    return fig


def draw_decode_attention(report: dict):
    """Seconds per decode call with each attention variant (queries-first, keys-first, the CPU
    kernel where it ran, alone and with prefix groups), per workload."""
    results = report["results"]
    names = list(results)
    variants = [v for v in ("queries-first", "keys-first", "kernel", "kernel-shared")
                if v in results[names[0]]["median_s"]]
    fig, (ax,) = _figure(width=1.6 + 0.7 * len(variants) * len(results))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        ax.bar([j + i * width for j in range(len(names))], [results[n]["median_s"][variant] for n in names], width,
               label=variant)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names)
    ax.set(ylabel="seconds per decode call", title="decode attention on this device")
    ax.legend(fontsize=7)
    return fig


DRAW = {"envs": draw_envs, "generate": draw_generate, "rollout": draw_rollout, "train": draw_train, "step": draw_step,
        "decode_attention": draw_decode_attention}


def write_chart(report: dict, png: str | Path) -> Path | None:
    """Draws ``report``'s table into ``png``; None (nothing written) for an unknown report."""
    kind = kind_of(report)
    if kind is None:
        return None
    import matplotlib.pyplot as plt

    fig = DRAW[kind](report)
    fig.suptitle(f"bench_{kind}: {_machine_line(report)}", fontsize=9)
    fig.tight_layout()
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return png


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.charts",
                                     description="Draw PNG charts beside benchmark JSON files (bench_*.json).")
    parser.add_argument("json_files", nargs="+", type=Path, metavar="JSON")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.json_files if not p.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    status = 0
    for path in args.json_files:
        try:
            png = write_chart(json.loads(path.read_text()), path.with_suffix(".png"))
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            png, status = None, 1
            print(f"error: {path}: not a complete benchmark report ({type(err).__name__}: {err})", file=sys.stderr)
        else:
            if png is None:
                status = 1
                print(f"error: {path}: not a benchmark report this script knows", file=sys.stderr)
        if png:
            print(f"wrote {png}")
    return status


if __name__ == "__main__":
    sys.exit(main())
