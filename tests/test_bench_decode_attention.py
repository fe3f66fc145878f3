"""The decode-attention benchmark's smoke mode: the kernel and both orientations compiled as asked, timed, compared."""

import json

import pytest

from experiments.bench import decode_attention
from helpers import assert_refused_in_one_line


def test_quick_benchmark_times_the_kernel_and_both_orientations(tmp_path, monkeypatch):
    from starpo_jax.models import cpu_kernels, decoder

    seen: list[tuple[int, bool]] = []
    choose = decoder._keys_lead_the_product

    def recorded(queries):
        seen.append((decoder.KEYS_LEAD_MAX_QUERIES, choose(queries)))
        return seen[-1][1]

    monkeypatch.setattr(decoder, "_keys_lead_the_product", recorded)
    out = tmp_path / "attention.json"
    report = decode_attention.main(["--quick", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    (row,) = report["results"].values()
    assert (row["model"], row["batch"], row["new_tokens"]) == ("tiny-llama", 4, 8)
    variants = ["kernel", "kernel-shared", "keys-first", "queries-first"] if cpu_kernels.available() \
        else ["keys-first", "queries-first"]
    assert list(row["seconds"]) == variants and all(len(row["seconds"][o]) == 2 for o in variants)  # one round
    assert row["speedup"] == row["median_s"]["queries-first"] / row["median_s"]["keys-first"]
    if "kernel" in variants:
        assert row["kernel_speedup"] == row["median_s"]["keys-first"] / row["median_s"]["kernel"]
        assert 0.0 <= row["kernel_same_tokens"] <= 1.0
        assert row["shared_speedup"] == row["median_s"]["kernel"] / row["median_s"]["kernel-shared"]
        assert row["shared_same_tokens"] == 1.0  # every row holds the same: the same floats from either
    # tiny-llama decodes with 2 queries per kv head: keys-first under the library's threshold, not under 0
    assert {(limit, keys_first) for limit, keys_first in seen} == {(decoder.KEYS_LEAD_MAX_QUERIES, True), (0, False)}
    assert 0.0 <= row["same_tokens"] <= 1.0
    assert "| tiny |" in out.with_suffix(".md").read_text()
    from experiments.bench import charts

    assert charts.kind_of(report) == "decode_attention" and out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    bars = charts.draw_decode_attention(report).axes[0].patches
    assert [b.get_height() for b in bars] == [row["median_s"][o] for o in ("queries-first", "keys-first", "kernel",
                                                                           "kernel-shared") if o in variants]


@pytest.mark.parametrize("argv, message", [
    ("--repeats 0", "--repeats must be a positive whole number, not 0"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, capsys):
    assert_refused_in_one_line(decode_attention.parse_args, argv, message, capsys)
