"""Can the model read the board when it is shown the answers? An imitation probe.

    .venv/bin/python -m experiments.bench.imitation --config configs/learn_frozen_lake.py \\
        "--config.envs.train.tags=('SimpleSokoban',)" "--config.envs.val.tags=('SimpleSokoban',)"
    .venv/bin/python -m experiments.bench.imitation --config configs/learn_frozen_lake.py

RL can only teach what the model can learn. This separates the two: ``--steps`` supervised steps on
``--levels`` fresh training levels each (seeds from 1,000,000 on, apart from validation's), every
first prompt answered with a best first answer, then the run's validation levels played as a
run's validation plays them. A best first answer is, on Sokoban, the first
``rollout.max_actions_per_turn`` actions of a shortest solution (``envs_jax.solvers.sokoban_bfs``)
and, on FrozenLake, the answer that opens a best policy within the rollout's turns
(``envs_jax.solvers.frozen_lake_dp``). The control is the same steps on the same levels answered
with uniformly random valid actions: the format warm-up, which says nothing about the board.

Reports, per arm: the answers' negative log-likelihood at each step, validation success with its
95 % Wilson interval, the distinct first answers over the levels, RAGEN-2's mutual information of
first answer and board and the retrieval accuracy (``diagnostics.template_collapse``), and the
time. If the imitating arm's answers follow the board (MI and retrieval above the control's,
success above the best board-blind policy of ``experiments.baselines``), the model can read the
board at this size and budget, and what a run does not learn is RL's to find; if not, the model
or the budget is the limit. One env tag at a time. Writes ``bench_results/imitation/bench_imitation.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import time
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from envs_jax.frozen_lake import FrozenLake
from envs_jax.sokoban import Sokoban
from envs_jax.solvers.frozen_lake_dp import best_first_answer
from envs_jax.solvers.sokoban_bfs import shortest_solution
from experiments.bench.common import build_or_exit, machine, parse_with_overrides, require_positive, write_report
from experiments.curves import wilson
from starpo_jax.diagnostics.dumps import trajectory_records
from starpo_jax.diagnostics.fixed_levels import evaluate_levels, fixed_levels
from starpo_jax.diagnostics.template_collapse import collapse_metrics
from starpo_jax.format_warmup import (
    answer_batch,
    answer_pieces,
    answer_width,
    compose_answers,
    random_answers,
    supervised_step,
)
from starpo_jax.rollout.sampling import sampling_policy
from starpo_jax.runtime import allocator
from starpo_jax.train import init_train_state, optimizer, policy_weights

FIRST_SEED = 1_000_000  # training levels of the probe, far from validation's (123 on)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench.imitation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/learn_frozen_lake.py", help="a config file[:preset]")
    p.add_argument("--steps", type=int, default=16, help="supervised steps per arm (default 16)")
    p.add_argument("--levels", type=int, default=64, help="distinct levels per step (default 64)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: actor.format_warmup_lr)")
    p.add_argument("--arms", default="random,best", help="which answers to learn, in order (default random,best)")
    p.add_argument("--out", default="bench_results/imitation/bench_imitation.json")
    args = parse_with_overrides(p, argv)
    require_positive(p, args, "lr")
    if args.steps < 1 or args.levels < 1:
        p.error("--steps and --levels must be at least 1")
    args.arms = tuple(a.strip() for a in args.arms.split(","))
    if not set(args.arms) <= {"random", "best"}:
        p.error(f"--arms takes random and best, not {','.join(args.arms)}")
    return args


def best_answer(env, state, turns: int, actions_per_turn: int, action_budget: int) -> tuple[int, ...]:
    """A best first answer's action ids (see the module docstring)."""
    if isinstance(env, FrozenLake):
        return best_first_answer(state, turns, actions_per_turn, action_budget, env.is_slippery)
    assert isinstance(env, Sokoban)  # probe_plan refused the rest
    solution = shortest_solution(state, max_depth=action_budget)
    return tuple(solution[:actions_per_turn]) if solution else (0,)  # no solution in the budget: any move


def probe_plan(plan, levels: int):
    """``plan`` with one row per level: ``levels`` groups of one."""
    if len(plan.tags) != 1 or not isinstance(plan.tags[0].env, (FrozenLake, Sokoban)):
        names = ", ".join(t.name for t in plan.tags)
        raise SystemExit(f"error: the probe takes one FrozenLake or Sokoban env tag; this config trains on {names}.")
    return dataclasses.replace(plan, group_size=1, tags=(dataclasses.replace(plan.tags[0], n_groups=levels),))


def level_states(env, seeds) -> tuple:
    """The levels of ``seeds``, stacked as the rollout holds one tag's states."""
    states = [env.reset_from_seed(int(s)) for s in seeds]
    return (jax.tree.map(lambda *xs: jnp.stack(xs), *states),)


@functools.partial(jax.jit, static_argnums=0)
def best_batch(plan, tables, pieces, states, names, count):
    answers = compose_answers(pieces[0], names, count, plan.pad_id)
    return answer_batch(plan, tables, states, *answers)


@functools.partial(jax.jit, static_argnums=0)
def random_batch(plan, tables, pieces, states, key):
    tag = plan.tags[0]
    name_ids = jax.vmap(tag.env.action_name_ids)(states[0]).astype(jnp.int32)
    answers = random_answers(pieces[0], name_ids, plan.max_actions_per_turn, key, plan.pad_id)
    return answer_batch(plan, tables, states, *answers)


def arm_batches(arm: str, plan, tables, pieces, step: int):
    """Step ``step``'s batch of ``arm``: its levels' first prompts and their answers."""
    tag = plan.tags[0]
    seeds = range(FIRST_SEED + step * tag.n_groups, FIRST_SEED + (step + 1) * tag.n_groups)
    states = level_states(tag.env, seeds)
    if arm == "random":
        return random_batch(plan, tables, pieces, states, jax.random.PRNGKey(step))
    k = plan.max_actions_per_turn
    answers = [best_answer(tag.env, jax.tree.map(lambda x: x[i], states[0]), plan.max_turn, k, tag.max_actions_per_traj)
               for i in range(tag.n_groups)]
    name_ids = np.asarray(jax.vmap(tag.env.action_name_ids)(states[0]))
    names = np.zeros((tag.n_groups, k), np.int32)
    for i, actions in enumerate(answers):
        names[i, :len(actions)] = name_ids[i, list(actions)]
    count = np.array([len(a) for a in answers], np.int32)
    return best_batch(plan, tables, pieces, states, jnp.asarray(names), jnp.asarray(count))


def validate(exp, state, key) -> dict:
    """The validation levels played by ``state``'s policy: success, first answers, MI, retrieval."""
    cfg, plan = exp.config, exp.val_plan
    policy = sampling_policy(exp.model.graphdef, policy_weights(exp.settings, state))
    levels = fixed_levels(plan, exp.val_tables, cfg.envs.val.seed, cfg.trainer.val_chunks)
    result = evaluate_levels(levels, policy, key, cfg.rollout.val_temperature, "val")
    collapse = collapse_metrics(policy, result.traj, plan, "val", max_prompts=max(cfg.trainer.mi_prompts, 2),
                                positions=exp.settings.logprob_chunk, temperature=exp.settings.rollout_temperature)
    records = trajectory_records(result.traj, plan, exp.tokenizer, cfg.envs.val.seed)
    first = Counter(r["turns"][0]["answer"].strip() if r["turns"] else "" for r in records)
    solved, n = sum(bool(r["success"]) for r in records), len(records)
    tag = plan.tags[0].name
    return {"success": solved / n, "solved": solved, "levels": n, "success_interval": wilson(solved, n),
            "distinct_first_answers": len(first), "most_common_first_answers": first.most_common(3),
            "mi": collapse.get(f"val/{tag}/mi"), "retrieval_acc": collapse.get(f"val/{tag}/retrieval_acc"),
            "retrieval_chance": collapse.get(f"val/{tag}/retrieval_chance"), "seconds": result.seconds}


def main(argv=None) -> dict:
    args = parse_args(argv)
    exp = build_or_exit(args.config, args.overrides)
    lr = args.lr if args.lr is not None else float(exp.config.actor.format_warmup_lr)
    plan = probe_plan(exp.train_plan, args.levels)
    pieces = answer_pieces(exp.tokenizer, plan, exp.train_tables)
    width = answer_width(pieces[0], plan.max_actions_per_turn)
    step = jax.jit(functools.partial(supervised_step, exp.settings, exp.model.graphdef, plan.group_size, width),
                   donate_argnums=(0, 2))
    start = init_train_state(exp.settings, exp.model, jax.random.PRNGKey(exp.config.trainer.seed))
    arms = {}
    for arm in args.arms:
        trained = jax.tree.map(jnp.copy, start.actor)  # each arm from the same weights (the step donates them)
        opt_state, nll = optimizer(exp.settings, "actor").init(trained), []
        t0 = time.perf_counter()
        for i in tqdm(range(args.steps), desc=f"{arm} answers", unit="step"):
            batch = arm_batches(arm, plan, exp.train_tables, pieces, i)
            trained, opt_state, metrics = step(trained, start.base, opt_state, batch, jnp.float32(lr))
            nll.append(float(metrics["format_warmup/nll"]))
        seconds = time.perf_counter() - t0
        print(f"{arm}: answer NLL {nll[0]:.3f} -> {nll[-1]:.3f} in {seconds:.0f} s; validating...", flush=True)
        val = validate(exp, start.replace(actor=trained), jax.random.PRNGKey(exp.config.trainer.seed + 1))
        arms[arm] = {"nll": nll, "train_seconds": seconds, "validation": val}
        lo, hi = val["success_interval"]
        print(f"{arm}: success {val['solved']}/{val['levels']} [{lo:.3f}, {hi:.3f}], {val['distinct_first_answers']} "
              f"distinct first answers, MI {val['mi']:.4f}, retrieval {val['retrieval_acc']:.3f} "
              f"(chance {val['retrieval_chance']:.3f})", flush=True)
    report = {
        "bench": "imitation",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(), "config": args.config, "overrides": args.overrides, "env": plan.tags[0].name,
        "steps": args.steps, "levels_per_step": args.levels, "lr": lr, "arms": arms,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
