"""How often the first rollout writes a valid answer, before and after the format warm-up.

    .venv/bin/python -m experiments.bench.format_warmup --config configs/learn_frozen_lake.py --steps 20
    .venv/bin/python -m experiments.bench.format_warmup --config configs/learn_frozen_lake.py --steps 20 \\
        "--config.envs.train.tags=('SimpleSokoban',)"

Builds the run of ``--config`` (plus ``--config.KEY=VALUE`` overrides), plays ``--rollouts``
training rollouts with the untrained policy (keys 0, 1, …), runs ``--steps`` warm-up steps
(``starpo_jax.format_warmup``, learning rate ``--lr``, default ``actor.format_warmup_lr``), then
plays the same rollouts again. Reports, per env tag, the share of first turns whose answer was
valid (no format penalty) and of all turns played, each with its 95 % Wilson interval, the
answers' negative log-likelihood at each warm-up step, and the time. Writes
``bench_results/format_warmup/bench_format_warmup.json``.
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax
import numpy as np
from tqdm import tqdm

from experiments.bench.common import build_or_exit, machine, parse_with_overrides, require_positive, write_report
from experiments.curves import wilson
from starpo_jax.format_warmup import answer_pieces, format_warmup
from starpo_jax.runtime import allocator
from starpo_jax.train import init_train_state, make_train_step


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench.format_warmup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/learn_frozen_lake.py", help="a config file[:preset]")
    p.add_argument("--steps", type=int, default=20, help="warm-up steps (default 20)")
    p.add_argument("--lr", type=float, default=None, help="warm-up learning rate (default: actor.format_warmup_lr)")
    p.add_argument("--rollouts", type=int, default=1, help="training rollouts measured before and after (default 1)")
    p.add_argument("--out", default="bench_results/format_warmup/bench_format_warmup.json")
    args = parse_with_overrides(p, argv)
    require_positive(p, args, "lr")
    if args.steps < 1 or args.rollouts < 1:
        p.error("--steps and --rollouts must be at least 1")
    return args


def valid_rates(traj, plan) -> dict[str, dict]:
    """Per tag: valid first answers and valid answers over all turns played, as counts."""
    penalised, played = (np.asarray(jax.device_get(x)) for x in (traj.turn_penalised, traj.turn_played))
    out, first = {}, 0
    for tag in plan.tags:
        rows = slice(first, first + tag.n_groups * plan.group_size)
        first = rows.stop
        out[tag.name] = {
            "first_turn_valid": int((~penalised[rows, 0]).sum()), "first_turns": int(played[rows, 0].sum()),
            "turns_valid": int((played[rows] & ~penalised[rows]).sum()), "turns": int(played[rows].sum()),
        }
    return out


def summed(counts: list[dict]) -> dict:
    return {tag: {k: sum(c[tag][k] for c in counts) for k in counts[0][tag]} for tag in counts[0]}


def with_intervals(counts: dict) -> dict:
    return {tag: c | {"first_turn_rate": c["first_turn_valid"] / max(c["first_turns"], 1),
                      "first_turn_interval": wilson(c["first_turn_valid"], c["first_turns"]),
                      "turn_rate": c["turns_valid"] / max(c["turns"], 1),
                      "turn_interval": wilson(c["turns_valid"], c["turns"])}
            for tag, c in counts.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)

    exp = build_or_exit(args.config, args.overrides)
    lr = args.lr if args.lr is not None else float(exp.config.actor.format_warmup_lr)
    collect = jax.jit(make_train_step(exp.settings, exp.model.graphdef, exp.train_plan).collect)
    state = init_train_state(exp.settings, exp.model, jax.random.PRNGKey(exp.config.trainer.seed))

    def measure(label: str) -> tuple[dict, float]:
        t0, counts = time.perf_counter(), []
        for i in tqdm(range(args.rollouts), desc=f"rollouts {label}", unit="rollout"):
            counts.append(valid_rates(collect(state, exp.train_tables, jax.random.PRNGKey(i)), exp.train_plan))
        return with_intervals(summed(counts)), time.perf_counter() - t0

    before, before_s = measure("before")
    nll: list[float] = []
    t0 = time.perf_counter()
    with tqdm(total=args.steps, desc="format warm-up", unit="step") as bar:

        def on_step(i: int, metrics: dict[str, float]) -> None:
            nll.append(metrics["format_warmup/nll"])
            bar.update()

        state = format_warmup(exp.settings, exp.model.graphdef, exp.train_plan, exp.train_tables,
                              answer_pieces(exp.tokenizer, exp.train_plan, exp.train_tables), state,
                              jax.random.PRNGKey(exp.config.trainer.seed + 2), args.steps, lr, on_step)
    warmup_s = time.perf_counter() - t0
    after, after_s = measure("after")
    report = {
        "bench": "format_warmup",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "config": args.config, "overrides": args.overrides, "steps": args.steps, "lr": lr,
        "rollouts": args.rollouts, "rows_per_rollout": exp.train_plan.batch_size,
        "before": before, "after": after, "nll": nll,
        "seconds": {"rollouts_before": before_s, "warmup": warmup_s, "rollouts_after": after_s},
    }
    for tag in before:
        b, a = before[tag], after[tag]
        print(f"{tag}: valid first answers {b['first_turn_valid']}/{b['first_turns']} -> "
              f"{a['first_turn_valid']}/{a['first_turns']}; all turns {b['turns_valid']}/{b['turns']} -> "
              f"{a['turns_valid']}/{a['turns']} (answer NLL {nll[0]:.3f} -> {nll[-1]:.3f}, {warmup_s:.0f} s)")
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
