"""Train several hyperparameter settings at once: ``jax.vmap`` over the settings.

    python -m experiments.sweep --config configs/quickstart.py \\
        --sweep actor.lr=1e-6,3e-6 --sweep actor.clip_ratio_high=0.2,0.28

Every combination of the ``--sweep`` values (a grid) trains side by side from the same initial
weights and the same levels, so differences come from the hyperparameters alone. Each step runs
as ``experiments.run``'s does (``train.jit_iteration``): the rollout vmapped over the settings,
then one layout picked on the host that holds every setting's rows, then the update vmapped with
it, so the update computes only what the batch holds (a few compiled widths per sweep). Before
anything runs, the rollout and the largest update (``planning.planned_layout``) are compiled from abstract
shapes and XLA's memory estimate decides how many settings train at a time: all of them if they
fit in the free memory (a fifth kept spare), else as many as fit, group after group (the same
results, in more time); if one setting does not fit, the sweep stops with one sentence naming
what to reduce. Sweepable keys are those that enter the compiled step as arrays (``SWEEPABLE``:
the ``Hyperparams`` rows of ``starpo_jax/runtime/settings.py``); anything else changes the program and
needs separate runs. Before the model loads, the sweep checks what ``experiments.run`` checks: the
config, the ``distributed`` settings against the runtime started, and that one setting fits
(``planning.check_fits``). Metrics go to ``<output_dir>/sweep.jsonl``, one line per setting and step,
and a summary table is printed at the end; an earlier sweep's log in that folder is kept (the
sweep refuses to start) unless ``--config.trainer.overwrite=True``. Sweeps keep no checkpoints.
"""

from __future__ import annotations

from experiments import bootstrap

if __name__ == "__main__":  # first: joins a multi-host run before the imports below start XLA's backend
    bootstrap.command("experiments.sweep")

import itertools
import json
import sys
from pathlib import Path
from typing import Any, Callable, NamedTuple, cast

import jax
import jax.numpy as jnp
from absl import flags, logging
from tqdm import tqdm

from experiments import cli
from starpo_jax.models.loading import ModelLoadError
from starpo_jax.runtime import distributed, sharding
from starpo_jax.runtime.caches import setup_compilation_cache
from starpo_jax.runtime.experiment import ConfigError, build_experiment, check_config
from starpo_jax.runtime.planning import PlanError, check_fits, free_bytes_per_device, planned_layout, program_peak_bytes
from starpo_jax.runtime.settings import BY_KEY, LORA_LEARNING_RATES, SWEEPABLE  # config key -> Hyperparams field
from starpo_jax.train import init_train_state, jit_iteration, make_train_step, replicate

_CONFIG = cli.define_config_flag()
flags.DEFINE_multi_string("sweep", [], "KEY=V1,V2,... (repeatable); keys (default): " + ", ".join(
    f"{key} ({BY_KEY[key].default:g})" for key in SWEEPABLE))
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
        try:  # each value as the config would check it, not only the one set there
            for value in sweeps[key]:
                BY_KEY[key].check(BY_KEY[key].cast(value))
        except ValueError as err:
            raise ValueError(f"--sweep {spec!r}: {err}") from None
    if not sweeps:
        raise ValueError("Give at least one --sweep KEY=V1,V2.")
    return sweeps


def check_lora_keys(sweeps: dict[str, list[float]], lora_rank: int) -> None:
    """Sweeping a learning rate the run does not use would silently change nothing."""
    for full, lora in LORA_LEARNING_RATES.items():
        unused, used = (full, lora) if lora_rank > 0 else (lora, full)
        if unused in sweeps:
            raise ValueError(f"--sweep {unused} has no effect with lora.rank={lora_rank}; sweep {used} instead.")


def grid(sweeps: dict[str, list[float]]) -> list[dict[str, float]]:
    keys = list(sweeps)
    return [dict(zip(keys, combo)) for combo in itertools.product(*(sweeps[k] for k in keys))]


def check_sweep_log(out: Path, overwrite: bool) -> None:
    """A sweep never replaces an earlier sweep's log unless asked to (``trainer.overwrite``)."""
    if (out / "sweep.jsonl").exists() and not overwrite:
        raise ConfigError(
            f"{out} holds an earlier sweep (sweep.jsonl); choose a new --config.trainer.output_dir, or replace "
            "it with --config.trainer.overwrite=True."
        )


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)
    setup_compilation_cache()  # before the first compile

    cfg = _CONFIG.value
    if not cli.runtime_agrees(cfg):
        return 2
    try:  # the run's checks before loading (experiments.run): a mistake costs a second, not a model load
        sweeps = parse_sweeps(FLAGS.sweep)
        check_lora_keys(sweeps, cfg.lora.rank)
        if cfg.trainer.staleness:  # its loop samples and updates in turn, every setting at once
            raise ConfigError("experiments.sweep samples each batch before its update: trainer.staleness=1 (and "
                              "mesh.rollout_devices) are for experiments.run; set trainer.staleness=0 to sweep.")
        settings_grid = grid(sweeps)
        if "filter.ratio" in settings_grid[0]:  # room for the largest kept batch
            cfg.filter.ratio = max(s["filter.ratio"] for s in settings_grid)
        checked = check_config(cfg)
        check_sweep_log(Path(cfg.trainer.output_dir), cfg.trainer.overwrite)
        check_fits(checked)  # one setting must fit; how many train at once is decided once loaded
        exp = build_experiment(checked)
    except (ValueError, ConfigError, ModelLoadError, FileNotFoundError, PlanError) as err:
        print(f"{distributed.tag()}error: {err}", file=sys.stderr)
        return 2
    with sharding.use_mesh(exp.mesh):
        return sweep(exp, settings_grid)


def sweep(exp, settings_grid: list[dict[str, float]]) -> int:
    """Train every setting of the grid side by side (inside the experiment's mesh), as many at a
    time as the memory holds: the compiled program's own estimate decides, before anything runs."""
    cfg = exp.config
    n = len(settings_grid)
    state = sharding.shard(init_train_state(exp.settings, exp.model, exp.seed_key()), exp.mesh)
    key = exp.seed_key()
    compile_for = lambda size: compile_sweep(exp, state, size)  # noqa: E731
    try:
        size, programs = fit_in_memory(compile_for, n, free_bytes_per_device(exp.mesh.local_devices))
    except (MemoryError, PlanError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2

    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "sweep.jsonl"
    last: list[dict[str, float]] = [{} for _ in range(n)]  # each setting's latest metrics
    chunks = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    with log_path.open("w") as f, tqdm(total=cfg.trainer.total_steps * len(chunks), desc=f"sweep x{n}", unit="step") as bar:
        for chunk in chunks:
            if len(chunk) != size:  # the last, smaller chunk
                programs = compile_for(len(chunk))
            hyper = swept_hyper(exp.hyper, [settings_grid[i] for i in chunk])
            states = programs.make_states(state)
            for t in range(cfg.trainer.total_steps):
                states, metrics = programs.iteration(states, exp.train_tables, hyper, key)
                metrics = jax.device_get(metrics)
                for j, i in enumerate(chunk):
                    last[i] = {k: float(v[j]) for k, v in metrics.items()}
                    f.write(json.dumps({"step": t + 1, "setting": settings_grid[i], **last[i]}) + "\n")
                f.flush()
                bar.update()
    shown: list[str] = [k for k in ("train/reward/mean", "rollout/in_group_std", "actor/entropy_loss") if k in last[0]]
    print(" | ".join(list(settings_grid[0]) + shown))
    for setting, m in zip(settings_grid, last):
        print(" | ".join([f"{v:g}" for v in setting.values()] + [f"{m[k]:.4f}" for k in shown]))
    print(f"wrote {log_path}")
    return 0


def swept_hyper(hyper, settings: list[dict[str, float]]):
    """The experiment's hyperparameters with a leading settings axis, the swept keys varying on it."""
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (len(settings),)), hyper)
    return stacked.replace(**{SWEEPABLE[k]: jnp.asarray([s[k] for s in settings], jnp.float32) for k in settings[0]})


class SweepPrograms(NamedTuple):
    iteration: Any  # train.JittedIteration vmapped over the settings, its rollout already compiled
    make_states: Callable  # jitted: the state -> its copies, one per setting
    need: int  # peak bytes per device while a step runs, by XLA's estimate (``planning.program_peak_bytes``)


def compile_sweep(exp, state, size: int) -> SweepPrograms:
    """The iteration vmapped over ``size`` settings, and its memory estimate: the rollout and the
    update at ``planning.planned_layout`` (the largest layout a batch can take: every other computes
    fewer positions) compiled from abstract shapes, no copy of the state made to compile
    them. The two run one after the other, so the peak is the larger of the rollout's program and
    the update's plus the rollout tables, which stay on the device beside it (the update's own
    arguments hold the states and the rollout batch)."""
    traced_axes = []

    def copies(s):
        states, axes = replicate(s, size)
        traced_axes.append(axes)
        return states

    abstract_states = jax.eval_shape(copies, state)
    step = make_train_step(exp.settings, exp.model.graphdef, exp.train_plan)
    iteration = jit_iteration(step, exp.settings, exp.train_plan, traced_axes[0])
    # jit_iteration's collect and learn are jax.jit's (JittedIteration types them as plain Callables).
    jitted_collect = cast("jax.stages.Wrapped", iteration.collect)
    jitted_learn = cast("jax.stages.Wrapped", iteration.learn)
    key = jax.random.PRNGKey(0)
    collect = jitted_collect.lower(abstract_states, exp.train_tables, key).compile()
    traj = jax.eval_shape(iteration.collect, abstract_states, exp.train_tables, key)
    hyper = jax.eval_shape(lambda h: swept_hyper(h, [{}] * size), exp.hyper)
    learn = jitted_learn.lower(abstract_states, traj, hyper, planned_layout(exp)).compile()
    tables = sum(getattr(x, "nbytes", 0) for x in jax.tree.leaves(exp.train_tables))
    need = max(program_peak_bytes(collect), program_peak_bytes(learn) + tables)
    return SweepPrograms(iteration._replace(collect=collect), jax.jit(copies), need)


# XLA's buffer accounting does not see the runtime, allocator fragmentation or host copies, which
# put a sweep's measured peak above its estimate: keep a fifth free.
HEADROOM = 0.8


def fit_in_memory(compile_for, n: int, free: int | None):
    """(chunk size, compile_for(chunk size)) for the most settings at a time, up to ``n``, whose
    compiled programs' estimate (``.need`` bytes) fits in ``HEADROOM`` of ``free`` bytes per
    device; MemoryError naming what to reduce if one setting does not. ``free`` None (a CPU host
    without /proc): nothing to check against, every setting at once."""
    if free is None:
        return n, compile_for(n)
    size, budget = n, int(HEADROOM * free)
    while True:
        programs = compile_for(size)
        need = programs.need
        if need <= budget:
            print(f"sweep: {size} of {n} settings at a time, about {need / 2**30:.1f} GiB "
                  f"({free / 2**30:.1f} GiB free)", file=sys.stderr)
            return size, programs
        if size == 1:
            raise MemoryError(
                f"One sweep setting needs about {need / 2**30:.1f} GiB but {free / 2**30:.1f} GiB is free "
                f"(a fifth kept spare): reduce envs.train.n_groups, envs.train.group_size, "
                "rollout.max_model_len or actor.micro_batch_size, or set lora.rank."
            )
        size = max(1, min(size - 1, size * budget // need))


def run() -> None:
    """The command (``bootstrap.command`` calls it)."""
    cli.run(main)
