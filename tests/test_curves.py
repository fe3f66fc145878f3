"""experiments.curves: the Wilson interval its tables and bands use, and its one-line errors."""

import json

import pytest

from experiments import curves


@pytest.mark.parametrize("k, n, low, high", [(0, 10, 0.0, 0.2775), (5, 10, 0.2366, 0.7634), (230, 256, 0.8553, 0.9297)])
def test_wilson_interval_is_the_score_intervals_roots(k, n, low, high):
    """The roots of (p̂ − p)² = z² p(1 − p) / n, the score interval's definition."""
    assert curves.wilson(k, n) == pytest.approx((low, high), abs=1e-4)


def test_a_folder_that_is_not_a_run_is_one_line(tmp_path, capsys):
    assert curves.main([str(tmp_path), "--out", str(tmp_path / "c.png")]) == 2
    assert capsys.readouterr().err == (f"error: {tmp_path} is neither a run folder (metrics.jsonl, config.json) nor a "
                                       "sweep's (sweep.jsonl).\n")
    assert curves.main([str(tmp_path), "--labels", "a", "b"]) == 2


def test_a_sweep_folder_draws_one_series_per_setting(tmp_path):
    rows = [{"step": t, "setting": {"actor.lr": lr}, "train/reward/mean": lr * t} for lr in (1e-5, 3e-5) for t in (1, 2)]
    (tmp_path / "sweep.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert curves.main([str(tmp_path), "--labels", "lr", "--out", str(tmp_path / "s.png")]) == 0
    summary = json.loads((tmp_path / "s.json").read_text())
    assert list(summary) == ["lr actor.lr=1e-05", "lr actor.lr=3e-05"] and (tmp_path / "s.png").stat().st_size > 0


def test_a_run_draws_validation_rates_with_bands(tmp_path, capsys):
    """A run's validation success, valid-answer and effective-action rates, each with its band
    over the levels in config.json, printed first → last."""
    config = {"envs": {"val": {"tags": ["FrozenLake"], "n_groups": [64], "group_size": 1}}}
    rows = [{"step": s, "val-env/FrozenLake/success": p, "val-env/FrozenLake/action_is_valid": v,
             "val-env/FrozenLake/action_is_effective": e} for s, p, v, e in [(0, 0.0, 0.0, 0.0), (8, 0.125, 0.5, 0.25)]]
    rows.insert(1, {"step": 1, "train/FrozenLake/success": 0.0, "train/reward/mean": -0.3})
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert curves.main([str(tmp_path), "--labels", "fl", "--out", str(tmp_path / "c.png")]) == 0
    last = json.loads((tmp_path / "c.json").read_text())["fl"]["validation"]["FrozenLake"][-1]
    assert last["interval"] == pytest.approx(curves.wilson(8, 64))
    assert last["action_is_effective_interval"] == pytest.approx(curves.wilson(16, 64))
    out = capsys.readouterr().out
    assert "effective actions" in out and curves.ci(last, "action_is_effective") in out
    assert "0.000 [0.000, 0.057]  →  0.250 [0.160, 0.368]" in out  # effective actions: 0 → 16 of 64 levels
