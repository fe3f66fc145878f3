"""The rollout benchmark's smoke mode runs both modes end to end and writes the JSON it promises."""

import json

import numpy as np
import pytest

from experiments.bench import rollout as bench_rollout
from experiments.bench import rollout_timing
from helpers import assert_refused_in_one_line

ROWS, TURNS, RESPONSE = 2 * 2, 2, 8
METRICS = {
    "wall_s", "run_s", "compile_s", "generated_tokens", "env_steps", "turns_played", "episodes_solved",
    "tokens_per_s", "env_steps_per_s",
}  # fmt: skip


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "bench_rollout.json"
    report = bench_rollout.main(["--quick", "--models", "tiny-random", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the table as a chart, beside the JSON
    return report


def test_report_describes_workload_and_machine(report):
    w = report["workload"]
    assert (w["env"], w["rows"], w["max_turn"], w["response_length"], w["dtype"]) == (
        "SimpleSokoban", ROWS, TURNS, RESPONSE, "float32",
    )  # fmt: skip
    assert report["machine"]["jax_platform"] == "cpu" and report["date"]
    (row,) = report["results"]
    assert (row["model"], row["weights"]) == ("tiny-random", "random")
    assert "roofline" not in row  # only on a GPU with a known bandwidth


@pytest.mark.parametrize("mode", bench_rollout.MODES)
def test_both_modes_play_the_fixed_workload_of_a_random_model(report, mode):
    (row,) = report["results"]
    m = row[mode]
    assert METRICS <= m.keys()
    # a random model never stops and never names an action: every row plays every turn in full
    assert m["turns_played"] == ROWS * TURNS
    assert m["generated_tokens"] == ROWS * TURNS * RESPONSE
    assert m["env_steps"] == 0 and m["env_steps_per_s"] == 0
    assert m["compile_s"] > 0 and m["wall_s"] > 0 and len(m["run_s"]) == 1
    assert m["tokens_per_s"] == pytest.approx(m["generated_tokens"] / m["wall_s"])


def test_speedup_compares_token_rates(report):
    (row,) = report["results"]
    assert row["speedup"] == pytest.approx(row["compiled"]["tokens_per_s"] / row["baseline"]["tokens_per_s"])
    assert row["identical_episode_rows"] == 1.0
    # prompt widths are padded to the bucket, so generate compiles at most once per turn
    buckets = row["baseline"]["prompt_buckets"]
    assert 1 <= len(buckets) <= TURNS and all(width % 256 == 0 for width in buckets)


def test_baseline_episode_follows_ragen_turn_semantics():
    """Seed 10001 is solved by Right, Up, Left (ragen-reference.md §1.6); the host turn must run valid actions in
    order, drop unknown names, stop at the solve, and record RAGEN's reward text."""
    import envs_jax
    from starpo_jax.rollout.multi_turn import RolloutPlan, TagPlan

    env = envs_jax.make("SimpleSokoban")
    plan = RolloutPlan(tags=(TagPlan("SimpleSokoban", env, 1, 10),), group_size=1, max_turn=3)
    host = rollout_timing.HostEnv.of(env)
    state = env.reset_from_seed(10001)
    history = [{"state": host.render(state), "actions_left": 10}]
    episode = rollout_timing.HostEpisode(env, state, env.action_names, 10, history)
    rollout_timing.host_turn(episode, host, "go</think><answer>Right || Jump</answer>", plan)
    assert (episode.num_actions, episode.num_turns, episode.done) == (1, 1, False)
    assert episode.history[0]["llm_response"] == "<think>go</think><answer>Right || Jump</answer>"
    rollout_timing.host_turn(episode, host, "ok</think><answer>Up || Left || Down</answer>", plan)
    assert episode.done and episode.success and episode.num_actions == 3  # Down is never executed
    np.testing.assert_allclose(episode.history[1]["reward"], -0.1 + 10.9, atol=1e-9)
    assert episode.history[2]["actions_left"] == 7


def test_roofline_counts_decode_steps_and_context_reads():
    from types import SimpleNamespace

    from flax import nnx

    import envs_jax
    from starpo_jax.models import Decoder, ModelState, preset
    from starpo_jax.rollout.multi_turn import RolloutPlan, TagPlan

    subject = rollout_timing.Subject("tiny", ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0))), None, "")
    # row 0 generates positions 3, 4, 5 (turn 1) and 8 (turn 2); row 1 generates position 3, then stops playing
    loss_mask = np.zeros((2, 10), bool)
    loss_mask[0, [3, 4, 5, 8]] = loss_mask[1, 3] = True
    traj = SimpleNamespace(
        turn_played=np.array([[True, True], [True, False]]),
        turn_start=np.array([[3, 8], [3, 0]]),
        turn_end=np.array([[6, 9], [4, 0]]),
        loss_mask=loss_mask,
        response_tokens=np.array([4, 1]),
    )
    plan = RolloutPlan(tags=(TagPlan("Bandit", envs_jax.make("Bandit"), 1, 1),), group_size=2, max_len=10)  # 2 rows
    r = rollout_timing.decode_roofline(traj, subject, plan, wall_s=2.0, bandwidth=1e9)
    weights = subject.num_params * 4  # float32
    kv = 2 * 3 * 1 * 16 * 4  # K and V, 3 layers, 1 kv head, 16 dims, float32
    assert (r["decode_steps"], r["kv_token_reads"], r["weight_bytes"]) == (3 + 1, 3 + 4 + 5 + 8 + 3, weights)
    assert r["ideal_s"] == pytest.approx((4 * weights + 23 * kv) / 1e9)
    assert r["fraction"] == pytest.approx(r["ideal_s"] / 2.0)
    assert r["fraction_full_cache"] == pytest.approx(4 * (weights + 2 * 10 * kv) / 1e9 / 2.0)
    assert r["ceiling_tokens_per_s"] == pytest.approx(5 / r["ideal_s"])


def test_unknown_model_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        bench_rollout.parse_args(["--models", "gpt-9"])
    assert "unknown model 'gpt-9'" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ("--env NoSuchEnv", "unknown env 'NoSuchEnv' in --env"),
    ("--groups 0", "--groups must be a positive whole number, not 0"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, capsys):
    assert_refused_in_one_line(bench_rollout.parse_args, argv, message, capsys)
