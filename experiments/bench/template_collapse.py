"""What the template-collapse figures cost beside the step they describe.

    .venv/bin/python -m experiments.bench.template_collapse --config configs/learn_frozen_lake.py

Builds the run of ``--config`` (plus ``--config.KEY=VALUE`` overrides), plays one training rollout
with the untrained policy, then times ``diagnostics.template_collapse.collapse_metrics`` on it
(``trainer.mi_prompts`` prompts per env tag): the first call (compile included) and ``--repeats``
more. Prints the rollout's time beside them, the figures, and writes
``bench_results/template_collapse/bench_template_collapse.json``. ``trainer.mi_freq`` steps
between scorings cost that time once.
"""

from __future__ import annotations

import argparse
import datetime
import time

import jax

from experiments.bench.common import build_or_exit, machine, parse_with_overrides, write_report
from starpo_jax.diagnostics.template_collapse import collapse_metrics
from starpo_jax.rollout.sampling import sampling_policy
from starpo_jax.runtime import allocator
from starpo_jax.train import init_train_state, make_train_step, policy_weights


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench.template_collapse", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/learn_frozen_lake.py", help="a config file[:preset]")
    p.add_argument("--repeats", type=int, default=2, help="timed calls after the first (default 2)")
    p.add_argument("--out", default="bench_results/template_collapse/bench_template_collapse.json")
    args = parse_with_overrides(p, argv)
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)

    exp = build_or_exit(args.config, args.overrides)
    state = init_train_state(exp.settings, exp.model, jax.random.PRNGKey(exp.config.trainer.seed))
    collect = jax.jit(make_train_step(exp.settings, exp.model.graphdef, exp.train_plan).collect)
    t0 = time.perf_counter()
    traj = jax.block_until_ready(collect(state, exp.train_tables, jax.random.PRNGKey(0)))
    rollout_s = time.perf_counter() - t0
    policy = sampling_policy(exp.model.graphdef, policy_weights(exp.settings, state))
    seconds, figures = [], {}
    for _ in range(1 + args.repeats):
        t0 = time.perf_counter()
        figures = collapse_metrics(policy, traj, exp.train_plan, "train", max_prompts=exp.config.trainer.mi_prompts,
                                   positions=exp.settings.logprob_chunk,
                                   temperature=exp.settings.rollout_temperature)
        seconds.append(time.perf_counter() - t0)
    report = {
        "bench": "template_collapse",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "config": args.config, "overrides": args.overrides,
        "prompts_per_tag": exp.config.trainer.mi_prompts, "rows": exp.train_plan.batch_size,
        "rollout_s_with_compile": rollout_s, "first_call_s": seconds[0], "warm_call_s": seconds[1:],
        "figures": figures,
    }
    print(f"rollout (compile included) {rollout_s:.1f} s; template-collapse figures: first call {seconds[0]:.1f} s, "
          f"then {', '.join(f'{s:.1f}' for s in seconds[1:])} s")
    print(", ".join(f"{k} {v:.4f}" for k, v in figures.items()))
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
