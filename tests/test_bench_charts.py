"""Benchmark tables drawn as PNG charts beside their JSON, and redrawn from existing JSON."""

import json

import matplotlib.image

from experiments.bench import charts as bench_charts
from experiments.bench import envs as bench_envs


def test_charts_are_drawn_beside_the_json_and_redrawn_from_it(tmp_path, capsys):
    out = tmp_path / "bench_envs.json"
    bench_envs.main(["--quick", "--envs", "Bandit,FrozenLake", "--batch-sizes", "2,4", "--modes", "step",
                     "--max-steps", "4", "--out", str(out)])
    png = out.with_suffix(".png")
    height, width, _ = matplotlib.image.imread(png).shape
    assert width > 2 * height  # one panel per env, side by side
    png.unlink()
    assert bench_charts.main([str(out)]) == 0 and png.exists()
    assert bench_charts.kind_of(json.loads(out.read_text())) == "envs"


def test_unknown_json_is_reported_not_drawn(tmp_path, capsys):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"results": 3}))
    broken = tmp_path / "broken.json"
    broken.write_text("{")
    assert bench_charts.main([str(other), str(broken)]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0] == f"error: {other}: not a benchmark report this script knows"
    assert err[1].startswith(f"error: {broken}: not a complete benchmark report (JSONDecodeError: ")
    assert not other.with_suffix(".png").exists() and not broken.with_suffix(".png").exists()


def test_bench_step_chart_stacks_the_phases_per_n(tmp_path):
    phases = {"rollout": 1.0, "logprobs_values": 0.2, "critic_update": 0.3, "actor_update": 0.5}
    report = {"results": [{"response_tokens": n, "phases_s": phases} for n in (100, 400)],
              "decode_cost": {"steps": [{"dtype": "float32", "window": w, "bytes_per_token": 2**21 * w,
                                         "ideal_bytes_per_token": 2**20 * w} for w in (450, 900)]}}
    assert bench_charts.kind_of(report) == "step"
    fig = bench_charts.draw_step(report)
    bars, lines = fig.axes[0].patches, fig.axes[1].lines
    assert len(bars) == 4 * 2  # one segment per phase per N
    assert max(b.get_y() + b.get_height() for b in bars) == 2.0  # stacked up to the step's seconds
    assert [list(line.get_ydata()) for line in lines] == [[900, 1800], [450, 900]]  # MiB per token
    chart = bench_charts.write_chart(report, tmp_path / "step.png")
    assert chart is not None and chart.is_file()
