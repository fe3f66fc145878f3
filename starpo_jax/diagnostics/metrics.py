"""RAGEN's per-tag rollout metrics, in jit, for training, validation and ``evaluate``."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from starpo_jax.algo.masked import masked_mean
from starpo_jax.rollout.multi_turn import RolloutPlan, Trajectories


def rollout_metrics(traj: Trajectories, plan: RolloutPlan, prefix: str) -> dict[str, jax.Array]:
    """RAGEN's per-tag env metrics (ragen-reference.md §2.2, §4), computed over every trajectory."""
    metrics = {}
    group_success = jax.ops.segment_max(traj.success.astype(jnp.float32), traj.group_id, plan.num_groups)
    group_tag = traj.tag_id[jnp.arange(plan.num_groups) * plan.group_size]
    for i, tag in enumerate(plan.tags):
        rows = traj.tag_id == i
        per_env = {
            "success": traj.success.astype(jnp.float32),
            "num_actions": traj.num_actions.astype(jnp.float32),
            "action_is_effective": traj.action_is_effective,
            "action_is_valid": traj.action_is_valid,
        }
        for name, value in per_env.items():
            metrics[f"{prefix}/{tag.name}/{name}"] = masked_mean(value, rows)
            metrics[f"{prefix}/{tag.name}/non-zero/{name}"] = masked_mean(value, rows & (value != 0))
        metrics[f"{prefix}/{tag.name}/pass@{plan.group_size}"] = masked_mean(group_success, group_tag == i)
    everything = jnp.ones_like(traj.success)
    metrics[f"{prefix}/response_length"] = traj.response_tokens.astype(jnp.float32).mean()
    metrics[f"{prefix}/think_length"] = traj.think_tokens.astype(jnp.float32).mean()
    metrics[f"{prefix}/reward/mean"] = masked_mean(traj.env_reward + traj.format_penalty_sum, everything)
    metrics[f"{prefix}/reward/std"] = jnp.std(traj.env_reward + traj.format_penalty_sum)
    metrics[f"{prefix}/num_turns"] = traj.num_turns.astype(jnp.float32).mean()
    metrics[f"{prefix}/context_exhausted"] = traj.context_exhausted.astype(jnp.float32).mean()
    metrics[f"{prefix}/generated_tokens"] = traj.response_tokens.sum().astype(jnp.float32)
    metrics[f"{prefix}/env_steps"] = traj.num_actions.sum().astype(jnp.float32)
    return metrics


# Validation and evaluation call it outside the iteration: as one program, where op by op it
# compiled (or loaded from the cache) a dozen small programs in every process.
jitted_rollout_metrics = jax.jit(rollout_metrics, static_argnums=(1, 2))
