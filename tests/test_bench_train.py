"""The update benchmark's smoke mode: both modes run on the same batch and the JSON adds up."""

import json

import pytest

from experiments.bench import train as bench_train
from helpers import assert_refused_in_one_line


def test_quick_benchmark_compares_full_and_lora(tmp_path):
    out = tmp_path / "bench.json"
    report = bench_train.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the table as a chart, beside the JSON
    full, lora = report["results"]["full"], report["results"]["lora"]
    assert (full["lora_rank"], lora["lora_rank"]) == (0, 4)
    # Full fine-tuning trains actor + critic backbones and keeps a frozen reference; LoRA trains
    # adapters and keeps the base, which is the same size as the reference.
    assert lora["state_bytes"]["frozen"] == full["state_bytes"]["frozen"]
    assert lora["state_bytes"]["trained"] < 0.05 * full["state_bytes"]["trained"]
    assert full["state_bytes"]["optimizer"] == pytest.approx(2 * full["state_bytes"]["trained"], rel=1e-6)  # Adam: 2 moments
    assert all(r["learn_bytes"]["temporaries"] > 0 and r["compile_s"] > 0 for r in (full, lora))
    # The batch's layout: the pair's first prompt once, rows cut from 320 positions to their width
    layout = report["results"]["layout"]
    assert layout["layout"]["prefix"] > 0 and layout["layout"]["width"] < 320
    assert layout["state_bytes"] == full["state_bytes"]


@pytest.mark.parametrize("argv, message", [
    ("--model nosuch", "unknown model 'nosuch' in --model"),
    ("--groups 0", "--groups must be a positive whole number, not 0"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, capsys):
    assert_refused_in_one_line(bench_train.parse_args, argv, message, capsys)
