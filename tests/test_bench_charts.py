"""Benchmark tables drawn as PNG charts beside their JSON, and redrawn from existing JSON."""

import json

import matplotlib.image

from experiments import bench_charts, bench_envs


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
    assert bench_charts.main([str(other)]) == 1
    assert "not a benchmark report" in capsys.readouterr().err and not other.with_suffix(".png").exists()
