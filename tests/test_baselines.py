"""experiments.baselines: exact ceilings and board-blind baselines of a config's FrozenLake levels."""

import json

import pytest

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
        assert wilson(need, levels)[0] > value >= wilson(need - 1, levels)[0]
    assert baselines.levels_to_clear(0.9, 4) is None  # 4 levels cannot show it


@pytest.mark.parametrize("config, message", [
    ("configs/sokoban.py", "FrozenLake only; this config validates on SimpleSokoban"),
    ("configs/missing.py", "neither a config file"),
    ("configs/learn_frozen_lake.py --levels 0", "--levels must be at least 1"),
])
def test_bad_input_is_one_line(config, message, capsys):
    assert baselines.main(["--config", *config.split()]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_help_exits_0(capsys):
    with pytest.raises(SystemExit) as exit_:
        baselines.parse_args(["--help"])
    assert exit_.value.code == 0 and "board-blind" in capsys.readouterr().out
