"""bench.format_warmup on a tiny random model: valid-answer counts before and after, consistent."""

import pytest

from experiments.bench import format_warmup
from helpers import TINY_MODEL_FLAGS, assert_refused_in_one_line

TINY_FROZEN_LAKE = [
    *TINY_MODEL_FLAGS, "--config.envs.train.tags=('FrozenLake',)", "--config.envs.train.n_groups=(2,)",
    "--config.envs.train.group_size=2", "--config.rollout.max_turn=2", "--config.rollout.response_length=8",
    "--config.rollout.max_model_len=640", "--config.actor.ppo_mini_batch_size=2", "--config.actor.micro_batch_size=2",
]


def test_bench_format_warmup_reports_valid_answers_before_and_after(tmp_path):
    report = format_warmup.main(["--config", "configs/base.py", "--steps", "2", "--lr", "1e-3", "--rollouts", "2",
                                 "--out", str(tmp_path / "b.json"), *TINY_FROZEN_LAKE])
    assert (tmp_path / "b.json").exists() and len(report["nll"]) == 2 and report["nll"][1] < report["nll"][0]
    for side in ("before", "after"):
        counts = report[side]["FrozenLake"]
        assert counts["first_turns"] == 2 * 4  # two rollouts of 2 groups x 2
        assert 0 <= counts["first_turn_valid"] <= counts["first_turns"] <= counts["turns"] <= 2 * counts["first_turns"]
        low, high = counts["first_turn_interval"]
        assert low <= counts["first_turn_rate"] <= high


@pytest.mark.parametrize("argv, message", [
    ("--lr 0", "--lr must be positive, not 0.0"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, capsys):
    assert_refused_in_one_line(format_warmup.parse_args, argv, message, capsys)
