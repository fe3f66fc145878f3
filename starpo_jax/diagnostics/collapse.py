"""The collapse watch: warnings when training shows the paper's collapse signs (the "Echo Trap",
whose indicators the paper plots in Fig. 6), judged on the host from each step's metrics."""

from __future__ import annotations

import dataclasses
import statistics


@dataclasses.dataclass
class CollapseWatch:
    """Warns when training shows the paper's collapse signs, judged against the medians of the last
    ``window`` steps once ``window // 2`` are recorded (so never in a run's first 5 steps):

    - reward std and entropy both fall below ``drop`` times their recent median (the rollouts of a
      prompt stop disagreeing and the policy stops exploring: the Echo Trap), or
    - the gradient norm spikes above ``spike`` times its recent median, or
    - the mutual information of answer and board (``train/<tag>/mi``, measured every few steps,
      mean over the env tags) falls below ``drop`` times the median of its earlier values, two at
      least: the answers stop depending on the board (template collapse, RAGEN-2).
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
        mi = [float(v) for name, v in metrics.items() if name.startswith("train/") and name.endswith("/mi")]
        if mi:
            now["mi"] = sum(mi) / len(mi)
            earlier = self.history.get("mi", [])
            if len(earlier) >= 2 and statistics.median(earlier) > 0 and now["mi"] < self.drop * statistics.median(earlier):
                warnings.append(
                    f"the answers' mutual information with the board fell to {now['mi']:.3g} "
                    f"({now['mi'] / statistics.median(earlier):.2f}x its median so far): possible template collapse"
                )
        for k, v in now.items():
            self.history[k] = (list(self.history.get(k, [])) + [v])[-self.window :]
        return warnings

    def state(self) -> dict:
        return {"history": self.history}

    @classmethod
    def from_state(cls, state: dict, **kwargs) -> "CollapseWatch":
        return cls(history={k: list(v) for k, v in state.get("history", {}).items()}, **kwargs)
