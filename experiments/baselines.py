"""What the best and the board-blind policies score on a run's FrozenLake or Sokoban validation levels.

    python -m experiments.baselines --config configs/learn_frozen_lake.py
    python -m experiments.baselines --config runs/learn_frozen_lake --levels 256
    python -m experiments.baselines --config configs/sokoban.py

A learning run's validation success means little alone: a policy that ignores the board still
solves some levels (on slippery ice by luck, on small Sokoban rooms with one lucky answer), and one
that reads it perfectly still fails some on ice. For the validation levels a run plays
(``envs.val.seed`` on, the config's ``rollout.max_turn``, ``rollout.max_actions_per_turn`` and action
budget), this prints:

- the best policy within the rollout's turns (the board seen as each turn starts, the turn's
  actions played blind), and the bound that sees the board after every action;
- board-blind policies: the best single answer given every turn, the prompt's example answer every
  turn, and uniformly random valid answers (what ``experiments.evaluate --policy random-valid``
  samples);
- how many of the levels a run must solve for its 95 % Wilson interval to clear the best
  board-blind policy: a success above that is evidence that the policy reads the board;
- the share of a group's reward variance that the first answer explains when the policy is near
  random: the part of a group-relative advantage that can teach the first answer; the rest is the
  env's luck and the later turns', noise to the update.

On FrozenLake every figure is an exact expectation over the ice (``envs_jax.solvers.frozen_lake_dp``).
Sokoban is deterministic, so its best (shortest solutions, ``envs_jax.solvers.sokoban_bfs``) and its
fixed answers are exact; random answers are sampled with the env's own ``step`` (64 first answers ×
32 episodes a level). ``--config`` is a config file (``configs/*.py``) or a run folder (its
``config.json``); other envs are refused. A progress bar counts the levels (about a second each on a CPU).
"""

from __future__ import annotations

from experiments import bootstrap

if __name__ == "__main__":  # first: restarts on tcmalloc before the imports below
    bootstrap.command("experiments.baselines", bootstrap.run_nothing_first, entry="main")

import argparse
import functools
import json
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from ml_collections import ConfigDict
from tqdm import tqdm

from configs import base
from envs_jax.frozen_lake import FrozenLake
from envs_jax.sokoban import Sokoban
from envs_jax.solvers.frozen_lake_dp import (
    all_answers,
    first_answer_share,
    optimal_success_probability,
    random_answers_success,
    same_answer_success,
    turn_limited_success,
)
from envs_jax.solvers.sokoban_bfs import shortest_solution
from experiments.bench.common import load_config as bench_config
from experiments.curves import wilson
from starpo_jax.runtime.experiment import ConfigError, rollout_plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.baselines",
                                description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--config", required=True, help="a config file (configs/*.py) or a run folder")
    p.add_argument("--levels", type=int, default=None, help="levels from envs.val.seed on; default: the config's "
                   "validation count")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    return p.parse_args(argv)


def load_config(source: str) -> ConfigDict:
    """A run folder's saved config, or a config file[:preset] read as ``experiments.run`` reads it."""
    path = Path(source)
    if (path / "config.json").is_file():
        return base.saved_config(path / "config.json")
    file = Path(source.split(":", 1)[0])
    if file.suffix != ".py" or not file.is_file():
        raise ConfigError(f"--config {source!r} is neither a config file (configs/*.py) nor a run folder "
                          "with a config.json.")
    return bench_config(source, [])


def validated_tag(config: ConfigDict, levels: int | None):
    """``(tag plan, rollout plan, first seed, levels)`` of the config's first FrozenLake or Sokoban
    validation env: its seeds follow those of the tags before it, as validation plays them
    (``initial_states_from_seeds``)."""
    plan = rollout_plan(config, "val")
    first_seed = int(config.envs.val.seed)
    for tag in plan.tags:
        if isinstance(tag.env, (FrozenLake, Sokoban)):
            return tag, plan, first_seed, levels or tag.n_groups
        first_seed += tag.n_groups
    names = ", ".join(t.name for t in plan.tags)
    raise ConfigError(f"Baselines exist for FrozenLake and Sokoban only; this config validates on {names}.")


def example_answer(env) -> tuple[int, ...]:
    """The action ids of the answer the env's instruction shows as its example."""
    shown = re.search(r"<answer>(.*?)</answer>", env.instruction)
    if shown is None:
        raise ConfigError(f"The {type(env).__name__} instruction shows no example answer.")
    return tuple(env.action_names.index(name.strip()) for name in shown.group(1).split("||"))


def answer_row(ids: np.ndarray, lengths: np.ndarray, actions: tuple[int, ...]) -> int:
    """The row of ``all_answers`` that is ``actions``."""
    return int(np.flatnonzero((lengths == len(actions)) & (ids[:, :len(actions)] == actions).all(axis=1))[0])


def levels_to_clear(value: float, levels: int) -> int | None:
    """The fewest solved of ``levels`` whose 95 % Wilson interval lies above ``value`` (None: none do)."""
    return next((k for k in range(levels + 1) if wilson(k, levels)[0] > value), None)


def sampled_random_answers(env, state, turns: int, actions_per_turn: int, action_budget: int, key,
                           answers: int = 64, continuations: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """``(success, reward)``, each ``float[answers, continuations]``: episodes of uniformly random valid
    answers (``format_warmup.random_answers``' distribution) from ``state``, played by the env's own
    ``step``; the episodes of a row share their first answer. The env sees one action after another,
    so an episode is its answers' actions in a row, cut to the budget."""
    shape = (answers, continuations, turns)
    k_first, k_later, k_acts, k_env = jax.random.split(key, 4)
    counts = jax.random.randint(k_later, shape, 1, actions_per_turn + 1)
    counts = counts.at[:, :, 0].set(jax.random.randint(k_first, (answers, 1), 1, actions_per_turn + 1))
    actions = jax.random.randint(k_acts, shape + (actions_per_turn,), 0, len(env.action_names))
    actions = actions.at[:, :, 0].set(actions[:, :1, 0])  # one first answer per row
    slot_used = jnp.arange(actions_per_turn) < counts[..., None]
    order = jnp.argsort(~slot_used.reshape(answers, continuations, -1), axis=-1, stable=True)
    played = jnp.take_along_axis(actions.reshape(answers, continuations, -1), order, axis=-1)[..., :action_budget]
    length = jnp.minimum(counts.sum(-1), action_budget)
    keys = jax.random.split(k_env, answers * continuations)
    success, reward = _play(env, state, played.reshape(-1, action_budget), length.reshape(-1), keys)
    return np.asarray(success, np.float64).reshape(answers, continuations), np.asarray(reward, np.float64).reshape(
        answers, continuations)


@functools.partial(jax.jit, static_argnums=0)
def _play(env, state, actions, length, keys):
    """Every row's actions from ``state`` until the episode ends: (succeeded, summed reward)."""
    def episode(actions, length, key):
        start = state.replace(key=key) if hasattr(state, "key") else state  # the env's own randomness

        def step(i, carry):
            s, reward, done, success = carry
            after, ts = env.step(s, actions[i])
            live = (i < length) & ~done
            s = jax.tree.map(lambda new, old: jnp.where(live, new, old), after, s)
            return (s, reward + jnp.where(live, ts.reward, 0.0), done | (live & ts.last()),
                    success | (live & ts.extras["success"]))

        _, reward, _, success = jax.lax.fori_loop(0, actions.shape[0], step, (start, 0.0, False, False))
        return success, reward

    return jax.vmap(episode)(actions, length, keys)


def explained_share(outcomes: np.ndarray) -> float:
    """The share of ``outcomes``' variance (``[answers, continuations]``) that the row (the first
    answer) explains: the variance of the row means less their sampling noise (one-way ANOVA), over
    the total; nan when every outcome is the same."""
    total = outcomes.var()
    if total == 0:
        return float("nan")
    between = outcomes.mean(axis=1).var() - outcomes.var(axis=1, ddof=1).mean() / outcomes.shape[1]
    return float(max(between, 0.0) / total)


def baselines(config: ConfigDict, levels: int | None = None, progress=lambda n: None) -> dict:
    """The figures the command prints, for the config's FrozenLake or Sokoban validation levels."""
    tag, plan, first_seed, levels = validated_tag(config, levels)
    env = tag.env
    limits = dict(turns=plan.max_turn, actions_per_turn=plan.max_actions_per_turn, action_budget=tag.max_actions_per_traj)
    head = {"env": tag.name, "levels": levels, "first_seed": first_seed, **limits}
    states = [env.reset_from_seed(seed) for seed in range(first_seed, first_seed + levels)]
    if isinstance(env, FrozenLake):
        return head | frozen_lake_figures(env, states, limits, progress)
    return head | sokoban_figures(env, states, limits, progress)


def frozen_lake_figures(env: FrozenLake, states: list, limits: dict, progress) -> dict:
    """Every figure exact: dynamic programming over the ice."""
    limits = limits | {"is_slippery": env.is_slippery}
    ids, lengths = all_answers(limits["actions_per_turn"])
    example = answer_row(ids, lengths, example_answer(env)[:limits["actions_per_turn"]])
    closed, best, random, same, share = [], [], [], [], []
    for state in states:
        closed.append(optimal_success_probability(state, limits["action_budget"], env.is_slippery))
        best.append(turn_limited_success(state, **limits))
        random.append(random_answers_success(state, **limits))
        same.append(same_answer_success(state, **limits))
        share.append(first_answer_share(state, **limits))
        progress(1)
    return {"exact": True, "is_slippery": env.is_slippery,
            "closed_loop": float(np.mean(closed)), "turn_limited": float(np.mean(best)),
            **blind_figures(env, ids, lengths, example, same, random, share)}


def sokoban_figures(env: Sokoban, states: list, limits: dict, progress) -> dict:
    """The env is deterministic, so the best and every fixed answer are exact: a level is solvable
    within the turns when its shortest solution fits the budget and the turns' actions, and an answer
    given every turn is played once. Random answers and the first answer's share are sampled (64
    first answers × 32 episodes a level)."""
    reach = min(limits["action_budget"], limits["turns"] * limits["actions_per_turn"])
    ids, lengths = all_answers(limits["actions_per_turn"])
    example = answer_row(ids, lengths, example_answer(env)[:limits["actions_per_turn"]])
    repeated = np.stack([np.resize(row[:n], reach) for row, n in zip(ids, lengths)])  # each answer, turn after turn
    played = np.minimum(lengths * limits["turns"], reach)
    solvable, same, random, share = [], [], [], []
    for i, state in enumerate(states):
        solvable.append(shortest_solution(state, max_depth=reach) is not None)
        same.append(np.asarray(_play(env, state, repeated, played, jax.random.split(jax.random.PRNGKey(i), len(ids)))[0]))
        success, reward = sampled_random_answers(env, state, **limits, key=jax.random.PRNGKey(i))
        random.append(success.mean())
        share.append(explained_share(reward))
        progress(1)
    return {"exact": False, "closed_loop": float(np.mean(solvable)), "turn_limited": float(np.mean(solvable)),
            **blind_figures(env, ids, lengths, example, same, random, share)}


def blind_figures(env, ids: np.ndarray, lengths: np.ndarray, example: int, same: list, random: list,
                  share: list) -> dict:
    """The board-blind rows and what they imply, from each level's success of every answer of
    ``all_answers`` given every turn (``same``), of random answers, and the first answer's share."""
    same_mean = np.mean(same, axis=0)
    blind = int(np.argmax(same_mean))
    answer_text = lambda row: " || ".join(env.action_names[a] for a in ids[row, :lengths[row]])  # noqa: E731
    random_valid = float(np.mean(random))
    return {
        "best_same_answer": float(same_mean[blind]), "best_same_answer_text": answer_text(blind),
        "example_answer": float(same_mean[example]), "example_answer_text": answer_text(example),
        "random_valid": random_valid,
        "levels_to_beat_blind": levels_to_clear(max(float(same_mean[blind]), random_valid), len(same)),
        "first_answer_share": float(np.nanmean(share)) if not np.isnan(share).all() else None,
    }


def format_report(r: dict) -> str:
    how = ("expected success, exact (dynamic programming over the ice)" if r["exact"] else
           "exact but for random answers, sampled (64 first answers x 32 episodes a level)")
    lines = [
        ("best, seeing the board after every action", r["closed_loop"], ""),
        ("best, seeing the board as each turn starts", r["turn_limited"], ""),
        ("best single answer every turn, board unread", r.get("best_same_answer"), r.get("best_same_answer_text")),
        ("the prompt's example every turn, board unread", r.get("example_answer"), r.get("example_answer_text")),
        ("uniformly random valid answers, board unread", r["random_valid"], ""),
    ]
    need, share = r["levels_to_beat_blind"], r["first_answer_share"]
    return "\n".join([
        f"{r['env']}: {r['levels']} levels from seed {r['first_seed']}, {r['turns']} turns of up to "
        f"{r['actions_per_turn']} actions, {r['action_budget']} in all; {how}",
        *(f"  {label:48s} {value:.3f}" + (f"  ({answer})" if answer else "") for label, value, answer in lines
          if value is not None),
        f"A run beats every board-blind policy above with {need} or more of {r['levels']} levels solved "
        "(its 95 % Wilson interval above the best of them)." if need is not None else
        f"No count of {r['levels']} levels clears the best board-blind policy with 95 % confidence: use more levels.",
        *([f"Under random valid answers the first answer explains {share:.1%} of a group's reward variance (mean "
           "over the levels); the rest is the env's luck and the later turns'."] if share is not None else []),
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config)
        if args.levels is not None and args.levels < 1:
            raise ConfigError(f"--levels must be at least 1, not {args.levels}.")
        levels = validated_tag(config, args.levels)[3]
        with tqdm(total=levels, desc="levels", unit="level") as bar:
            report = baselines(config, args.levels, bar.update)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(format_report(report))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.out}")
    return 0
