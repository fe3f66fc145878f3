"""The machine's ceilings benchmark (``experiments.bench.ceilings``): what it runs is what it reports."""

import json
import subprocess
import sys

import pytest

from experiments.bench import ceilings
from helpers import REPO, command_env


def test_quick_run_reports_both_ceilings_and_the_read_at_the_sizes_asked(tmp_path):
    out = tmp_path / "ceilings.json"
    report = ceilings.main(["--quick", "--size", "64", "--copy-mib", "4", "--repeats", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert report["matmul"]["size"] == 64 and report["matmul"]["flops"] == 2 * 64**3
    assert report["copy"]["bytes"] == 4 * 2**20 and report["copy"]["bytes_moved"] == 2 * 4 * 2**20
    assert report["read"]["bytes"] == 4 * 2**20  # the same array, read once
    for part in ("matmul", "copy", "read"):
        assert len(report[part]["runs_s"]) == 3 and min(report[part]["runs_s"]) > 0
        assert report[part]["cpu_per_wall"] > 0
    # a ceiling is the fastest run (other work only slows one), the median beside it
    assert report["matmul"]["gflop_per_s"] == pytest.approx(2 * 64**3 / min(report["matmul"]["runs_s"]) / 1e9)
    assert report["copy"]["gb_per_s"] == pytest.approx(2 * 4 * 2**20 / min(report["copy"]["runs_s"]) / 1e9)
    assert report["read"]["gb_per_s"] == pytest.approx(4 * 2**20 / min(report["read"]["runs_s"]) / 1e9)
    assert report["matmul"]["median_gflop_per_s"] <= report["matmul"]["gflop_per_s"]
    assert report["copy"]["median_gb_per_s"] <= report["copy"]["gb_per_s"]
    assert report["machine"]["load_average"]  # a figure is read with the load it was taken under
    assert "GFLOP/s" in out.with_suffix(".md").read_text() and "read alone" in out.with_suffix(".md").read_text()


def test_runs_are_timed_after_one_warm_up_call():
    calls: list[int] = []

    def run():
        calls.append(len(calls))
        return ceilings.jnp.ones(3)

    seconds, cpu_per_wall = ceilings.timed_runs(run, 2)
    assert calls == [0, 1, 2] and len(seconds) == 2 and cpu_per_wall >= 0


def test_bad_input_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "experiments.bench.ceilings", "--repeats", "0"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=command_env())
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "--repeats must be a positive whole number, not 0")


def test_a_bad_config_is_one_line_before_the_ceilings_are_measured(monkeypatch, capsys):
    """A misspelt override of a ``--config`` is found before minutes of measuring; an override with
    no ``--config`` to apply to is refused, not ignored."""
    monkeypatch.setattr(ceilings, "matmul_ceiling", lambda *a: pytest.fail("measured before checking the config"))
    with pytest.raises(SystemExit) as exit_:
        ceilings.main(["--config", "configs/learn_bandit.py", "--config.rollout.max_trun=1"])
    assert exit_.value.code == 2 and capsys.readouterr().err.strip() == (
        "error: --config.rollout.max_trun: config key 'max_trun' does not exist (see configs/base.py). "
        'Did you mean "max_turn" instead of "max_trun"?')
    with pytest.raises(SystemExit):
        ceilings.main(["--config.rollout.max_turn=1"])
    assert "--config.rollout.max_turn=1 overrides a config: give the --config it applies to" in capsys.readouterr().err
