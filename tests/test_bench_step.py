"""bench_step --tiny end to end: the report's structure, and figures that must add up."""

import json

import jax
import jax.numpy as jnp
import pytest

from experiments import bench_step

ROWS, TURNS, N = 4 * 2, 2, 8  # bench_step.TINY: 4 groups x 2, 2 turns; --tiny forces N = 8


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_step.json"
    # a declared bandwidth gives the CPU a roofline, so that part of the report is exercised too
    report = bench_step.main(["--tiny", "--bandwidth", "1e10", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert f"| {N} |" in out.with_suffix(".md").read_text()
    assert out.with_suffix(".png").is_file()  # the phases drawn beside the JSON
    return report


def test_every_record_names_device_and_date(report):
    assert report["machine"]["jax_platform"] == "cpu" and report["date"]
    w = report["workload"]
    assert (w["rows"], w["max_turn"], w["estimator"], w["filter_ratio"]) == (ROWS, TURNS, "gae", 0.25)
    assert w["updated_rows"] == 2  # filter 0.25 of 4 groups keeps 1 group of 2
    (result,) = report["results"]
    assert result["device"] == jax.devices()[0].device_kind and result["date"]


def test_forced_length_fixes_the_workload(report):
    (r,) = report["results"]
    assert r["response_tokens"] == N
    assert r["generated_tokens"] == ROWS * TURNS * N  # a random model plays every turn, each exactly N tokens
    assert r["turns_played"] == ROWS * TURNS
    assert r["train_metrics"]["train/generated_tokens"] == ROWS * TURNS * N
    assert r["host_loop"]["generated_tokens"] == ROWS * TURNS * N
    assert r["rollout_tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["phases_s"]["rollout"])


def test_phases_add_up_to_the_step(report):
    (r,) = report["results"]
    p = r["phases_s"]
    assert p["logprobs_values"] + p["critic_update"] + p["actor_update"] == pytest.approx(p["update"])
    # step is timed around collect + learn in the same iterations: medians of the parts come close
    assert p["rollout"] + p["update"] == pytest.approx(p["step"], rel=0.25)
    assert all(len(runs) == 3 for runs in r["runs_s"].values())
    assert set(r["compile_s"]) == {"collect", "learn", "forward_only", "grpo", "grpo_forward_only"}
    assert r["memory"]["learn"]["temporaries"] > 0 and r["memory"]["collect"]["arguments"] > 0


def test_side_by_side_and_roofline(report):
    (r,) = report["results"]
    assert r["speedup_vs_host_loop"] == pytest.approx(r["rollout_tokens_per_s"] / r["host_loop"]["tokens_per_s"])
    gen = r["generate"]
    assert (gen["batch"], gen["new_tokens"], gen["cache_size"]) == (ROWS, N, report["workload"]["max_model_len"])
    assert gen["speedup"] == pytest.approx(gen["starpo_jax"]["tokens_per_s"] / gen["transformers"]["tokens_per_s"])
    roof = r["roofline"]
    assert roof["hbm_bytes_per_s"] == 1e10 and roof["decode_steps"] == TURNS * N
    assert roof["fraction"] == pytest.approx(roof["ideal_s"] / r["phases_s"]["rollout"])


def _scan_of_matmuls(layers: int) -> str:
    def f(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    args = jax.ShapeDtypeStruct((8, 256), jnp.float32), jax.ShapeDtypeStruct((layers, 256, 256), jnp.float32)
    return jax.jit(f).lower(*args).compile().as_text()


def test_hlo_bytes_counts_loop_bodies_by_trip_count():
    """XLA's own cost analysis counts a loop body once; hlo_bytes multiplies by the trip count."""
    weight = 256 * 256 * 4
    six, _ = bench_step.hlo_bytes(_scan_of_matmuls(6))
    twelve, _ = bench_step.hlo_bytes(_scan_of_matmuls(12))
    assert 12 * weight <= twelve <= 4 * 12 * weight  # every layer's weights read, at most a few times
    assert twelve / six == pytest.approx(2.0, rel=0.1)


def test_decode_cost_of_a_tiny_model_is_at_least_its_ideal():
    from starpo_jax.models import preset

    config = preset("tiny-llama")
    c = bench_step.decode_cost(config, batch=4, window=64)
    params = 256 * 64 * 2 + 64 + 3 * (2 * 64 + 64 * 64 * 2 + 64 * 16 * 2 + 3 * 64 * 96)  # embed, head, norms, blocks
    kv = 2 * 3 * 1 * 16 * 4  # K and V, 3 layers, 1 kv head, 16 dims, float32
    assert c["ideal_weights"] == params * 4 / 4 and c["ideal_kv"] == 64 * kv
    assert c["bytes_per_token"] >= c["ideal_bytes_per_token"] and c["over_ideal"] >= 1


@pytest.mark.parametrize(
    "argv, message",
    [(["--response-tokens", "0"], "--response-tokens must lie in 1..400"), (["--steps", "2"], "at least 3")],
)
def test_bad_arguments_are_refused_before_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_step.parse_args(argv)
    assert message in capsys.readouterr().err
