"""bench_step --tiny end to end: the report's structure, the workload it fixes, and the ``learn``
variants its phase split is built on. (Figures the report derives from others by its own division,
such as ``critic_update`` as the remainder or a speed-up as a ratio, are not re-checked: such a test
cannot fail.)"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments.bench import step as bench_step
from experiments.bench.hlo_bytes import hlo_bytes
from helpers import assert_refused_in_one_line

ROWS, TURNS, N = 4 * 2, 2, 8  # bench_step.TINY: 4 groups x 2, 2 turns; --tiny forces N = 8


@pytest.fixture(scope="module")
def timed_update():
    """What ``split_update`` timed in the fixture below: (programs, state, trajectories, hyper)."""
    return []


@pytest.fixture(scope="module")
def report(tmp_path_factory, timed_update):
    out = tmp_path_factory.mktemp("bench") / "bench_step.json"
    split_update = bench_step.split_update

    def recording(programs, state, traj, hyper, steps, bar):
        timed_update.append((programs, state, traj, hyper))
        return split_update(programs, state, traj, hyper, steps, bar)

    # a declared bandwidth gives the CPU a roofline, so that part of the report is exercised too
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench_step, "split_update", recording)
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


def test_step_is_timed_as_rollout_plus_update(report):
    (r,) = report["results"]
    p = r["phases_s"]
    # step is timed around collect + learn in the same iterations: medians of the parts come close
    assert p["rollout"] + p["update"] == pytest.approx(p["step"], rel=0.25)
    assert all(len(runs) == 3 for runs in r["runs_s"].values())
    assert set(r["compile_s"]) == {"collect", "learn", "forward_only", "grpo", "grpo_forward_only"}
    assert r["memory"]["learn"]["temporaries"] > 0 and r["memory"]["collect"]["arguments"] > 0


def test_update_variants_do_what_the_phases_name(report, timed_update):
    """The phase split times ``learn`` variants: with ``ppo_epochs = 0`` no optimiser step (log-probs,
    values and advantages only), with GRPO the actor's passes and no critic update. Each run again
    on the batch the benchmark timed them on."""
    (programs, state, traj, hyper), = timed_update
    assert set(programs.variants) == {"forward_only", "grpo", "grpo_forward_only"}

    def same(a, b):
        return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))

    for name in ("forward_only", "grpo_forward_only"):
        after, _ = programs.variants[name](state, traj, hyper)
        assert same(after.actor, state.actor) and same(after.critic, state.critic), name
    after, _ = programs.variants["grpo"](state, traj, hyper)
    assert not same(after.actor, state.actor) and same(after.critic, state.critic)


def test_side_by_side_and_roofline(report):
    (r,) = report["results"]
    assert r["host_loop"]["tokens_per_s"] > 0 and "speedup_vs_host_loop" in r
    gen = r["generate"]
    assert (gen["batch"], gen["new_tokens"], gen["cache_size"]) == (ROWS, N, report["workload"]["max_model_len"])
    assert gen["starpo_jax"]["tokens_per_s"] > 0 and gen["transformers"]["tokens_per_s"] > 0
    roof = r["roofline"]
    assert roof["hbm_bytes_per_s"] == 1e10 and roof["decode_steps"] == TURNS * N


def _scan_of_matmuls(layers: int) -> str:
    def f(x, ws):
        return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), x, ws)[0]

    args = jax.ShapeDtypeStruct((8, 256), jnp.float32), jax.ShapeDtypeStruct((layers, 256, 256), jnp.float32)
    text = jax.jit(f).lower(*args).compile().as_text()
    assert text is not None
    return text


def test_hlo_bytes_counts_loop_bodies_by_trip_count():
    """XLA's own cost analysis counts a loop body once; hlo_bytes multiplies by the trip count."""
    weight = 256 * 256 * 4
    six, _ = hlo_bytes(_scan_of_matmuls(6))
    twelve, _ = hlo_bytes(_scan_of_matmuls(12))
    assert 12 * weight <= twelve <= 4 * 12 * weight  # every layer's weights read, at most a few times
    assert twelve / six == pytest.approx(2.0, rel=0.1)


_GPU_HLO = """HloModule gpu_like

%fused_dynamic_slice (param_0: f32[24,1000], param_1: s32[]) -> f32[1,1000] {
  %param_0 = f32[24,1000]{1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %constant_0 = s32[] constant(0)
  ROOT %dynamic-slice.1 = f32[1,1000]{1,0} dynamic-slice(%param_0, %param_1, %constant_0), dynamic_slice_sizes={1,1000}
}

%async_computation (param_0.1: f32[24,1000], param_1.1: s32[]) -> f32[1,1000] {
  %param_0.1 = f32[24,1000]{1,0} parameter(0)
  %param_1.1 = s32[] parameter(1)
  ROOT %fusion.1 = f32[1,1000]{1,0} fusion(%param_0.1, %param_1.1), kind=kLoop, calls=%fused_dynamic_slice
}

ENTRY %main (p0: f32[24,1000], p1: s32[], p2: f32[8,1000]) -> f32[8,1] {
  %p0 = f32[24,1000]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %p2 = f32[8,1000]{1,0} parameter(2)
  %fusion-start = ((f32[24,1000]{1,0}, s32[]), f32[1,1000]{1,0}, u32[]) async-start(%p0, %p1), calls=%async_computation
  %fusion-done = f32[1,1000]{1,0} async-done(%fusion-start)
  %custom-call = (f32[8,1]{1,0}, s8[33554432]{0}) custom-call(%p2, %fusion-done), custom_call_target="__cublas$lt$matmul"
  ROOT %get-tuple-element = f32[8,1]{1,0} get-tuple-element(%custom-call), index=0
}
"""


def test_hlo_bytes_reads_xla_gpu_async_pairs_and_library_calls():
    """XLA:GPU runs a layer's slice as an async pair wrapping a fusion (counted once: the slice read,
    its index, the slice written) and cuBLAS returns a scratch buffer beside its result (not data)."""
    total, _ = hlo_bytes(_GPU_HLO)
    dynamic_slice = 1000 * 4 + 4 + 1000 * 4
    matmul = 8 * 1000 * 4 + 1000 * 4 + 8 * 4
    assert total == dynamic_slice + matmul


def test_decode_cost_of_a_tiny_model_is_at_least_its_ideal():
    from starpo_jax.models import preset

    config = preset("tiny-llama")
    c = bench_step.decode_cost(config, batch=4, window=64)
    params = 256 * 64 * 2 + 64 + 3 * (2 * 64 + 64 * 64 * 2 + 64 * 16 * 2 + 3 * 64 * 96)  # embed, head, norms, blocks
    kv = 2 * 3 * 1 * 16 * 4  # K and V, 3 layers, 1 kv head, 16 dims, float32
    assert c["ideal_weights"] == params * 4 / 4 and c["ideal_kv"] == 64 * kv
    assert c["bytes_per_token"] >= c["ideal_bytes_per_token"] and c["over_ideal"] >= 1


def test_decode_hlo_compiles_a_trees_own_decode_step_and_keeps_its_hlo(tmp_path):
    """experiments/bench/decode_hlo.py (run as a file, as on a GPU machine) reports what this tree's
    decode_cost reports for the same step, and keeps the HLO it counted."""
    import subprocess
    import sys

    from starpo_jax.models import preset

    script = Path(bench_step.__file__).with_name("decode_hlo.py")
    argv = ["--model", "tiny-llama", "--dtypes", "float32", "--batch", "4", "--max-len", "256", "--out", str(tmp_path)]
    subprocess.run([sys.executable, str(script), *argv], check=True, capture_output=True, timeout=600)
    (record,) = json.loads((tmp_path / "figures.json").read_text())
    expected = bench_step.decode_cost(preset("tiny-llama", dtype="float32", param_dtype="float32"), batch=4, window=256)
    assert record["bytes_per_token"] == expected["bytes_per_token"] and record["window"] == 256
    assert hlo_bytes((tmp_path / "float32_256.hlo.txt").read_text())[0] == 4 * expected["bytes_per_token"]


@pytest.mark.parametrize(
    "argv, message",
    [(["--response-tokens", "0"], "--response-tokens must lie in 1..400"), (["--steps", "2"], "at least 3")],
)
def test_bad_arguments_are_refused_before_work(argv, message, capsys):
    with pytest.raises(SystemExit):
        bench_step.parse_args(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ("--tree /nonexistent", "--tree /nonexistent has no starpo_jax package"),
    ("--batch 0", "--batch and --max-len must be positive whole numbers, not 0 and 3600"),
    ("--dtypes float8", "--dtypes takes float32 and bfloat16, separated by commas, not 'float8'"),
])
def test_decode_hlo_refuses_bad_input_before_it_imports_the_tree(argv, message, capsys):
    from experiments.bench import decode_hlo

    assert_refused_in_one_line(decode_hlo.parse_args, argv, message, capsys)


@pytest.mark.parametrize("argv, message", [
    ("--model nosuch", "unknown model 'nosuch' in --model"),
    ("--batch 0", "--batch must be a positive whole number, not 0"),
    ("--cache 100", "--prompt 267, or --held 1200 + --turn 64, does not fit --cache 100"),
])
def test_append_window_refuses_bad_input_before_anything_loads(argv, message, capsys):
    from experiments.bench import append_window

    assert_refused_in_one_line(append_window.parse_args, argv, message, capsys)


def test_append_window_times_both_appends_in_and_out_of_the_window(capsys):
    from experiments.bench import append_window

    argv = ["--model", "tiny-qwen2", "--batch", "2", "--cache", "1100", "--prompt", "20", "--held", "300",
            "--turn", "8", "--repeats", "1"]
    records = append_window.main(argv)
    assert [(r["case"], r["windowed"]) for r in records] == [
        ("first turn", True), ("first turn", False), ("later turn", True), ("later turn", False)]
    assert all(r["seconds"] > 0 and r["compile_s"] > 0 for r in records)
    assert "cache 1100" in capsys.readouterr().out


def test_gpu_decode_check_script_says_what_it_does():
    import subprocess

    script = Path(bench_step.__file__).with_name("gpu_decode_check.sh")
    proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "OLD_TREE" in proc.stdout and "BUDGET_S" in proc.stdout


def test_gpu_window_script_says_what_it_does():
    import subprocess

    script = Path(bench_step.__file__).with_name("gpu_window.sh")
    proc = subprocess.run(["bash", str(script), "--help"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0
    for word in ("STAGES", "BUDGET_S", "paper", "step", "decode", "bandit", "PAPER_ARGS"):
        assert word in proc.stdout, word


# The paper's command at bench.step's tiny CPU shapes (the window script's PAPER_ARGS), with the
# command's own Qwen2.5 tokenizer.
TINY_PAPER = " ".join(f"--config.{key}={value}".replace(" ", "") for key, value in bench_step.TINY.items()
                      if key != "model.source")


@pytest.mark.slow  # ~90 s: two processes of the paper's command at tiny shapes
def test_gpu_window_runs_the_papers_command_and_its_resume(tmp_path):
    import os
    import subprocess
    import sys
    import tarfile

    script = Path(bench_step.__file__).with_name("gpu_window.sh")
    env = {**os.environ, "PY": sys.executable, "WHEELS": "", "OUT": str(tmp_path), "BUDGET_S": "600",
           "STAGES": "paper", "VAL_LEVELS": "4", "PAPER_ARGS": TINY_PAPER}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=900, env=env,
                          cwd=Path(bench_step.__file__).parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:]
    def read(tar: tarfile.TarFile, name: str) -> bytes:
        member = tar.extractfile(name)
        assert member is not None, f"{name} is not a file in the archive"
        return member.read()

    with tarfile.open(tmp_path / "paper.tar.gz") as tar:
        assert "first process (3 steps): rc=0" in read(tar, "paper/log").decode()
    with tarfile.open(tmp_path / "paper_resume.tar.gz") as tar:
        assert "resume (1 step, validation, export): rc=0" in read(tar, "paper_resume/log").decode()
        rows = [json.loads(line) for line in read(tar, "paper_resume/metrics.jsonl").splitlines()]
    assert [r["step"] for r in rows if "timing_s/step" in r] == [1, 2, 3, 4]


@pytest.mark.parametrize("argv, message", [
    ("--tiny --model /nonexistent", "--tiny times a tiny random model"),
    ("--hf-repeats 0", "--hf-repeats must be a positive whole number, not 0"),
    ("--bandwidth -1", "--bandwidth must be positive, not -1.0"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, capsys):
    assert_refused_in_one_line(bench_step.parse_args, argv, message, capsys)
