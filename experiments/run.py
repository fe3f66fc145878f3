"""Train an LLM agent with StarPO / StarPO-S.

    python -m experiments.run --config configs/sokoban.py [--config.rollout.max_turn=3 ...]
    python -m experiments.run --config configs/presets.py:starpo_grpo
    python -m experiments.run --config configs/quickstart.py          # bundled model, CPU, minutes

Writes to ``trainer.output_dir``: ``config.json``, ``metrics.jsonl`` (one line per step and per
validation), TensorBoard events under ``tb/`` (``tensorboard --logdir <output_dir>/tb``),
validation trajectories as ``val/step_<N>.jsonl``, orbax checkpoints under ``checkpoints/``
(every ``trainer.save_freq`` steps, after a step when ``trainer.save_every_minutes`` have passed
since the last save, and at the end; the last 3 kept; ``--config.trainer.resume=True`` continues a
stopped run exactly), and the final policy as a Hugging Face folder ``hf_policy/``. Ctrl-C stops at
once, SIGTERM (SLURM, preemption) after saving the step it finishes; either prints one line naming
the last checkpoint and the command that resumes. A fresh run refuses a folder that holds an
earlier run unless ``--config.trainer.overwrite=True`` (which deletes that run's files first, naming
them). With LoRA also the adapters as a peft folder ``lora_adapter/`` naming a base that resolves
(``base_model/``, written beside it, when ``model.source`` is no hub id or HF folder). Exports
honour the umask.
"""

from __future__ import annotations

from experiments import bootstrap

if __name__ == "__main__":  # first: joins a multi-host run before the imports below start XLA's backend
    bootstrap.command("experiments.run")

import json
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from absl import flags, logging
from flax import nnx
from jax.experimental import multihost_utils
from tqdm import tqdm

from experiments import cli
from starpo_jax.diagnostics import dumps
from starpo_jax.diagnostics.collapse import CollapseWatch
from starpo_jax.diagnostics.diversity import think_diversity_metrics
from starpo_jax.diagnostics.fixed_levels import evaluate_levels, fixed_levels
from starpo_jax.diagnostics.template_collapse import collapse_metrics
from starpo_jax.diagnostics.tensorboard import summary_writer, write_scalars
from starpo_jax.format_warmup import answer_pieces, format_warmup
from starpo_jax.models.loading import ModelLoadError, hf_name, save_model, source_dtype
from starpo_jax.models.lora import save_adapter
from starpo_jax.rollout.sampling import sampling_policy
from starpo_jax.runtime import allocator, batches, checkpoint, distributed, sharding, unraisable
from starpo_jax.runtime.caches import setup_compilation_cache
from starpo_jax.runtime.checkpoint import CheckpointError
from starpo_jax.runtime.experiment import ConfigError, build_experiment, check_config
from starpo_jax.runtime.host_memory import peak_resident_bytes
from starpo_jax.runtime.planning import PlanError, check_fits, device_budget, device_peak
from starpo_jax.train import init_train_state, jit_iteration, make_train_step, policy_weights

_CONFIG = cli.define_config_flag()
flags.DEFINE_integer("max_steps", None, "Stop after this many training steps this invocation (for smoke runs).")
FLAGS = flags.FLAGS


def inner_bar_position() -> int | None:
    """Where a bar drawn inside the training bar goes: below it in a terminal (tqdm's choice), on
    the same line in a log file, where tqdm's cursor-up codes to reach the line below would be
    left as ``ESC[A`` in the text."""
    return None if sys.stderr.isatty() else 0


def validation(exp, policy_of, val_levels, state, step, out: Path, log) -> dict:
    """One validation on the fixed levels ``val_levels`` (``diagnostics.fixed_levels``, as
    ``experiments.evaluate`` plays them; a bar per ``trainer.val_chunks`` chunk): metrics, JSONL
    dump and a printed sample."""
    cfg = exp.config
    key = jax.random.fold_in(jax.random.PRNGKey(cfg.trainer.seed + 1), step)  # other samples at every validation
    policy = policy_of(state)
    with tqdm(total=cfg.trainer.val_chunks, desc=f"{distributed.tag()}validation @ step {step}", unit="chunk",
              leave=False, disable=not distributed.is_writer(), position=inner_bar_position()) as bar:
        traj, metrics, seconds = evaluate_levels(val_levels, policy, key, cfg.rollout.val_temperature, "val-env",
                                                 bar.update)
    metrics["timing_s/testing"] = seconds
    metrics |= template_collapse(exp, policy, traj, exp.val_plan, "val-env")
    traj = distributed.to_host(traj)  # with several processes, every row on every process
    if not distributed.is_writer():
        return metrics
    records = dumps.trajectory_records(traj, exp.val_plan, exp.tokenizer, cfg.envs.val.seed)
    metrics |= think_diversity_metrics(records, "val-env")  # the Echo Trap: one think template for all levels
    dumps.write_jsonl(records, out / "val" / f"step_{step}.jsonl")
    successes = ", ".join(
        f"{t.name} {metrics[f'val-env/{t.name}/success']:.3f}" for t in exp.val_plan.tags
    )
    log(f"validation @ step {step}: success {successes} | reward {metrics['val-env/reward/mean']:+.3f} | {seconds:.1f}s")
    if records and cfg.trainer.log_trajectories > 0:
        log(dumps.format_record(records[0]))
    return metrics


def dump_training(exp, traj, step: int, out: Path) -> None:
    """The first ``trainer.log_trajectories`` trajectories of training step ``step``'s batch as
    ``train/step_<step>.jsonl`` (the records of ``val/``), for the run report."""
    first = jax.tree.map(lambda rows: rows[: exp.config.trainer.log_trajectories], traj)  # sliced on the devices
    first = distributed.to_host(first)  # a collective with several processes
    if distributed.is_writer():
        dumps.write_jsonl(dumps.trajectory_records(first, exp.train_plan, exp.tokenizer),
                          out / "train" / f"step_{step}.jsonl")


def template_collapse(exp, policy, traj, plan, prefix: str) -> dict:
    """RAGEN-2's template-collapse figures of a rollout batch (``diagnostics.template_collapse``),
    per env tag, with their time; none when ``trainer.mi_prompts`` is 0."""
    if not exp.config.trainer.mi_prompts:
        return {}
    t0 = time.perf_counter()
    metrics = collapse_metrics(policy, traj, plan, prefix, max_prompts=exp.config.trainer.mi_prompts,
                               positions=exp.settings.logprob_chunk, temperature=exp.settings.rollout_temperature)
    return metrics | {f"timing_s/{prefix}_mi": time.perf_counter() - t0} if metrics else {}


def warm_up_format(exp, state, log, stopping: Stopping):
    """``actor.format_warmup_steps`` supervised steps on random valid answers before RL
    (``starpo_jax.format_warmup``): (state, metrics of step 0). A signal stops it between steps."""
    cfg, nll, t0 = exp.config, [], time.perf_counter()
    steps = cfg.actor.format_warmup_steps
    with tqdm(total=steps, desc=f"{distributed.tag()}format warm-up", unit="step", leave=False,
              disable=not distributed.is_writer(), position=inner_bar_position()) as bar:

        def on_step(i: int, metrics: dict) -> None:
            nll.append(metrics["format_warmup/nll"])
            bar.update()
            bar.set_postfix(nll=f"{nll[-1]:.3f}")
            stopping.check_before_training()

        pieces = answer_pieces(exp.tokenizer, exp.train_plan, exp.train_tables)
        state = format_warmup(exp.settings, exp.model.graphdef, exp.train_plan, exp.train_tables, pieces, state,
                              jax.random.PRNGKey(cfg.trainer.seed + 2), steps, cfg.actor.format_warmup_lr, on_step)
    seconds = time.perf_counter() - t0
    log(f"format warm-up: {steps} steps, answer NLL {nll[0]:.3f} -> {nll[-1]:.3f} | {seconds:.1f}s")
    return state, {"format_warmup/nll_first": nll[0], "format_warmup/nll": nll[-1], "timing_s/format_warmup": seconds}


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)  # orbax and jax log every checkpoint step at INFO
    setup_compilation_cache()  # before the first compile
    if not cli.runtime_agrees(_CONFIG.value):  # the runtime started from the command line (bootstrap)
        return 2
    cfg = _CONFIG.value
    stopping = Stopping(cfg)  # from here on, while checking, planning and loading too
    with stopping:
        try:
            return _checked_and_trained(cfg, stopping)
        except KeyboardInterrupt:
            before = "" if stopping.finished else " before training started"
            return stopping.report(f"interrupted (SIGINT){before}", 130)
        except TerminatedBeforeTraining:
            return stopping.report("terminated (SIGTERM) before training started", 143)
        except jax.errors.JaxRuntimeError as err:
            if "RESOURCE_EXHAUSTED" not in str(err):
                raise
            return stopping.report(out_of_memory(err), 1)


def out_of_memory(err: Exception) -> str:
    """What ``main`` reports of XLA's out-of-memory error ``err``: its first line, the heap limit a
    CPU run had (``runtime.allocator``) and the settings that lower a run's memory."""
    said = str(err).strip().splitlines()[0]
    return (f"out of memory ({said}{heap_limit_note()}): lower actor.micro_batch_size or rollout.max_model_len "
            "(python -m experiments.plan shows what a config needs)")


def heap_limit_note() -> str:
    """The heap limit this process runs under, for the lines on its memory ("" where none)."""
    limit = allocator.current_heap_limit()
    return "" if limit is None else f"; tcmalloc's heap limit {allocator.HEAP_LIMIT}={limit} ({limit / 1024:.2f} GiB)"


def _checked_and_trained(cfg, stopping: Stopping) -> int:
    """``main`` once the runtime has started: refuse bad input, plan, load, then ``train``."""
    out = Path(cfg.trainer.output_dir)
    try:  # everything that needs no model first: a mistake costs a second, not a model load
        checked = check_config(cfg)
        check_output_dir(out, resume=cfg.trainer.resume, overwrite=cfg.trainer.overwrite)
        fit = check_fits(checked)  # refuse a run that cannot fit its devices (on CPU: the host) before loading it
        if fit is not None and distributed.is_writer():  # what the host (CPU) or each device is asked for
            if fit.available is not None:
                line = fit.plan.host_line(fit.available) + heap_limit_note()
            else:
                budget = device_budget(jax.local_devices())
                assert budget is not None  # a Fit without available is an accelerator's, checked against this budget
                line = fit.plan.device_line(budget)
            print(line, file=sys.stderr, flush=True)
        exp = build_experiment(checked)
    except (ConfigError, ModelLoadError, CheckpointError, FileNotFoundError, PlanError) as err:
        print(f"{distributed.tag()}error: {err}", file=sys.stderr)
        return 2
    stopping.check_before_training()  # a signal that came while checking or loading
    if cfg.trainer.overwrite and not cfg.trainer.resume and distributed.is_writer():
        clear_run(out)
    with sharding.use_mesh(exp.mesh):
        return train(exp, fit.iteration_for(exp) if fit is not None else None, stopping)


# What a run writes into its output folder, and what experiments.report and experiments.curves
# write there (``clear_run`` deletes exactly these).
RUN_FILES = ("config.json", "metrics.jsonl", "tb", "val", "train", "checkpoints", "damaged_checkpoints", "hf_policy",
             "lora_adapter", "base_model", "report.html", "curves.png", "curves.json")


def run_files_in(out: Path) -> list[str]:
    """The names of ``RUN_FILES`` that ``out`` holds: what a run, or an earlier one, left there."""
    return [name for name in RUN_FILES if (out / name).exists()]


def check_output_dir(out: Path, resume: bool, overwrite: bool) -> None:
    """A fresh run never mixes with an earlier one in the same folder, and resume needs a checkpoint."""
    earlier = run_files_in(out)
    if resume:
        if overwrite:
            raise ConfigError("trainer.resume and trainer.overwrite exclude each other; set one of them.")
        if checkpoint.saved_steps(out / "checkpoints"):
            checkpoint.check_saved_files(out / "checkpoints")  # one whole step, found before the model loads
            return
        if earlier:  # a run that stopped before its first checkpoint
            raise checkpoint.CheckpointError(
                f"No checkpoint in {out / 'checkpoints'}: the run in {out} saved none, so there is nothing to "
                f"resume. Start it afresh with --config.trainer.overwrite=True (deletes its {', '.join(earlier)}) "
                "or in another --config.trainer.output_dir."
            )
        raise checkpoint.CheckpointError(
            f"No checkpoint in {out / 'checkpoints'}: no run was saved in {out}, so there is nothing to resume; "
            "start one without --config.trainer.resume=True."
        )
    if earlier and not overwrite:
        raise ConfigError(
            f"{out} holds an earlier run ({', '.join(earlier)}); continue it with "
            "--config.trainer.resume=True, choose a new --config.trainer.output_dir, or delete it with "
            "--config.trainer.overwrite=True."
        )


def clear_run(out: Path) -> list[str]:
    """Delete the files of an earlier run in ``out`` (``trainer.overwrite=True``), saying so in one
    line; others stay. Returns what it deleted (folders with a trailing /)."""
    gone = [name + "/" * (out / name).is_dir() for name in run_files_in(out)]
    if gone:
        print(f"overwrite: deleting the earlier run's {', '.join(gone)} in {out}", file=sys.stderr, flush=True)
    for name in RUN_FILES:
        path = out / name
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
    return gone


def _ctrl_c_dropped(error) -> bool:
    """A Ctrl-C that Python dropped because it came inside a garbage-collector callback:
    ``Stopping.check`` raises it again where the run can stop, instead of a traceback now."""
    return isinstance(error.exc_value, KeyboardInterrupt)


class TerminatedBeforeTraining(Exception):
    """SIGTERM before the first training step: the run ends with nothing to save."""


class Stopping:
    """SIGINT and SIGTERM while a run checks its config, loads and trains.

    The first SIGINT (Ctrl-C) raises ``KeyboardInterrupt`` where the run is, as Python's own handler
    does, except while a checkpoint is being written: then once it is complete. ``main`` catches it
    and reports instead of a traceback; nothing more is computed or saved. Python drops an exception
    raised inside a garbage-collector callback, so the flag ``interrupted`` stays, and ``check``
    raises it again where the run can stop (before training, after each step). A second SIGINT
    ends the process at once (the default action, whatever the run is doing). SIGTERM only sets
    ``terminated``: the loop saves the step it is on when that step is done, and reports; before
    the first step (once the model is loaded, between format warm-up steps, after the first
    validation) it ends the run with nothing to save (``check_before_training``)."""

    def __init__(self, config):
        self.config = config
        self.terminated = self.saving = self.interrupted = False
        self.finished = None  # the last training step done, once known (0: none yet)
        self.bar = self.board = None  # closed before the report
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():  # handlers can be set nowhere else
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)

        unraisable.ignore(_ctrl_c_dropped)  # for the life of the process (the module says why)
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            if not (sig == signal.SIGINT and self.interrupted):  # after a Ctrl-C the next one aborts
                signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if signum == signal.SIGTERM:
            self.terminated = True
            return
        self.interrupted = True
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if not self.saving:
            raise KeyboardInterrupt

    def check(self) -> None:
        """Raise ``KeyboardInterrupt`` if a Ctrl-C came and was not raised where it came."""
        if self.interrupted:
            raise KeyboardInterrupt

    def check_before_training(self) -> None:
        """``check``, and end the run on SIGTERM: before the first step there is nothing trained to
        save (the format warm-up and the first validation are redone by the next start)."""
        self.check()
        (terminated,) = _agreed(self.terminated)
        if terminated:
            raise TerminatedBeforeTraining

    def save(self, write, *args) -> None:
        """``write(*args)`` a checkpoint; a Ctrl-C meanwhile stops the run once it is complete."""
        self.saving = True
        try:
            write(*args)
        finally:
            self.saving = False
        if self.interrupted:
            raise KeyboardInterrupt

    def report(self, what: str, status: int) -> int:
        """Close the bar and the TensorBoard log, print the one line, return ``status``."""
        for closable in (self.bar, self.board):
            try:
                if closable is not None:
                    closable.close()
            except Exception:  # a log interrupted mid-write: the report matters more
                pass
        if not distributed.is_writer():
            return status
        folder = Path(self.config.trainer.output_dir) / "checkpoints"
        saved = checkpoint.saved_steps(folder)
        if saved:
            how = f"the last checkpoint is step {saved[0]} in {folder}; resume with: {resume_command(self.config)}"
        else:  # overwrite only what this run left in its folder; an empty folder takes the same command
            how = ("no checkpoint was saved, so there is nothing to resume; start again with: "
                   f"{resume_command(self.config, restart=True, overwrite=bool(run_files_in(folder.parent)))}")
        when = f" after step {self.finished}" if self.finished else ""
        print(f"{distributed.tag()}{what}{when}: {how}", file=sys.stderr, flush=True)
        return status


def resume_command(config, restart: bool = False, overwrite: bool = True) -> str:
    """This process's command line with ``--config.trainer.resume=True`` (``restart``:
    ``--config.trainer.overwrite=True``, or with ``overwrite=False`` neither) in place of either
    switch, quoted for a shell."""
    argv = list(sys.argv)
    python = os.path.relpath(sys.executable)  # as typed when it lies below here (.venv/bin/python)
    python = sys.executable if python.startswith("..") else python
    if Path(argv[0]).resolve() == Path(__file__).resolve():  # python -m experiments.run
        head = [python, "-m", "experiments.run"]
    elif argv[0].endswith(".py"):  # a script that calls run() (docs/examples)
        head = [python, argv[0]]
    else:
        head = argv[:1]
    switches = {"config.trainer.resume", "config.trainer.overwrite"}

    def switch(arg: str) -> bool:
        name = arg.lstrip("-").split("=", 1)[0]
        return arg.startswith("-") and (name in switches or name.removeprefix("no") in switches)

    args = [arg for arg in argv[1:] if not switch(arg)]
    if restart:
        return shlex.join([*head, *args, *(["--config.trainer.overwrite=True"] if overwrite else [])])
    if config.trainer.overwrite and not any(switch(arg) and "overwrite" in arg for arg in argv[1:]):
        args.append("--config.trainer.overwrite=False")  # the config file sets it; resume excludes it
    return shlex.join([*head, *args, "--config.trainer.resume=True"])


def _agreed(*flags: bool) -> tuple[bool, ...]:
    """Each flag, true if it is on any process: every process must save and stop at the same step."""
    if jax.process_count() == 1:
        return flags
    gathered = np.asarray(multihost_utils.process_allgather(np.asarray(flags, np.int32)))
    return tuple(bool(flag) for flag in np.any(gathered.reshape(-1, len(flags)), axis=0))


def config_changes(saved: Path, config) -> str:
    """The settings of ``config`` that differ from a run's saved ``config.json``, as one clause."""
    try:
        before = _flat(json.loads(saved.read_text()))
    except (OSError, ValueError) as err:
        return f"its config.json could not be read to name the settings that differ ({err})"
    now = _flat(json.loads(config.to_json_best_effort()))
    absent = object()
    moot = ("trainer.resume", "trainer.overwrite", "trainer.output_dir")  # differ without changing the run
    changed = [key for key in dict.fromkeys([*now, *before])
               if key not in moot and now.get(key, absent) != before.get(key, absent)]
    if not changed:
        return ("no setting differs from the run's config.json: the model at model.source or the code changed "
                "since it was saved")

    def shown(value) -> str:
        return "(none)" if value is absent else json.dumps(value)

    named = ", ".join(f"{key} {shown(before.get(key, absent))} -> {shown(now.get(key, absent))}" for key in changed[:8])
    more = f" and {len(changed) - 8} more" if len(changed) > 8 else ""
    return (f"settings that differ from the run's config.json (saved -> now): {named}{more}. Resume with the "
            "saved values, or start a new run in another --config.trainer.output_dir")


def _flat(tree: dict, prefix: str = "") -> dict:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat |= _flat(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def train(exp, iteration, stopping: Stopping) -> int:
    """The training loop of a built experiment (inside its mesh). ``iteration``: its
    ``train.jit_iteration`` when already compiled (``planning.Fit.iteration_for``), else None (jitted
    here). It tells ``stopping`` the step reached and what to close on a signal.

    The first Ctrl-C stops the run where it is (status 130: ``main`` reports it), SIGTERM after
    saving the step it finishes (143); each prints one line naming the last checkpoint and the
    command that resumes (``Stopping``)."""
    cfg = exp.config
    out = Path(cfg.trainer.output_dir)
    # Every process trains and checkpoints; process 0 alone writes logs, dumps and exports.
    writer = distributed.is_writer()
    log = (lambda message: tqdm.write(distributed.tag() + message)) if writer else (lambda message: None)

    # Rollout and update jitted apart (timed apart); the update computes only the positions the
    # batch holds (forward.update_layout), a static argument picked per batch on the host.
    staleness = cfg.trainer.staleness
    if iteration is None:
        iteration = jit_iteration(make_train_step(exp.settings, exp.model.graphdef, exp.train_plan), exp.settings,
                                  exp.train_plan)
    val_levels = fixed_levels(exp.val_plan, exp.val_tables, cfg.envs.val.seed, cfg.trainer.val_chunks)
    # Built on this process's own device, outside the mesh (a process may hold none of the trainer's
    # devices, where an operation of arrays not yet placed cannot run), then placed on the mesh.
    with jax.set_mesh(None):
        state = init_train_state(exp.settings, exp.model, exp.seed_key())
    state = sharding.shard(state, exp.mesh)
    policy_of = lambda s: sampling_policy(exp.model.graphdef, policy_weights(exp.settings, s))  # noqa: E731
    key = exp.seed_key()
    last_save = time.monotonic()  # trainer.save_every_minutes counts from here

    try:
        state, watch, start, mgr, in_flight = open_run(exp, state, log)
    except checkpoint.CheckpointError as err:
        print(f"{distributed.tag()}error: {err}", file=sys.stderr)
        return 2
    stopping.finished = start
    metrics_path = out / "metrics.jsonl"
    # purge_step: TensorBoard drops the events a killed run logged after its checkpoint.
    board = summary_writer(out / "tb", purge_step=start + 1 if start else None) if writer else None
    stopping.board = board

    def record(step: int, metrics: dict) -> None:
        if not writer:
            return
        write_scalars(board, metrics, step)
        with metrics_path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")

    if start == 0 and cfg.actor.format_warmup_steps:
        state, warmup_metrics = warm_up_format(exp, state, log, stopping)
        record(0, warmup_metrics)
    total = cfg.trainer.total_steps
    stop = total if FLAGS.max_steps is None else min(total, start + FLAGS.max_steps)
    if cfg.trainer.val_before_train and start == 0 and cfg.trainer.test_freq > 0:
        record(0, validation(exp, policy_of, val_levels, state, 0, out, log))
        stopping.check_before_training()

    # Staleness 1: each batch is dispatched a step ahead, on the sampler's mesh (batches.OneStepOff).
    ahead = batches.OneStepOff(iteration.collect, exp.train_tables, key, exp.mesh, exp.rollout_mesh) if staleness else None
    if ahead is not None:
        log(batches.describe(ahead))
        if in_flight is not None:  # the batch the stopped run had in flight, sampled again by its weights
            ahead.resume(state, in_flight)
        elif start:
            log(f"note: step {start}'s checkpoint holds no batch in flight (a run with trainer.staleness=0 saved "
                "it), so the first batch is sampled by its restored weights (fresh).")
    bar = tqdm(range(start, stop), initial=start, total=total, desc=f"{distributed.tag()}train", unit="step")
    stopping.bar = bar
    save_every, mi_freq = cfg.trainer.save_every_minutes * 60, cfg.trainer.mi_freq
    cut_warned = False  # turns cut short by the context are said once a run
    for step in bar:
        t0 = time.perf_counter()
        # With staleness 1, waits for the batch dispatched a step ago and dispatches the next one.
        batch = ahead.next(state, more=step + 1 < stop) if ahead else batches.sample_now(
            iteration.collect, state, exp.train_tables, key)
        traj = batch.traj
        t1 = time.perf_counter()
        if cfg.trainer.log_trajectories > 0:
            dump_training(exp, traj, step + 1, out)
        # Scored by the weights that sampled the batch, before the update replaces (donates) them.
        if mi_freq and (step + 1) % mi_freq == 0:
            with batch.on_sampler():
                collapse = template_collapse(exp, policy_of(batch.sampler), batch.sampled, exp.train_plan, "train")
        else:
            collapse = {}
        t_update = time.perf_counter()
        state, metrics = iteration.learn(state, traj, exp.hyper, iteration.layout(traj))
        metrics = {k: float(v) for k, v in distributed.to_host(metrics).items()} | collapse  # on every process
        t2 = time.perf_counter()
        # A stale batch was sampled while the last update ran: gen is only the wait for it, and the
        # rollout's throughput is over the whole step, which it overlapped.
        rollout_s = t2 - t0 if staleness else t1 - t0
        metrics |= {
            "timing_s/gen": t1 - t0,
            "timing_s/update": t2 - t_update,
            "timing_s/step": t2 - t0,
            "perf/generated_tokens_per_s": metrics["train/generated_tokens"] / rollout_s,
            "perf/env_steps_per_s": metrics["train/env_steps"] / rollout_s,
        }
        peak = device_peak(jax.local_devices())
        host_peak = peak_resident_bytes() if peak is None else 0
        if peak is not None:  # accelerators count it; a CPU's memory is the host's: its process's peak
            metrics["perf/device_peak_gib"] = peak / 2**30
        elif host_peak:  # 0 where there is no /proc
            metrics["perf/host_peak_gib"] = host_peak / 2**30
        if not cut_warned and metrics.get("train/context_exhausted", 0) > 0:
            cut_warned = True
            log(f"warning @ step {step + 1}: {context_cut(metrics['train/context_exhausted'], exp.train_plan)}")
        warnings = watch.update(metrics)
        metrics["collapse/warning"] = float(bool(warnings))
        for w in warnings:
            log(f"warning @ step {step + 1}: {w}")
        done = step + 1
        record(done, metrics)
        bar.set_postfix(
            reward=f"{metrics['train/reward/mean']:+.3f}",
            std=f"{metrics['rollout/in_group_std']:.3f}",
            s_step=f"{metrics['timing_s/step']:.1f}",
        )
        if cfg.trainer.test_freq > 0 and (done % cfg.trainer.test_freq == 0 or done == total):
            record(done, validation(exp, policy_of, val_levels, state, done, out, log))
        stopping.finished = done
        # A save is due every trainer.save_freq steps, trainer.save_every_minutes after the last one,
        # at the end, and when SIGTERM came (the processes of a multi-host run agree on both).
        due = (cfg.trainer.save_freq > 0 and done % cfg.trainer.save_freq == 0) or done == stop or (
            save_every > 0 and time.monotonic() - last_save >= save_every)
        due, terminated = _agreed(due, stopping.terminated)
        if due or terminated:
            # One step off: with the weights of the batch in flight, unless no step follows it.
            in_flight = ahead.pending_actor if ahead and done < total else None
            stopping.save(checkpoint.save, mgr, done, state, {"collapse_watch": watch.state()}, in_flight)
            last_save = time.monotonic()
        if terminated:
            return stopping.report("terminated (SIGTERM)", 143)
        stopping.check()
    bar.close()
    if board is not None:  # the writer's (process 0's)
        board.close()
    if stop == total and cfg.trainer.export_hf:
        export_policy(exp, state, log)
    log(f"done: {stop} steps, outputs in {out}")
    return 0


def open_run(exp, state, log):
    """Where the run starts: (state, collapse watch, first step, checkpoint manager, the weights of
    the batch a one-step-off run had in flight or None). A resume first
    restores the newest intact checkpoint, so a failed one (``checkpoint.CheckpointError``; a
    mismatch names the settings that changed) leaves the folder as it was; then ``config.json`` is
    written, and a resume cuts the metrics log back to the step restored and sets aside the damaged
    steps newer than it."""
    cfg = exp.config
    out = Path(cfg.trainer.output_dir)
    if not cfg.trainer.resume:
        out.mkdir(parents=True, exist_ok=True)
    mgr = checkpoint.manager(out / "checkpoints")
    host: dict = {}
    start, in_flight = 0, None
    if cfg.trainer.resume:
        like_in_flight = state.actor if cfg.trainer.staleness else None
        try:
            state, host, start, in_flight = checkpoint.restore(mgr, state, warn=lambda w: log(f"warning: {w}"),
                                                               like_pending=like_in_flight)
        except checkpoint.CheckpointMismatch as err:  # another model or config: name what changed
            raise checkpoint.CheckpointMismatch(f"{err}; {config_changes(out / 'config.json', cfg)}.") from None
    if distributed.is_writer():
        (out / "config.json").write_text(cfg.to_json_best_effort(indent=2))
        if cfg.trainer.resume:
            _truncate_log(out / "metrics.jsonl", start)
    if cfg.trainer.resume:
        damaged = [s for s in mgr.all_steps() if s > start]  # newer steps restore skipped
        if damaged:
            log(f"damaged steps {damaged} moved to {checkpoint.set_aside(mgr, damaged)}")
        log(f"resumed from step {start} in {out}")
    return state, CollapseWatch.from_state(host.get("collapse_watch", {})), start, mgr, in_flight


def export_policy(exp, state, log) -> None:
    """The trained policy as a Hugging Face folder ``hf_policy/`` in ``trainer.export_dtype``; with
    LoRA also its adapters for peft, with the base written as a folder where no client can name it
    (a GGUF, the bundled model, random weights). Every process calls it (a collective); process 0
    writes."""
    cfg, out = exp.config, Path(exp.config.trainer.output_dir)
    weights = distributed.to_host(policy_weights(exp.settings, state))  # a collective with several processes
    if not distributed.is_writer():
        return
    policy = nnx.merge(exp.model.graphdef, weights)
    dtype = cfg.trainer.export_dtype  # "source": model.source's; random weights: the model's own
    if dtype == "source":
        dtype = None if cfg.model.random_init_preset else source_dtype(cfg.model.source)
    folder = save_model(policy, exp.tokenizer, out / "hf_policy", dtype)
    log(f"policy saved as a Hugging Face checkpoint: {folder}")
    if exp.settings.lora_rank:
        base = None if cfg.model.random_init_preset else hf_name(cfg.model.source)
        if base is None:  # GGUF, bundled or random weights: a peft client needs them as a folder
            base_weights = nnx.merge(exp.model.graphdef, state.base)
            base = str(save_model(base_weights, exp.tokenizer, out / "base_model", dtype))
            log(f"LoRA base saved as a Hugging Face checkpoint: {base}")
        folder = save_adapter(state.actor, policy.config, exp.settings.lora_alpha, out / "lora_adapter",
                              base_model=base)
        log(f"LoRA adapters saved for peft (base {base}): {folder}")


def context_cut(fraction: float, plan) -> str:
    """What to say when trajectories ran out of context before their last turn (RAGEN ends them
    there, unsuccessful), which the metrics alone show only as ``context_exhausted``."""
    cut = round(fraction * plan.batch_size)
    return (f"{cut} of {plan.batch_size} trajectories ran out of context (rollout.max_model_len = {plan.max_len} "
            f"tokens) before rollout.max_turn = {plan.max_turn} turns and ended there, unsuccessful; raise "
            "rollout.max_model_len to let them play every turn (this is said once a run).")


def _truncate_log(path: Path, step: int) -> None:
    """Drop log lines written after the checkpoint we resume from, so the log equals an
    uninterrupted run's (and a line a killed run left half-written)."""
    if not path.exists():
        return

    def step_of(line: str) -> float:
        try:
            return json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            return float("inf")

    lines = [line for line in path.read_text().splitlines() if step_of(line) <= step]
    path.write_text("".join(line + "\n" for line in lines))


def run() -> None:
    """The command (``bootstrap.command`` calls it; so can a launcher that registers an env first)."""
    cli.run(main)
