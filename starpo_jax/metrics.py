"""Metrics: RAGEN's per-tag rollout metrics (in jit, for training, validation and ``evaluate``),
and host-side helpers: the collapse watch ("Echo Trap", paper §4) and TensorBoard scalars."""

from __future__ import annotations

import dataclasses
import statistics

import jax
import jax.numpy as jnp

from starpo_jax.masked import masked_mean
from starpo_jax.rollout import RolloutPlan, Trajectories


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


@dataclasses.dataclass
class CollapseWatch:
    """Warns when training shows the paper's collapse signs, judged against the medians of the last
    ``window`` steps once ``window // 2`` are recorded (so never in a run's first 5 steps):

    - reward std and entropy both fall below ``drop`` times their recent median (the rollouts of a
      prompt stop disagreeing and the policy stops exploring: the Echo Trap), or
    - the gradient norm spikes above ``spike`` times its recent median.
    """

    window: int = 10
    drop: float = 0.3
    spike: float = 5.0
    history: dict = dataclasses.field(default_factory=dict)

    KEYS = {"std": "rollout/in_group_std", "entropy": "actor/entropy_loss", "grad": "actor/grad_norm"}

    def update(self, metrics: dict) -> list[str]:
        """Record this step's metrics; return warnings (empty when all is well)."""
        warnings = []
        recent = {k: list(self.history.get(k, [])) for k in self.KEYS}
        now = {k: float(metrics[name]) for k, name in self.KEYS.items() if name in metrics}
        if all(len(recent[k]) >= self.window // 2 for k in now):
            med = {k: statistics.median(recent[k]) for k in now}
            if "std" in now and "entropy" in now and med["std"] > 0 and med["entropy"] > 0:
                if now["std"] < self.drop * med["std"] and now["entropy"] < self.drop * med["entropy"]:
                    warnings.append(
                        f"reward std ({now['std']:.3g}) and entropy ({now['entropy']:.3g}) fell below "
                        f"{self.drop:g}x their recent medians: possible collapse (Echo Trap)"
                    )
            if "grad" in now and med["grad"] > 0 and now["grad"] > self.spike * med["grad"]:
                warnings.append(f"gradient norm spiked to {now['grad']:.3g} ({now['grad'] / med['grad']:.1f}x its recent median)")
        for k, v in now.items():
            self.history[k] = (list(self.history.get(k, [])) + [v])[-self.window :]
        return warnings

    def state(self) -> dict:
        return {"history": self.history}

    @classmethod
    def from_state(cls, state: dict, **kwargs) -> "CollapseWatch":
        return cls(history={k: list(v) for k, v in state.get("history", {}).items()}, **kwargs)


def _tensorboardx():
    """tensorboardX, imported without torch: where torch is installed, tensorboardX's writer imports
    it only to accept torch tensors, which a run never logs, and that import was ~2 s of every run's
    start (measured 2026-11-27 on the 2-core CPU: 2.36 s against 0.11 s)."""
    import sys

    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX

        return tensorboardX
    sys.modules["torch"] = None  # ``import torch`` raises ImportError while tensorboardX loads
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


def summary_writer(folder, purge_step=None):
    """A TensorBoard writer into ``folder``; ``purge_step`` drops the events logged from that step on
    (those a killed run logged after its last checkpoint)."""
    return _tensorboardx().SummaryWriter(str(folder), purge_step=purge_step)


def write_scalars(writer, metrics: dict, step: int) -> None:
    """One TensorBoard event holding every metric of a step, under the exact names of
    ``metrics.jsonl`` (tensorboardX's ``add_scalar`` would rename ``pass@4`` to ``pass_4``)."""
    _tensorboardx()
    from tensorboardX.proto.summary_pb2 import Summary

    values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
    writer.file_writer.add_summary(Summary(value=values), step)
