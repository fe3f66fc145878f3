"""Train several hyperparameter settings at once: one program, ``jax.vmap`` over the settings.

    python -m experiments.sweep --config configs/quickstart.py \\
        --sweep actor.lr=1e-6,3e-6 --sweep actor.clip_ratio_high=0.2,0.28

Every combination of the ``--sweep`` values (a grid) trains side by side from the same initial
weights and the same levels, so differences come from the hyperparameters alone. Sweepable keys
are those that enter the compiled step as arrays (``SWEEPABLE``); anything else changes the
program and needs separate runs. Metrics go to ``<output_dir>/sweep.jsonl``, one line per setting
and step, and a summary table is printed at the end. Sweeps keep no checkpoints.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

from absl import app, flags
from ml_collections import config_flags

# config key -> Hyperparams field
SWEEPABLE = {
    "actor.lr": "actor_lr",
    "critic.lr": "critic_lr",
    "lora.actor_lr": "actor_lr",  # the learning rates when lora.rank > 0
    "lora.critic_lr": "critic_lr",
    "actor.clip_ratio_low": "clip_ratio_low",
    "actor.clip_ratio_high": "clip_ratio_high",
    "actor.clip_ratio_c": "clip_ratio_c",
    "actor.entropy_coeff": "entropy_coeff",
    "actor.kl_loss_coef": "kl_loss_coef",
    "algorithm.kl_in_reward_coef": "kl_in_reward_coef",
    "filter.ratio": "filter_ratio",
    "algorithm.gamma": "gamma",
    "algorithm.lam": "lam",
    "algorithm.high_level_gamma": "high_level_gamma",
}

_CONFIG = config_flags.DEFINE_config_file("config", "configs/quickstart.py", "Config file (configs/*.py[:preset]).")
flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,... (repeatable); keys: " + ", ".join(SWEEPABLE))
FLAGS = flags.FLAGS


def parse_sweeps(specs: list[str]) -> dict[str, list[float]]:
    sweeps = {}
    for spec in specs:
        key, _, values = spec.partition("=")
        if key not in SWEEPABLE:
            raise ValueError(f"--sweep {key!r} cannot be swept in one program; sweepable keys: {', '.join(SWEEPABLE)}.")
        try:
            sweeps[key] = [float(v) for v in values.split(",") if v]
        except ValueError as err:
            raise ValueError(f"--sweep {spec!r}: values must be numbers separated by commas.") from err
        if not sweeps[key]:
            raise ValueError(f"--sweep {spec!r} gives no values.")
    if not sweeps:
        raise ValueError("Give at least one --sweep KEY=V1,V2.")
    return sweeps


_LORA_LRS = {"actor.lr": "lora.actor_lr", "critic.lr": "lora.critic_lr"}  # full fine-tuning -> LoRA


def check_lora_keys(sweeps: dict[str, list[float]], lora_rank: int) -> None:
    """Sweeping a learning rate the run does not use would silently change nothing."""
    for full, lora in _LORA_LRS.items():
        unused, used = (full, lora) if lora_rank > 0 else (lora, full)
        if unused in sweeps:
            raise ValueError(f"--sweep {unused} has no effect with lora.rank={lora_rank}; sweep {used} instead.")


def grid(sweeps: dict[str, list[float]]) -> list[dict[str, float]]:
    keys = list(sweeps)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sweeps[k] for k in keys))]


def main(argv) -> int:
    del argv
    from absl import logging

    logging.set_verbosity(logging.WARNING)
    from starpo_jax import sharding
    from starpo_jax.experiment import ConfigError, build_experiment
    from starpo_jax.models.loading import ModelLoadError

    cfg = _CONFIG.value
    try:
        sweeps = parse_sweeps(FLAGS.sweep)
        check_lora_keys(sweeps, cfg.lora.rank)
        settings_grid = grid(sweeps)
        if "filter.ratio" in settings_grid[0]:  # room for the largest kept batch
            cfg.filter.ratio = max(s["filter.ratio"] for s in settings_grid)
        exp = build_experiment(cfg)
    except (ValueError, ConfigError, ModelLoadError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    with sharding.use_mesh(exp.mesh):
        return sweep(exp, settings_grid)


def sweep(exp, settings_grid: list[dict[str, float]]) -> int:
    """Train every setting of the grid side by side (inside the experiment's mesh)."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    from starpo_jax import sharding
    from starpo_jax.train import init_train_state, make_train_step, replicate

    cfg = exp.config
    n = len(settings_grid)
    hyper = exp.hyper
    hyper = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,)), hyper)
    for key in settings_grid[0]:
        hyper = hyper.replace(**{SWEEPABLE[key]: jnp.asarray([s[key] for s in settings_grid], jnp.float32)})
    state = sharding.shard(init_train_state(exp.settings, exp.model, jax.random.PRNGKey(cfg.trainer.seed)), exp.mesh)
    states, state_axes = replicate(state, n)
    step = make_train_step(exp.settings, exp.model.graphdef, exp.train_plan)
    sweep_step = jax.jit(
        jax.vmap(step, in_axes=(state_axes, None, 0, None), out_axes=(state_axes, 0)), donate_argnums=0
    )
    key = jax.random.PRNGKey(cfg.trainer.seed)

    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "sweep.jsonl"
    last = [{} for _ in range(n)]
    with log_path.open("w") as f:
        for t in tqdm(range(cfg.trainer.total_steps), desc=f"sweep x{n}", unit="step"):
            states, metrics = sweep_step(states, exp.train_tables, hyper, key)
            metrics = jax.device_get(metrics)
            for i, setting in enumerate(settings_grid):
                last[i] = {k: float(v[i]) for k, v in metrics.items()}
                f.write(json.dumps({"step": t + 1, "setting": setting, **last[i]}) + "\n")
    shown = [k for k in ("train/reward/mean", "rollout/in_group_std", "actor/entropy_loss") if k in last[0]]
    print(" | ".join(list(settings_grid[0]) + shown))
    for setting, m in zip(settings_grid, last):
        print(" | ".join([f"{v:g}" for v in setting.values()] + [f"{m[k]:.4f}" for k in shown]))
    print(f"wrote {log_path}")
    return 0


if __name__ == "__main__":
    app.run(lambda argv: sys.exit(main(argv)))
