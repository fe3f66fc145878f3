"""experiments.bench.imitation: supervised steps on best or random first answers, then validation."""

import json

import pytest

from experiments.bench import imitation
from helpers import TINY_MODEL_FLAGS, assert_refused_in_one_line

TINY_SOKOBAN = [*TINY_MODEL_FLAGS, "--config.envs.train.tags=('SimpleSokoban',)", "--config.envs.val.tags=('SimpleSokoban',)",
                "--config.envs.val.n_groups=(2,)", "--config.rollout.max_turn=1", "--config.rollout.response_length=24",
                "--config.rollout.max_model_len=512", "--config.trainer.mi_prompts=2"]


def test_both_arms_learn_their_answers_and_validate(tmp_path):
    out = tmp_path / "imitation.json"
    report = imitation.main(["--steps", "2", "--levels", "2", "--lr", "1e-3", "--out", str(out), *TINY_SOKOBAN])
    assert json.loads(out.read_text())["env"] == "SimpleSokoban"
    for arm in ("random", "best"):
        r = report["arms"][arm]
        assert len(r["nll"]) == 2 and r["nll"][1] < r["nll"][0]  # the answers (their format first), learned
        v = r["validation"]
        assert v["levels"] == 2 and 0 <= v["solved"] <= 2 and v["mi"] is not None


def test_best_answers_open_a_shortest_solution():
    import envs_jax
    from envs_jax.solvers.sokoban_bfs import shortest_solution

    env = envs_jax.make("SimpleSokoban")
    state = env.reset_from_seed(1_000_000)
    solution = shortest_solution(state, max_depth=10)
    assert solution is not None and imitation.best_answer(env, state, 3, 2, 10) == tuple(solution[:2])


def test_one_frozen_lake_or_sokoban_tag_only():
    with pytest.raises(SystemExit, match="one FrozenLake or Sokoban env tag; this config trains on Bandit"):
        imitation.main(["--steps", "1", *TINY_MODEL_FLAGS, "--config.envs.train.tags=('Bandit',)"])


@pytest.mark.parametrize("argv, message", [
    ("--lr -1", "--lr must be positive, not -1.0"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, capsys):
    assert_refused_in_one_line(imitation.parse_args, argv, message, capsys)
