"""RAGEN's per-tag rollout metrics; the collapse watch needs 5 steps of history, as the README says."""

from types import SimpleNamespace
from typing import cast

import jax.numpy as jnp
import pytest

import envs_jax
from starpo_jax.diagnostics.collapse import CollapseWatch
from starpo_jax.diagnostics.metrics import rollout_metrics
from starpo_jax.rollout.multi_turn import RolloutPlan, TagPlan, Trajectories

HEALTHY = {"rollout/in_group_std": 1.0, "actor/entropy_loss": 1.0, "actor/grad_norm": 1.0}
COLLAPSED = {"rollout/in_group_std": 0.01, "actor/entropy_loss": 0.01, "actor/grad_norm": 1.0}


def test_collapse_warning_needs_five_steps_of_history():
    watch = CollapseWatch()
    for _ in range(4):
        assert watch.update(HEALTHY) == []
    assert watch.update(COLLAPSED) == []  # step 5: only 4 steps of history
    watch = CollapseWatch()
    for _ in range(5):
        watch.update(HEALTHY)
    assert any("Echo Trap" in w for w in watch.update(COLLAPSED))  # step 6


def test_collapse_warning_when_the_answers_stop_reading_the_board():
    """The mutual information of answer and board, logged every few steps, falling below 0.3x its
    median so far (two values at least): template collapse, whatever entropy does."""
    watch = CollapseWatch()
    assert watch.update(HEALTHY | {"train/A/mi": 0.8, "train/B/mi": 0.6}) == []
    assert watch.update(HEALTHY) == []  # a step without the figure
    assert watch.update(HEALTHY | {"train/A/mi": 0.1}) == []  # one earlier value only
    watch = CollapseWatch()
    for mi in (0.7, 0.6, 0.8):
        assert watch.update(HEALTHY | {"train/A/mi": mi}) == []
    assert watch.update(HEALTHY | {"train/A/mi": 0.25}) == []  # 0.36x the median 0.7
    warnings = watch.update(HEALTHY | {"train/A/mi": 0.1})
    assert len(warnings) == 1 and "template collapse" in warnings[0]


def test_rollout_metrics_per_tag_and_over_the_batch():
    """Two tags, 2 groups of 2 rows each: means per tag, non-zero means, pass@2 per group, totals."""
    bandit = envs_jax.make("Bandit")  # the tags' env is not read
    plan = RolloutPlan(tags=(TagPlan("A", bandit, 1, 5), TagPlan("B", bandit, 1, 5)), group_size=2)
    f = lambda *v: jnp.asarray(v, jnp.float32)  # noqa: E731
    traj = cast(Trajectories, SimpleNamespace(  # only the fields the metrics read
        success=jnp.asarray([False, True, False, False]), num_actions=jnp.asarray([2, 4, 0, 1]),
        action_is_effective=f(0.5, 1.0, 0.0, 0.0), action_is_valid=f(1.0, 1.0, 0.0, 1.0),
        response_tokens=jnp.asarray([10, 20, 30, 40]), think_tokens=jnp.asarray([1, 2, 3, 6]),
        env_reward=f(0.0, 1.0, 0.0, 0.0), format_penalty_sum=f(0.0, 0.0, -0.1, -0.1), num_turns=jnp.asarray([1, 2, 3, 2]),
        context_exhausted=jnp.asarray([False, False, True, False]),
        group_id=jnp.asarray([0, 0, 1, 1]), tag_id=jnp.asarray([0, 0, 1, 1]),
    ))
    m = {k: float(v) for k, v in rollout_metrics(traj, plan, "val").items()}
    assert (m["val/A/success"], m["val/B/success"]) == (0.5, 0.0)
    assert (m["val/A/pass@2"], m["val/B/pass@2"]) == (1.0, 0.0)
    assert (m["val/A/num_actions"], m["val/B/num_actions"], m["val/B/non-zero/num_actions"]) == (3.0, 0.5, 1.0)
    assert (m["val/A/action_is_effective"], m["val/A/non-zero/action_is_effective"]) == (0.75, 0.75)
    assert m["val/B/action_is_valid"] == 0.5 and m["val/B/non-zero/action_is_valid"] == 1.0
    assert m["val/reward/mean"] == pytest.approx(0.2) and m["val/reward/std"] == pytest.approx(float(jnp.std(f(0, 1, -0.1, -0.1))))
    assert (m["val/response_length"], m["val/think_length"], m["val/num_turns"]) == (25.0, 3.0, 2.0)
    assert (m["val/context_exhausted"], m["val/generated_tokens"], m["val/env_steps"]) == (0.25, 100.0, 7.0)


def test_tensorboard_events_are_written_without_importing_torch(tmp_path):
    """A run's TensorBoard writer leaves torch unimported (seconds of every start where torch is
    installed), writes the exact metric names, and torch still imports afterwards."""
    import subprocess
    import sys

    from helpers import REPO, command_env, tensorboard_scalars

    script = f"""
import sys
from starpo_jax.diagnostics.tensorboard import summary_writer, write_scalars
with summary_writer({str(tmp_path / "tb")!r}) as board:
    write_scalars(board, {{"train/Bandit/pass@2": 0.5}}, 1)
assert "torch" not in sys.modules
import torch
"""
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, env=command_env())
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert tensorboard_scalars(tmp_path) == {"train/Bandit/pass@2": [(1, 0.5)]}
