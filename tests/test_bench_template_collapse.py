"""bench.template_collapse on a tiny random model: the figures of one rollout and their time."""

import math

import pytest

from experiments.bench import template_collapse
from helpers import TINY_MODEL_FLAGS

TINY = [
    *TINY_MODEL_FLAGS, "--config.envs.train.tags=('FrozenLake',)", "--config.envs.train.n_groups=(3,)",
    "--config.envs.train.group_size=2", "--config.rollout.max_turn=1", "--config.rollout.response_length=8",
    "--config.rollout.max_model_len=640", "--config.actor.ppo_mini_batch_size=2", "--config.actor.micro_batch_size=2",
]


def test_bench_template_collapse_times_the_figures_of_a_rollout(tmp_path):
    report = template_collapse.main(["--config", "configs/base.py", "--repeats", "1", "--out",
                                     str(tmp_path / "b.json"), *TINY])
    assert (tmp_path / "b.json").exists() and len(report["warm_call_s"]) == 1
    figures = report["figures"]
    assert set(figures) == {f"train/FrozenLake/{k}" for k in ("mi", "mi_seq", "retrieval_acc", "retrieval_chance")}
    assert abs(figures["train/FrozenLake/mi"]) <= math.log(3) + 1e-6


def test_a_missing_config_file_is_one_line(capsys):
    with pytest.raises(SystemExit) as exit_:
        template_collapse.main(["--config", "configs/missing.py"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and err.startswith("error: --config: ") and "configs/missing.py" in err
    assert len(err.splitlines()) == 1, err
