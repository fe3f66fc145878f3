"""Learning curves of finished or running runs as one PNG, drawn from their own ``metrics.jsonl``.

    .venv/bin/python -m experiments.curves runs/learn_bandit runs/learn_bandit_seed1 --out curves.png
    .venv/bin/python -m experiments.curves runs/a runs/b --labels StarPO-S StarPO --out echo.png
    .venv/bin/python -m experiments.curves runs/lr_sweep --out sweep.png      # one series per setting

Panels: validation success per env tag with its 95 % Wilson interval (the levels per tag come from
the run's ``config.json``), the validation format (``action_is_valid``) and rate of effective
actions (``action_is_effective``, what a multi-turn env shows first), and the training signals
the paper reads for collapse: success and reward of the training rollouts, in-group reward std,
entropy and the actor's gradient norm, with RAGEN-2's mutual information of answer and board
(template collapse: near 0 when every board gets the same answer). A sweep's folder (``sweep.jsonl``, no validation) gives
one series per setting. Prints a table of validation success with intervals, first and last
validation side by side, and writes it as JSON beside the PNG (``.json``).

The format and effective-action rates are per-level means of per-turn fractions, each in [0, 1],
not successes; their band is the Wilson interval of ``rate × levels`` out of ``levels``. A mean of
values in [0, 1] has at most the variance of a 0/1 variable with the same mean, so this band is at
least as wide as the normal-approximation interval of the mean.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from pathlib import Path

from experiments.report import read_jsonl

TRAIN_PANELS = (
    ("train/*/success", "training success (rollouts, per env tag)"),
    ("train/reward/mean", "training reward (mean)"),
    ("rollout/in_group_std", "in-group reward std"),
    ("actor/entropy_loss", "entropy"),
    ("actor/grad_norm", "actor gradient norm"),
    ("train/*/mi", "MI of answer and board (training rollouts, per env tag)"),
    ("val-env/*/mi", "MI of answer and board (validation, per env tag)"),
)


def wilson(successes: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The 95 % Wilson score interval of a success rate ``successes / n``."""
    if n <= 0:
        return (0.0, 1.0)
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))


def val_levels(run: Path) -> dict[str, int]:
    """Episodes per validation tag: n_groups × group_size from the run's config (a sweep: none)."""
    if not (run / "config.json").exists():
        return {}
    val = json.loads((run / "config.json").read_text())["envs"]["val"]
    return {tag: int(n) * int(val["group_size"]) for tag, n in zip(val["tags"], val["n_groups"])}


def read_rows(path: Path) -> list[dict]:
    notes: list[str] = []
    rows = read_jsonl(path, notes)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    return rows


def read_runs(run: Path, label: str) -> dict[str, tuple[Path, list[dict]]]:
    """{label: (folder, metric rows)}: a run's, or one per setting of a sweep's folder."""
    if (run / "metrics.jsonl").exists():
        return {label: (run, read_rows(run / "metrics.jsonl"))}
    settings: dict[str, list[dict]] = {}
    for row in read_rows(run / "sweep.jsonl"):
        name = " ".join(f"{k}={v:g}" for k, v in row.get("setting", {}).items())
        settings.setdefault(f"{label} {name}", []).append(row)
    return {name: (run, rows) for name, rows in settings.items()}


def keys_like(rows: list[dict], pattern: str) -> list[str]:
    """The metric names matching ``pattern`` (``*``: one name part, e.g. an env tag), in first-seen order."""
    return list(dict.fromkeys(k for r in rows for k in r if fnmatch.fnmatchcase(k, pattern) and "/non-zero/" not in k))


def series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    points = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
    return [s for s, _ in points], [v for _, v in points]


#: Per-level rates drawn beside validation success, each with its band (module docstring).
RATE_PANELS = (("action_is_valid", "valid answers (format)"), ("action_is_effective", "effective actions"))


def validation_table(run: Path, rows: list[dict]) -> dict[str, list[dict]]:
    """Per tag: every validation's step, success, its interval, and the per-level rates with theirs."""
    table = {}
    for tag, n in val_levels(run).items():
        steps, success = series(rows, f"val-env/{tag}/success")
        rates = {name: dict(zip(*series(rows, f"val-env/{tag}/{name}"))) for name, _ in RATE_PANELS}
        table[tag] = [
            {"step": s, "success": p, "interval": wilson(p * n, n), "levels": n}
            | {name: rates[name].get(s) for name in rates}
            | {f"{name}_interval": wilson(rates[name][s] * n, n) for name in rates if s in rates[name]}
            for s, p in zip(steps, success)
        ]
    return table


def draw(runs: list[Path], labels: list[str], out: Path) -> dict:
    import matplotlib  # here: seconds to import, and the backend is chosen before pyplot loads

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = {name: pair for label, run in zip(labels, runs) for name, pair in read_runs(run, label).items()}
    tags = list(dict.fromkeys(t for run, _ in data.values() for t in val_levels(run)))
    panels = [f"val-env/{t}/success" for t in tags] + ([n for n, _ in RATE_PANELS] if tags else []) + [k for k, _ in TRAIN_PANELS]
    cols = 3
    fig, axes = plt.subplots(-(-len(panels) // cols), cols, figsize=(4.2 * cols, 3.0 * -(-len(panels) // cols)))
    axes = axes.ravel()
    summary = {}
    for i, (label, (run, rows)) in enumerate(data.items()):
        colour = f"C{i}"
        table = validation_table(run, rows)
        summary[label] = {"run": str(run), "validation": table}
        for ax, tag in zip(axes, tags):
            points = table.get(tag, [])
            steps = [p["step"] for p in points]
            ax.plot(steps, [p["success"] for p in points], "o-", color=colour, label=label)
            ax.fill_between(steps, [p["interval"][0] for p in points], [p["interval"][1] for p in points],
                            color=colour, alpha=0.15)
            ax.set(title=f"validation success, {tag} (95 % Wilson)", xlabel="step", ylim=(-0.02, 1.02))
        rate_axes = axes[len(tags): len(tags) + len(RATE_PANELS)] if tags else []
        for ax, (name, title) in zip(rate_axes, RATE_PANELS):
            for j, tag in enumerate(tags):
                points = [p for p in table.get(tag, []) if p.get(name) is not None]
                steps = [p["step"] for p in points]
                ax.plot(steps, [p[name] for p in points], "os^v"[j % 4] + "-", color=colour, label=f"{label} {tag}")
                ax.fill_between(steps, [p[f"{name}_interval"][0] for p in points],
                                [p[f"{name}_interval"][1] for p in points], color=colour, alpha=0.15)
            ax.set(title=f"validation: {title}", xlabel="step", ylim=(-0.02, 1.02))
        for ax, (pattern, title) in zip(axes[len(tags) + len(rate_axes):], TRAIN_PANELS):
            keys = keys_like(rows, pattern)
            for j, key in enumerate(keys):
                name = label if len(keys) == 1 else f"{label} {key.split('/')[1]}"
                ax.plot(*series(rows, key), "-:"[j % 2], color=colour, label=name, lw=1.2)
            ax.set(title=title, xlabel="step")
    for ax in axes[: len(panels)]:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    for ax in axes[len(panels):]:
        ax.axis("off")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    return summary


def ci(point: dict, key: str = "success") -> str:
    """A validation point's value and 95 % band, e.g. ``0.438 [0.378, 0.499]``."""
    low, high = point["interval" if key == "success" else f"{key}_interval"]
    return f"{point[key]:.3f} [{low:.3f}, {high:.3f}]"


def print_table(summary: dict) -> None:
    for label, run in summary.items():
        for tag, points in run["validation"].items():
            if not points:
                continue
            first, last = points[0], points[-1]
            print(f"{label:<24} {tag:<12} step {first['step']:>3}: {ci(first)}  →  step {last['step']:>3}: {ci(last)}"
                  f"  (n = {last['levels']})")
            for name, title in RATE_PANELS:
                if first.get(name) is not None and last.get(name) is not None:
                    print(f"{'':<24} {title:<30} {ci(first, name)}  →  {ci(last, name)}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m experiments.curves",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each with metrics.jsonl and config.json)")
    p.add_argument("--labels", nargs="+", help="one name per run (default: the folder names)")
    p.add_argument("--out", type=Path, default=Path("curves.png"), help="the PNG to write (JSON beside it)")
    args = p.parse_args(argv)
    labels = args.labels or [r.name for r in args.runs]
    if len(labels) != len(args.runs):
        print(f"error: {len(labels)} labels for {len(args.runs)} runs; give one per run.", file=sys.stderr)
        return 2
    for run in args.runs:
        if not ((run / "metrics.jsonl").exists() and (run / "config.json").exists()) and not (run / "sweep.jsonl").exists():
            print(f"error: {run} is neither a run folder (metrics.jsonl, config.json) nor a sweep's (sweep.jsonl).",
                  file=sys.stderr)
            return 2
    summary = draw(args.runs, labels, args.out)
    print_table(summary)
    print(f"wrote {args.out} and {args.out.with_suffix('.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
