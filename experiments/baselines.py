"""What the best and the board-blind policies score on a run's FrozenLake validation levels, exactly.

    python -m experiments.baselines --config configs/learn_frozen_lake.py
    python -m experiments.baselines --config runs/learn_frozen_lake --levels 256

A learning run's validation success means little alone: on slippery ice a policy that ignores the
board still reaches some goals, and one that reads it perfectly still falls in some holes. For the
validation levels a run plays (``envs.val.seed`` on, the config's ``rollout.max_turn``,
``rollout.max_actions_per_turn`` and action budget), this prints, as expectations over the ice
(``envs_jax.solvers.frozen_lake_dp``; no sampling, so no interval):

- the best policy within the rollout's turns (the board seen as each turn starts, the turn's
  actions played blind), and the closed-loop bound that sees the board after every action;
- board-blind policies: the best single answer given every turn, the prompt's example answer every
  turn, and uniformly random valid answers (what ``experiments.evaluate --policy random-valid``
  samples);
- how many of the levels a run must solve for its 95 % Wilson interval to clear the best
  board-blind policy: a success above that is evidence that the policy reads the board;
- the share of a group's success variance that the first answer explains when the policy is near
  random (``first_answer_share``): the part of a group-relative advantage that can teach the first
  answer; the rest is the ice's luck, noise to the update.

``--config`` is a config file (``configs/*.py``) or a run folder (its ``config.json``). Only
FrozenLake has an exact solver here; other envs are refused. The best single answer takes a few
seconds per level on a CPU, shown by a progress bar.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import sys
from pathlib import Path

import numpy as np
from ml_collections import ConfigDict
from tqdm import tqdm

from configs import base
from envs_jax.frozen_lake import FrozenLake
from envs_jax.solvers.frozen_lake_dp import (
    all_answers,
    first_answer_share,
    optimal_success_probability,
    random_answers_success,
    same_answer_success,
    turn_limited_success,
)
from experiments.curves import wilson
from starpo_jax.runtime.experiment import ConfigError, rollout_plan


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--config", required=True, help="a config file (configs/*.py) or a run folder")
    p.add_argument("--levels", type=int, default=None, help="levels from envs.val.seed on; default: the config's "
                   "validation count")
    p.add_argument("--out", default=None, help="also write the figures as JSON here")
    return p.parse_args(argv)


def load_config(source: str) -> ConfigDict:
    """A run folder's saved config, or a config file's ``get_config()``."""
    path = Path(source)
    if (path / "config.json").is_file():
        return base.saved_config(path / "config.json")
    if path.suffix != ".py" or not path.is_file():
        raise ConfigError(f"--config {source!r} is neither a config file (configs/*.py) nor a run folder "
                          "with a config.json.")
    spec = importlib.util.spec_from_file_location(f"_baselines_config_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def frozen_lake_tag(config: ConfigDict, levels: int | None):
    """``(tag plan, rollout plan, first seed, levels)`` of the config's FrozenLake validation env: its
    seeds follow those of the tags before it, as validation plays them (``initial_states_from_seeds``)."""
    plan = rollout_plan(config, "val")
    first_seed = int(config.envs.val.seed)
    for tag in plan.tags:
        if isinstance(tag.env, FrozenLake):
            return tag, plan, first_seed, levels or tag.n_groups
        first_seed += tag.n_groups
    names = ", ".join(t.name for t in plan.tags)
    raise ConfigError(f"Exact baselines exist for FrozenLake only; this config validates on {names}.")


def example_answer(env: FrozenLake) -> tuple[int, ...]:
    """The action ids of the answer the env's instruction shows as its example."""
    shown = re.search(r"<answer>(.*?)</answer>", env.instruction)
    if shown is None:
        raise ConfigError("The FrozenLake instruction shows no example answer.")
    return tuple(env.action_names.index(name.strip()) for name in shown.group(1).split("||"))


def answer_row(ids: np.ndarray, lengths: np.ndarray, actions: tuple[int, ...]) -> int:
    """The row of ``all_answers`` that is ``actions``."""
    return int(np.flatnonzero((lengths == len(actions)) & (ids[:, :len(actions)] == actions).all(axis=1))[0])


def levels_to_clear(value: float, levels: int) -> int | None:
    """The fewest solved of ``levels`` whose 95 % Wilson interval lies above ``value`` (None: none do)."""
    return next((k for k in range(levels + 1) if wilson(k, levels)[0] > value), None)


def baselines(config: ConfigDict, levels: int | None = None, progress=lambda n: None) -> dict:
    """The figures the command prints, for the config's FrozenLake validation levels."""
    tag, plan, first_seed, levels = frozen_lake_tag(config, levels)
    env = tag.env
    limits = dict(turns=plan.max_turn, actions_per_turn=plan.max_actions_per_turn,
                  action_budget=tag.max_actions_per_traj, is_slippery=env.is_slippery)
    ids, lengths = all_answers(plan.max_actions_per_turn)
    example = answer_row(ids, lengths, example_answer(env)[:plan.max_actions_per_turn])
    closed, best, random, same, share = [], [], [], [], []
    for seed in range(first_seed, first_seed + levels):
        state = env.reset_from_seed(seed)
        closed.append(optimal_success_probability(state, tag.max_actions_per_traj, env.is_slippery))
        best.append(turn_limited_success(state, **limits))
        random.append(random_answers_success(state, **limits))
        same.append(same_answer_success(state, **limits))
        share.append(first_answer_share(state, **limits))
        progress(1)
    same_mean = np.mean(same, axis=0)
    blind = int(np.argmax(same_mean))
    answer_text = lambda row: " || ".join(env.action_names[a] for a in ids[row, :lengths[row]])  # noqa: E731
    best_blind = max(float(same_mean[blind]), float(np.mean(random)))
    return {
        "env": tag.name, "levels": levels, "first_seed": first_seed, **limits,
        "closed_loop": float(np.mean(closed)),
        "turn_limited": float(np.mean(best)),
        "best_same_answer": float(same_mean[blind]), "best_same_answer_text": answer_text(blind),
        "example_answer": float(same_mean[example]), "example_answer_text": answer_text(example),
        "random_valid": float(np.mean(random)),
        "levels_to_beat_blind": levels_to_clear(best_blind, levels),
        "first_answer_share": float(np.nanmean(share)) if not np.isnan(share).all() else None,
    }


def format_report(r: dict) -> str:
    lines = [
        ("best, seeing the board after every action", r["closed_loop"], ""),
        ("best, seeing the board as each turn starts", r["turn_limited"], ""),
        ("best single answer every turn, board unread", r["best_same_answer"], r["best_same_answer_text"]),
        ("the prompt's example every turn, board unread", r["example_answer"], r["example_answer_text"]),
        ("uniformly random valid answers, board unread", r["random_valid"], ""),
    ]
    need = r["levels_to_beat_blind"]
    return "\n".join([
        f"{r['env']}: {r['levels']} levels from seed {r['first_seed']}, {r['turns']} turns of up to "
        f"{r['actions_per_turn']} actions, {r['action_budget']} in all; expected success over the ice (exact)",
        *(f"  {label:48s} {value:.3f}" + (f"  ({answer})" if answer else "") for label, value, answer in lines),
        f"A run beats every board-blind policy above with {need} or more of {r['levels']} levels solved "
        "(its 95 % Wilson interval above the best of them)." if need is not None else
        f"No count of {r['levels']} levels clears the best board-blind policy with 95 % confidence: use more levels.",
        *([f"Under random valid answers the first answer explains {r['first_answer_share']:.1%} of a group's success "
           "variance (mean over the levels); the rest is luck on the ice."] if r["first_answer_share"] is not None else []),
    ])


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config)
        if args.levels is not None and args.levels < 1:
            raise ConfigError(f"--levels must be at least 1, not {args.levels}.")
        levels = frozen_lake_tag(config, args.levels)[3]
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


if __name__ == "__main__":
    sys.exit(main())
