"""The generation benchmark's smoke mode runs end to end and writes the JSON it promises."""

import json

import pytest

from experiments.bench import generate as bench_generate
from helpers import assert_refused_in_one_line


def test_quick_benchmark_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    report = bench_generate.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the table as a chart, beside the JSON
    assert report["workload"]["new_tokens"] == 8 and report["machine"]["jax_platform"] == "cpu"
    (row,) = report["results"]
    assert (row["model"], row["batch"], row["weights"]) == ("tiny-llama", 2, "random")
    assert row["jax"]["compile_s"] > 0 and len(row["jax"]["run_s"]) == 1
    assert row["jax"]["decode_tokens_per_s"] > row["jax"]["tokens_per_s"]  # prefill time is taken out
    assert row["transformers"]["tokens_per_s"] > 0 and "speedup_vs_transformers" in row  # the comparison ran


def test_roofline_of_qwen25_half_b_on_h100():
    from starpo_jax.models import preset

    config = preset("qwen2.5-0.5b", dtype="bfloat16", param_dtype="bfloat16")
    r = bench_generate.roofline(config, 494_032_768, batch=128, prompt_len=256, new_tokens=256, bandwidth=3.35e12)
    kv_per_token = 2 * 24 * 2 * 64 * 2  # K and V, 24 layers, 2 kv heads, 64 dims, bf16: 12 KiB
    assert r["bytes_per_step"] == 494_032_768 * 2 + 128 * (256 + 127.5) * kv_per_token
    assert r["tokens_per_s"] == pytest.approx(128 * 3.35e12 / r["bytes_per_step"])
    from experiments.bench.common import hbm_bandwidth

    assert hbm_bandwidth("NVIDIA H100 80GB HBM3") == 3.35e12
    assert hbm_bandwidth("NVIDIA H100 PCIe") == 2.0e12
    assert hbm_bandwidth("NVIDIA H200") == 4.8e12 and hbm_bandwidth("cpu") is None


def test_cache_size_compares_windowed_and_whole_cache_decoding(tmp_path):
    report = bench_generate.main(["--quick", "--no-hf", "--cache-size", "1024", "--out", str(tmp_path / "b.json")])
    (row,) = report["results"]
    assert report["workload"]["cache_size"] == 1024 and "transformers" not in row
    assert row["jax_whole_cache"]["tokens_per_s"] > 0 and "window_speedup" in row  # the whole cache ran too


@pytest.mark.parametrize("argv, message", [
    ("--models nosuch", "unknown model 'nosuch' in --models"),
    ("--batch-sizes 1,0", "--batch-sizes takes positive whole numbers separated by commas, not '1,0'"),
    ("--quick --cache-size 1", "--cache-size 1 holds fewer than --prompt-len + --new-tokens (16) slots"),
    ("--hf-repeats 0", "--hf-repeats must be a positive whole number, not 0"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, capsys):
    assert_refused_in_one_line(bench_generate.parse_args, argv, message, capsys)
