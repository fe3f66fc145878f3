import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs_jax
from envs_jax.countdown_score import ragen_check_format, ragen_score
from experiments.bench import envs as bench_envs
from helpers import assert_refused_in_one_line, command_env

REPO = Path(__file__).resolve().parents[1]


def test_quick_run_writes_a_complete_report(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench_envs.main(
        ["--quick", "--envs", "Bandit,FrozenLake", "--batch-sizes", "3", "--max-steps", "8",
         "--observe", "--out", str(out)]
    )
    report = json.loads(out.read_text())
    assert set(report) == {"meta", "numpy", "results"}
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the table as a chart, beside the JSON
    assert report["meta"]["jax_platform"] == jax.default_backend()
    for name in ("Bandit", "FrozenLake"):
        assert set(report["numpy"][name]) == {"step", "reset"}
        assert all(rate > 0 for rate in report["numpy"][name].values())
    rows = {(r["env"], r["batch"], r["mode"]): r for r in report["results"]}
    assert set(rows) == {(e, 3, m) for e in ("Bandit", "FrozenLake") for m in ("step", "reset")}
    for (name, _, mode), r in rows.items():
        assert r["steps_per_s"] > 0 and r["compile_s"] > 0 and 2 <= r["num_steps"] <= 8
        assert r["devices"] == 1 and r["cpu_per_wall"] > 0
        assert r["speedup_vs_numpy"] == pytest.approx(r["steps_per_s"] / report["numpy"][name][mode])
        assert 0 < r["active_share"] <= 1
    # Step mode restarts finished rows; Bandit's reset capacity is the whole batch: nobody waits.
    assert rows[("FrozenLake", 3, "step")]["active_share"] == 1
    assert rows[("Bandit", 3, "reset")]["active_share"] == 1
    assert "steps/s" in capsys.readouterr().out


def test_reset_capacity_limits_fresh_levels_and_serves_waiting_rows_first():
    # Every Bandit episode ends after one step: with 2 fresh levels per step for 6 rows, 2 rows are
    # live per step after the first, and every row gets its turn.
    env = envs_jax.make("Bandit")
    batch, steps = 6, 5
    first, _ = jax.vmap(env.reset)(jax.random.split(jax.random.PRNGKey(0), batch))
    loop = bench_envs.make_loop(env, batch, reset_capacity=2)
    nobody = jnp.zeros((batch,), bool)
    _, waiting, counted, _ = loop(first, first, nobody, jax.random.PRNGKey(1), steps)
    assert int(counted) == batch + 2 * (steps - 1)
    assert int(waiting.sum()) == batch - 2
    # Waiting rows are served before newly finished ones: rows 0-1 at step 1, then 2-3, ...
    _, waiting, _, _ = loop(first, first, nobody, jax.random.PRNGKey(1), 1)
    np.testing.assert_array_equal(np.asarray(waiting), [False, False, True, True, True, True])
    _, waiting, _, _ = loop(first, first, waiting, jax.random.PRNGKey(2), 1)
    np.testing.assert_array_equal(np.asarray(waiting), [True, True, False, False, True, True])


def test_random_actions_are_uniform_and_differ_by_step_and_key():
    key, batch = jax.random.PRNGKey(0), 1 << 14
    actions = np.asarray(bench_envs.random_actions(key, 0, batch, 4))
    assert actions.min() == 0 and actions.max() == 3
    shares = np.bincount(actions, minlength=4) / batch
    assert np.all(np.abs(shares - 0.25) < 5 * np.sqrt(0.25 * 0.75 / batch))
    next_step = np.asarray(bench_envs.random_actions(key, 1, batch, 4))
    other_key = np.asarray(bench_envs.random_actions(jax.random.PRNGKey(1), 0, batch, 4))
    for other in (next_step, other_key):
        assert abs(np.mean(actions == other) - 0.25) < 0.02  # independent, not shifted copies
    np.testing.assert_array_equal(actions, bench_envs.random_actions(key, 0, batch, 4))


@pytest.mark.parametrize("observe", [False, True])
def test_checksum_counts_every_output_of_each_row(observe):
    env = envs_jax.make("SimpleSokoban")
    states = jax.tree.map(lambda *x: jnp.stack(x), *(env.reset_from_seed(s) for s in range(3)))
    _, ts = jax.vmap(env.step)(states, jnp.array([0, 1, 2]))
    outputs = jax.tree.leaves((ts.reward, ts.observation if observe else (), ts.extras))
    expected = sum(np.asarray(x, np.float64).reshape(3, -1).sum(axis=1) for x in outputs)
    np.testing.assert_allclose(bench_envs.checksum(ts, 3, observe), expected, rtol=1e-6)
    bumped = ts.replace(observation=ts.observation.at[2, 5, 5].add(1))
    np.testing.assert_allclose(
        bench_envs.checksum(bumped, 3, observe), expected + [0, 0, observe], rtol=1e-6
    )
    flagged = ts.replace(extras={**ts.extras, "success": ts.extras["success"].at[0].set(True)})
    gained = 1 - float(ts.extras["success"][0])
    np.testing.assert_allclose(
        bench_envs.checksum(flagged, 3, observe), expected + [gained, 0, 0], rtol=1e-6
    )


def test_numpy_baselines_follow_the_rules():
    rng = np.random.default_rng(0)
    frozen = bench_envs.NumpyFrozenLake(envs_jax.make("FrozenLake"))
    frozen.reset(rng)
    rows = ["".join(r) for r in frozen.desc]
    assert sum(r.count("S") for r in rows) == 1 and sum(r.count("G") for r in rows) == 1
    bandit = bench_envs.NumpyBandit(envs_jax.make("Bandit"))
    rewards = []
    for _ in range(4000):
        bandit.reset(rng)
        rewards.append(bandit.step(0 if bandit.hi_first else 1, rng)[0])
    assert abs(np.mean(rewards) - 0.25) < 5 * np.sqrt(0.25 * 0.75 / 4000)


def test_countdown_answers_use_the_tasks_numbers_and_score_as_ragens_python():
    """The JAX loop's random answers and the Python baseline's are of one kind: the task's numbers
    joined by operators, a quarter with a stray byte; the env scores them as RAGEN's code does."""
    env = envs_jax.make("Countdown")
    states, _ = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(0), 128))
    data, length = jax.jit(bench_envs.random_expressions, static_argnums=3)(
        jax.random.PRNGKey(1), 0, states, env.answer_width)
    _, ts = jax.jit(jax.vmap(env.step))(states, (data, length))
    texts = [bytes(np.asarray(d[:n])).decode() for d, n in zip(data, length)]
    tasks = [(np.asarray(n)[:c].tolist(), int(t)) for n, c, t in zip(states.nums, states.num_count, states.target)]
    np.testing.assert_allclose(ts.reward, [ragen_score(text, *task) for text, task in zip(texts, tasks)])
    rng = np.random.default_rng(0)
    baseline = bench_envs.PythonCountdown(env)
    python_texts, python_tasks = [], []
    for _ in range(128):
        baseline.reset(rng)
        python_texts.append(baseline.random_action(rng))
        python_tasks.append((baseline.nums, baseline.target))
    for texts, tasks in ((texts, tasks), (python_texts, python_tasks)):
        # Exactly the task's numbers unless a stray byte broke one (at most 1 row in 4, ± 5 sigma).
        right_numbers = np.mean([ragen_check_format(text, nums) for text, (nums, _) in zip(texts, tasks)])
        assert 0.75 - 5 * np.sqrt(0.75 * 0.25 / 128) < right_numbers < 1
        assert all(re.fullmatch(r"[ -~]+", text) for text in texts)  # printable ASCII


def test_countdown_quick_run():
    report = bench_envs.run(bench_envs.parse_args(
        ["--quick", "--envs", "Countdown", "--batch-sizes", "2", "--modes", "step", "--max-steps", "4"]
    ))
    (row,) = report["results"]
    assert row["env"] == "Countdown" and row["steps_per_s"] > 0 and row["active_share"] == 1
    assert report["numpy"]["Countdown"]["step"] > 0


def test_cli_rejects_unknown_env():
    with pytest.raises(SystemExit):
        bench_envs.parse_args(["--envs", "Chess"])


def test_cpu_devices_split_the_batch(tmp_path):
    """Two host devices (a fresh process: JAX's device count is fixed at start): batches that split
    evenly run on both devices, odd ones on one; every row-step is still counted once."""
    out = tmp_path / "bench.json"
    subprocess.run(  # the devices as the README's command asks for them (not through XLA_FLAGS)
        [sys.executable, "-m", "experiments.bench.envs", "--quick",
         "--envs", "FrozenLake,SimpleSokoban", "--batch-sizes", "3,4", "--max-steps", "8",
         "--out", str(out)],
        cwd=REPO, env=command_env(JAX_NUM_CPU_DEVICES="2"), check=True, capture_output=True,
    )
    rows = {(r["env"], r["batch"], r["mode"]): r for r in json.loads(out.read_text())["results"]}
    for (name, batch, mode), r in rows.items():
        assert r["devices"] == (2 if batch == 4 else 1)
        if mode == "step":
            assert r["active_share"] == 1
        else:  # one fresh level per device and step at these tiny batches
            assert r["reset_capacity"] == 1 and 0 < r["active_share"] <= 1


@pytest.mark.parametrize("argv, message", [
    ("--seconds -1", "--seconds must be positive, not -1.0"),
])
def test_bad_input_is_one_line_before_anything_loads(argv, message, capsys):
    assert_refused_in_one_line(bench_envs.parse_args, argv, message, capsys)
