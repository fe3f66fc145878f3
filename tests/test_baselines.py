"""experiments.baselines: exact ceilings and board-blind baselines of a config's FrozenLake levels."""

import json

import jax
import numpy as np
import pytest

import envs_jax
from envs_jax.solvers.frozen_lake_dp import first_answer_share, random_answers_success
from experiments import baselines
from experiments.curves import wilson


def test_frozen_lake_figures(tmp_path, capsys):
    out = tmp_path / "baselines.json"
    assert baselines.main(["--config", "configs/learn_frozen_lake.py", "--levels", "4", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["env"], r["levels"], r["first_seed"], r["turns"], r["actions_per_turn"], r["action_budget"]) == (
        "FrozenLake", 4, 123, 3, 5, 10)
    assert r["example_answer_text"] == "Left || Up"  # read from the env's instruction
    blind = max(r["best_same_answer"], r["random_valid"])
    assert r["example_answer"] <= r["best_same_answer"] <= r["turn_limited"] <= r["closed_loop"]
    assert blind < r["turn_limited"]
    assert 0 < r["first_answer_share"] < 1
    printed = capsys.readouterr().out
    assert "FrozenLake: 4 levels from seed 123, 3 turns of up to 5 actions, 10 in all" in printed
    assert f"{r['best_same_answer']:.3f}  ({r['best_same_answer_text']})" in printed


def test_levels_to_clear_is_the_first_count_above():
    for value, levels in ((0.174, 64), (0.3, 20), (0.0, 5)):
        need = baselines.levels_to_clear(value, levels)
        assert need is not None
        assert wilson(need, levels)[0] > value >= wilson(need - 1, levels)[0]
    assert baselines.levels_to_clear(0.9, 4) is None  # 4 levels cannot show it


@pytest.mark.parametrize("config, message", [
    ("configs/bandit.py", "FrozenLake and Sokoban only; this config validates on Bandit, BanditTest"),
    ("configs/missing.py", "neither a config file"),
    ("configs/learn_frozen_lake.py --levels 0", "--levels must be at least 1"),
])
def test_bad_input_is_one_line(config, message, capsys):
    assert baselines.main(["--config", *config.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_damaged_run_config_is_one_line(tmp_path, capsys):
    (tmp_path / "config.json").write_text('{"envs": ')
    assert baselines.main(["--config", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{tmp_path / 'config.json'} is not a run's config" in err and len(err.splitlines()) == 1


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        baselines.parse_args(["--help"])
    assert exit_.value.code == 0 and "board-blind" in capsys.readouterr().out


def test_sokoban_figures(tmp_path):
    out = tmp_path / "sokoban.json"
    assert baselines.main(["--config", "configs/sokoban.py", "--levels", "2", "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["env"] == "SimpleSokoban" and not r["exact"] and r["example_answer_text"] == "Right || Right || Up"
    assert r["closed_loop"] == 1.0  # both levels solvable within the 10 actions (shortest solutions)
    assert 0 <= r["example_answer"] <= r["best_same_answer"] <= 1 and 0 < r["random_valid"] < 1


def test_sampled_random_answers_agree_with_the_exact_dp():
    # The sampler plays the env's own steps; the DP its transition matrices. Rows share a first
    # answer, which correlates their outcomes: the design effect 1 + (M - 1) * share widens the error.
    env = envs_jax.make("FrozenLake")
    state = env.reset_from_seed(125)
    limits = dict(turns=3, actions_per_turn=5, action_budget=10)
    success, reward = baselines.sampled_random_answers(env, state, **limits, key=jax.random.PRNGKey(0))
    exact = random_answers_success(state, **limits, is_slippery=True)
    share = first_answer_share(state, **limits, is_slippery=True)
    rows, continuations = success.shape
    sigma = np.sqrt(exact * (1 - exact) / success.size * (1 + (continuations - 1) * share))
    assert 0.05 < exact < 0.95 and abs(success.mean() - exact) < 4.5 * sigma
    assert np.array_equal(success, reward)  # FrozenLake pays 1 at the goal, nothing else


def test_explained_share():
    rng = np.random.default_rng(0)
    by_row = np.repeat(rng.normal(size=(64, 1)), 32, axis=1)
    assert baselines.explained_share(by_row) == pytest.approx(1.0)  # the row decides everything
    assert baselines.explained_share(rng.normal(size=(64, 32))) < 0.02  # the row decides nothing
    assert np.isnan(baselines.explained_share(np.ones((4, 4))))
