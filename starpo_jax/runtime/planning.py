"""Memory before compute: a run's rollout and update compiled for abstract shapes, and the bytes per
device XLA says they need (``compiled.memory_analysis()``). No weight is allocated and no checkpoint
read: the model's shapes come from ``nnx.eval_shape``.

``plan_memory(exp)`` for an experiment built with ``load=abstract_policy``; ``check_fits(config)``
is ``experiments.run``'s refusal of a config that cannot fit its accelerators, or on CPU the host's
available memory. The programs it compiles are the run's own (``train.jit_iteration``'s), and it
hands them to the run (``Fit.iteration_for``), which so compiles its rollout once. The command line
is ``python -m experiments.plan`` (docs/scaling.md).

A one-step-off run (``trainer.staleness=1``) is planned as it runs (``batches.OneStepOff``): its
rollout compiled for the sampler's inputs on the sampler's mesh, holding two copies of the policy
and two batches while the next batch samples beside the one being trained; with its own devices
(``mesh.rollout_devices``) each part's devices hold their program, else both programs' memory is
counted at once, since they may run together.

The one account of memory, which ``experiments.sweep`` and the benchmarks use too: a compiled
program's buffers and peak (``program_memory``, ``program_peak_bytes``), the KV cache of a shape
(``kv_bytes_per_token``, ``kv_cache_bytes``), and what devices can still allocate
(``free_bytes_per_device``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from starpo_jax.forward import largest_update_layout
from starpo_jax.models import bundled
from starpo_jax.models.config import PRESETS, ModelConfig, preset
from starpo_jax.models.decoder import Decoder, ModelState, cache_dtype
from starpo_jax.models.gguf_reader import hf_config_from_gguf, open_gguf
from starpo_jax.models.loading import load_tokenizer, smollm2_tokenizer
from starpo_jax.runtime import batches, sharding
from starpo_jax.runtime.experiment import _tokenizer_only, build_experiment, model_compute
from starpo_jax.runtime.host_memory import available_bytes, resident_bytes
from starpo_jax.train import init_train_state, jit_iteration, make_train_step

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


class PlanError(ValueError):
    """Input the planner cannot work with; the message says what to change."""


def parse_bytes(text: str) -> int:
    """``"80GiB"`` -> 85899345920; also GB (10^9), MiB, plain numbers (bytes)."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    size = int(float(match.group(1)) * unit) if match and unit else 0
    if size < 1:  # not a size, or none: nothing would fit
        raise PlanError(f"--device-memory {text!r} is not a size; write e.g. 80GiB, 24GB or 16e9.")
    return size


def gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


# ---- abstract model ------------------------------------------------------------------------------


def model_config_and_tokenizer(config):
    """(ModelConfig, tokenizer) of ``config.model`` without reading a weight."""
    source = str(config.model.source)
    dtypes = model_compute(config)
    if config.model.random_init_preset:
        tokenizer = _tokenizer_only(source)
        return preset(config.model.random_init_preset, vocab_size=len(tokenizer), **dtypes), tokenizer
    if source == bundled.SMOLLM2_NAME:
        return preset("smollm2-135m-instruct", **dtypes), smollm2_tokenizer()
    folder = Path(source).expanduser()
    if (folder / "config.json").is_file():
        hf = json.loads((folder / "config.json").read_text())
        return ModelConfig.from_hf_config(hf, **dtypes), load_tokenizer(folder)
    if folder.suffix.lower() == ".gguf" and folder.is_file():  # its header only; no weight is dequantised
        return ModelConfig.from_hf_config(hf_config_from_gguf(open_gguf(folder), folder), **dtypes), load_tokenizer(folder)
    name = source.split("/")[-1].lower()
    if name in PRESETS and name.startswith("qwen2.5"):
        return preset(name, **dtypes), bundled.qwen_tokenizer()  # every Qwen2.5 size shares the tokenizer
    raise PlanError(
        f"Cannot plan for model.source={source!r} without downloading it: give a folder with its config.json, "
        f"or set model.random_init_preset to one of {', '.join(sorted(PRESETS))}."
    )


def abstract_policy(config):
    """(ModelState whose weights are ``jax.ShapeDtypeStruct``, tokenizer): a load with no weights."""
    model_config, tokenizer = model_config_and_tokenizer(config)
    return ModelState.split(nnx.eval_shape(lambda: Decoder(model_config, rngs=nnx.Rngs(0)))), tokenizer


# ---- the plan ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """Bytes per device of one training iteration on ``mesh``."""

    mesh: dict  # axis -> size
    train_state: int  # actor, critic, reference, Adam moments, counters (the update's donated input)
    kv_cache: int  # the rollout's keys and values (part of rollout_temp)
    rollout_temp: int  # the rollout program's working memory: KV cache, gathered policy, activations
    rollout_peak: int  # the resident train state + the rollout's tables, outputs and working memory
    update_temp: int  # the update program's working memory: gathered weights, activations, gradients
    update_peak: int  # inputs + outputs + working memory of the update program (donated state reused)
    micro_rows: int = 1  # rows per device in one gradient pass (actor.micro_batch_size / (data × fsdp))
    remat: str = "layer"  # model.remat: what the update's backward pass keeps of each layer
    # One step off: the sampler's mesh when it has devices of its own (mesh.rollout_devices), whose
    # devices hold rollout_peak and the trainer's update_peak; None: the same devices hold both.
    rollout_mesh: dict | None = None
    concurrent: bool = False  # one step off on the same devices: the rollout's memory beside the update's
    # This process's devices of (the sampler's mesh, the trainer's): a split's parts may lie on
    # different processes (hosts). None: every device of each mesh (one process).
    here: tuple[int, int] | None = None
    # CPU: the process's own memory beside the programs' buffers (Python, JAX, XLA's compiled
    # programs and compilers, tokenizer, tables), measured as the planning process's resident
    # memory once it has compiled the run's programs. 0 when not measured.
    runtime: int = 0

    @property
    def peak(self) -> int:
        """The most any one device holds."""
        return self.rollout_peak + self.update_peak if self.concurrent else max(self.rollout_peak, self.update_peak)

    @property
    def peak_here(self) -> int:
        """The most any one of this process's devices holds: a split's part it has no device of
        does not count."""
        if self.rollout_mesh is None or self.here is None:
            return self.peak
        sampling, training = self.here
        return max(self.rollout_peak if sampling else 0, self.update_peak if training else 0)

    @property
    def host_peak(self) -> int:
        """A CPU process's peak resident memory: the runtime plus the peak of each of its
        (simulated) devices, those of a split's parts each with their part's."""
        sampling, training = self.here or (_devices(self.rollout_mesh or {}), _devices(self.mesh))
        if self.rollout_mesh is None:
            return self.runtime + training * self.peak
        return self.runtime + sampling * self.rollout_peak + training * self.update_peak

    def report(self, budget: int) -> str:
        mesh = _axes(self.mesh)
        if self.rollout_mesh is not None:
            mesh = f"{mesh} training; rollout on its own devices, mesh {_axes(self.rollout_mesh)}"
        elif self.concurrent:
            mesh = f"{mesh}, one step off: the rollout's peak and the update's at once"
        rows = [
            ("train state (actor, critic, reference, Adam)", self.train_state),
            ("rollout KV cache", self.kv_cache),
            ("rollout working memory (incl. KV cache)", self.rollout_temp),
            ("update working memory", self.update_temp),
            ("peak, rollout program", self.rollout_peak),
            ("peak, update program", self.update_peak),
        ]
        lines = [f"per device, mesh {mesh}:"] + [f"  {name:<46} {gib(value):>12}" for name, value in rows]
        verdict = "fits" if self.peak <= budget else "does NOT fit"
        lines.append(f"  {'total (peak) vs budget':<46} {gib(self.peak):>12} / {gib(budget)}: {verdict}")
        if self.runtime:
            lines.append(f"  {'on a CPU host: + runtime (Python, JAX, XLA)':<46} {gib(self.runtime):>12} = "
                         f"{gib(self.host_peak)} resident at the peak")
            lines.append(f"  {HOST_LEAVES_OUT}")
        advice = self.advice(budget)
        if advice:
            lines.append(advice)
        return "\n".join(lines)

    def device_line(self, budget: int) -> str:
        """One line for an accelerator run: its planned peak per device against the device's memory."""
        return (f"device memory: about {gib(self.peak)} per device at the peak (rollout {gib(self.rollout_peak)}, "
                f"update {gib(self.update_peak)}) of {gib(budget)}; {MEASURED_OVER_PLAN}")

    def host_line(self, available: int) -> str:
        """One line for a CPU run: its estimated peak resident memory against what the host has."""
        return (f"host memory: about {gib(self.host_peak)} resident at the peak ({gib(self.runtime)} runtime "
                f"+ {gib(self.host_peak - self.runtime)} of programs), {gib(available)} available beside this process; "
                f"{MEASURED_OVER_PLAN}")

    def _update_knob(self) -> str:
        if self.remat != "layer":
            return (f"set model.remat=layer (now {self.remat!r}: the backward pass keeps more of every layer "
                    "than its input, e.g. its attention scores, which grow with the square of the length)")
        if self.micro_rows > 1:
            return f"lower actor.micro_batch_size ({self.micro_rows} rows per device per gradient pass)"
        return ("lower rollout.max_model_len (a layer's attention scores grow with its square; gradient passes "
                "already take one row per device and recompute each layer)")

    def largest_part(self) -> tuple[str, str]:
        """(the largest part of the peak, the knob that lowers it)."""
        parts = {
            "the train state": (self.train_state, "raise mesh.fsdp (the state is stored 1/fsdp per device; take it from "
                                "mesh.data), or train LoRA adapters (lora.rank=64) instead of every weight"),
            "the rollout's working memory": (self.rollout_temp, "lower the rows per device (envs.train.n_groups × "
                                             "group_size over mesh.data × mesh.fsdp; more devices split them) or "
                                             "rollout.max_model_len"),
            "the update's working memory": (self.update_temp, self._update_knob()),
        }
        name, (_, knob) = max(parts.items(), key=lambda item: item[1][0])
        return name, knob

    def advice(self, budget: int) -> str | None:
        """Which knob to turn when the peak is over ``budget`` (None when it fits)."""
        if self.peak <= budget:
            return None
        name, knob = self.largest_part()
        return f"  over budget by {gib(self.peak - budget)}; the largest part is {name}: {knob}."


def _devices(mesh: dict) -> int:
    return int(np.prod(list(mesh.values())))


def _axes(mesh: dict) -> str:
    return " × ".join(f"{axis} {size}" for axis, size in mesh.items())


def _bytes_per_device(tree) -> int:
    """Bytes one device holds of an abstract (sharded) tree."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape)) * x.dtype.itemsize
    return total


def _abstract(tree, shardings):
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


class ProgramMemory(NamedTuple):
    """XLA's accounting of one compiled program's buffers, in bytes per device."""

    arguments: int
    outputs: int
    temporaries: int  # the program's working memory
    aliased: int  # outputs written into a donated argument's buffer, so already among the arguments

    @property
    def peak(self) -> int:
        """What a device holds while the program runs: inputs, outputs and working memory, a
        donated input's buffer counted once."""
        return self.arguments + self.outputs - self.aliased + self.temporaries

    def sizes(self) -> dict[str, int]:
        """Arguments, outputs and temporaries by name, as the benchmarks record them."""
        return {"arguments": self.arguments, "outputs": self.outputs, "temporaries": self.temporaries}


def program_memory(compiled) -> ProgramMemory | None:
    """``compiled.memory_analysis()`` of a jitted function's compiled program; None where the
    backend reports none."""
    stats = compiled.memory_analysis()
    if stats is None:
        return None
    return ProgramMemory(arguments=stats.argument_size_in_bytes, outputs=stats.output_size_in_bytes,
                         temporaries=stats.temp_size_in_bytes, aliased=stats.alias_size_in_bytes)


def _reported_memory(compiled) -> ProgramMemory:
    memory = program_memory(compiled)
    if memory is None:
        raise PlanError("this backend reports no memory analysis of a compiled program, so its memory cannot be planned.")
    return memory


def program_peak_bytes(compiled) -> int:
    """Peak bytes one device holds while a compiled program runs (``ProgramMemory.peak``)."""
    return _reported_memory(compiled).peak


def compile_programs(exp, iteration):
    """``iteration``'s rollout and update (``train.jit_iteration``'s, the jitted functions the run
    calls) compiled for abstract inputs as the run places them, the update at the largest layout a
    batch can take (``planned_layout``): (compiled collect, compiled learn, abstract sharded train
    state, abstract inputs of the rollout). The rollout reads the train state on ``exp.mesh``, or
    one step off, the sampler's copies (``sampler_inputs``)."""
    with sharding.use_mesh(exp.mesh):
        state = jax.eval_shape(lambda m: init_train_state(exp.settings, m, jax.random.PRNGKey(0)), exp.model)
        state = _abstract(state, sharding.shardings(state, exp.mesh))
    stale = bool(exp.config.trainer.staleness)
    inputs = sampler_inputs(exp, state) if stale else (state, exp.train_tables, jax.ShapeDtypeStruct((2,), jnp.uint32))
    with sharding.use_mesh(exp.rollout_mesh or exp.mesh):
        collect_c = iteration.collect.lower(*inputs).compile()
        traj = jax.eval_shape(iteration.collect, *inputs)
    with sharding.use_mesh(exp.mesh):  # the batch moves to the trainer's rows (OneStepOff.next)
        traj = _abstract(traj, sharding.row_shardings(traj, exp.mesh) if stale else collect_c.output_shardings)
        learn_c = iteration.learn.lower(state, traj, exp.hyper, planned_layout(exp)).compile()
    return collect_c, learn_c, state, inputs


def planned_layout(exp):
    """The update layout the plan compiles: the largest any batch of the run can take
    (``forward.largest_update_layout``), so every layout the run picks needs at most its memory."""
    return largest_update_layout(exp.train_plan, exp.train_tables, exp.settings.micro_batch_size)


def sampler_inputs(exp, state) -> tuple:
    """A one-step-off rollout's abstract inputs, placed as ``batches.OneStepOff`` places them on the
    sampler's mesh: the policy's copy (``batches.sampler_view``), the tables and the key whole."""
    mesh = exp.rollout_mesh or exp.mesh
    view = batches.sampler_view(state, state.step).replace(base=state.base)
    tables_key = (exp.train_tables, jax.ShapeDtypeStruct((2,), jnp.uint32))
    tables, key = _abstract(tables_key, batches.whole_on(mesh, tables_key))
    return _abstract(view, sharding.shardings(view, mesh)), tables, key


def kv_bytes_per_token(model_config, backend: str | None = None) -> int:
    """Bytes one token takes in the KV cache (``KVCache``) on ``backend`` (default: the current
    one): a key and a value per layer and kv head, in the cache's dtype (``decoder.cache_dtype``)."""
    c = model_config
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * cache_dtype(c, backend).itemsize


def kv_cache_bytes(model_config, rows: int, length: int) -> int:
    """Bytes of a KV cache of ``rows`` rows of ``length`` slots (``KVCache.init``)."""
    return rows * length * kv_bytes_per_token(model_config)


def rollout_kv_cache_bytes(exp) -> int:
    """Keys and values of the rollout per device: rows split over the sampling mesh's data × fsdp,
    kv heads whole."""
    plan, mesh = exp.train_plan, exp.rollout_mesh or exp.mesh
    return kv_cache_bytes(exp.model.merge().config, plan.batch_size // sharding.rows_per_mesh(mesh), plan.max_len)


def iteration_program(exp) -> tuple:
    """What a run's jitted iteration is a function of (``make_train_step``'s static arguments): two
    experiments with equal ones run the same programs on the same shapes."""
    return exp.settings, exp.model.graphdef, exp.train_plan


def plan_programs(exp):
    """The memory plan of a built experiment (its model may be abstract), and the run's iteration
    (``train.jit_iteration``) whose rollout is the program the plan compiled: a run of an equal
    ``iteration_program`` calls it instead of compiling its rollout again."""
    iteration = jit_iteration(make_train_step(*iteration_program(exp)), exp.settings, exp.train_plan)
    collect_c, learn_c, state, inputs = compile_programs(exp, iteration)
    return _memory_plan(exp, collect_c, learn_c, state, inputs), iteration._replace(collect=collect_c)


def plan_memory(exp) -> MemoryPlan:
    """The memory plan of a built experiment (its model may be abstract)."""
    return plan_programs(exp)[0]


def _memory_plan(exp, collect_c, learn_c, state, inputs) -> MemoryPlan:
    runtime = resident_bytes()
    rollout, update = _reported_memory(collect_c), _reported_memory(learn_c)
    train_state = _bytes_per_device(state)
    weights, tables, _ = inputs
    if exp.config.trainer.staleness:
        # While batch t+1 samples, batch t and the policy that sampled it are still held (its
        # template-collapse figures are scored by them): two policies, two batches.
        rollout_peak = 2 * _bytes_per_device(weights) + _bytes_per_device(tables) + 2 * rollout.outputs
    else:
        # jit drops the inputs a program does not read (the rollout reads the policy only), but the
        # whole train state stays resident while it runs.
        rollout_peak = train_state + _bytes_per_device(tables) + rollout.outputs
    return MemoryPlan(
        mesh=dict(exp.mesh.shape),
        train_state=train_state,
        kv_cache=rollout_kv_cache_bytes(exp),
        rollout_temp=rollout.temporaries,
        rollout_peak=rollout_peak + rollout.temporaries,
        update_temp=update.temporaries,
        update_peak=update.peak,
        micro_rows=exp.settings.micro_batch_size // sharding.rows_per_mesh(exp.mesh),
        remat=exp.model.merge().config.remat,
        # CPU: the host's memory is the devices'; measured after compiling, as the run holds its programs.
        runtime=runtime if exp.mesh.devices.flat[0].platform == "cpu" else 0,
        rollout_mesh=dict(exp.rollout_mesh.shape) if exp.rollout_mesh is not None else None,
        concurrent=bool(exp.config.trainer.staleness) and exp.rollout_mesh is None,
        here=(_here(exp.rollout_mesh), _here(exp.mesh)),
    )


def _here(mesh) -> int:
    """How many of ``mesh``'s devices are this process's (0 for no mesh)."""
    return 0 if mesh is None else sum(d.process_index == jax.process_index() for d in mesh.devices.flat)


def device_budget(devices) -> int | None:
    """The memory one accelerator may use (the smallest over ``devices``); None for CPU devices,
    whose memory is the host's RAM, shared and not fixed."""
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    known = [limit for limit in limits if limit is not None]
    return None if len(known) < len(limits) else min(known)


def free_bytes_per_device(devices) -> int | None:
    """The memory each of ``devices`` can still allocate, the least over them: an accelerator's
    limit less what it holds now; CPU devices share the host's available memory (MemAvailable) in
    equal parts. None on a CPU host without /proc."""
    stats = [d.memory_stats() or {} for d in devices]
    if all("bytes_limit" in s for s in stats):
        return min(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    available = available_bytes()
    return None if available is None else available // len(devices)


def device_peak(devices) -> int | None:
    """The most memory any of ``devices`` has held at once so far (the allocator's
    ``peak_bytes_in_use``); None for CPU devices, which do not count it."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    known = [peak for peak in peaks if peak is not None]
    return None if len(known) < len(peaks) else max(known)


# ---- the host: on CPU a run's memory is its process's (runtime.host_memory reads /proc) ----------

# What the CPU estimate (runtime + peak) leaves out, said where it is printed. The runs measured
# against their plan (docs/scaling.md, "On a CPU host"; docs/benchmarks.md; tests/test_plan.py holds
# a run to it): said wherever the plan is printed, in one wording.
MEASURED = "measured runs peaked at up to 1.55 x this"
MEASURED_OVER_PLAN = f"{MEASURED} (programs beyond the plan's two, allocator slack)"
HOST_LEAVES_OUT = (f"not counted ({MEASURED}): the programs a run compiles beyond these two "
                   "(validation, each update width), the allocator's kept pages, the export's copies.")


@dataclasses.dataclass(frozen=True)
class Fit:
    """``check_fits``'s answer for a run that fits: the plan, the memory it was checked against, and
    the run's iteration with the plan's compiled rollout."""

    plan: MemoryPlan
    available: int | None  # CPU: the host's available memory the plan was checked against; else None
    iteration: Any  # train.JittedIteration, its collect the program the plan compiled
    program: tuple  # iteration_program of the planned experiment

    def iteration_for(self, exp):
        """The planned iteration if ``exp`` (built with the real weights) runs the planned programs,
        else None: a loaded model whose structure differs from the planner's (a checkpoint's
        config.json against a preset, say) gets programs of its own."""
        return self.iteration if iteration_program(exp) == self.program else None


def check_fits(config, available: int | None = None) -> Fit | None:
    """``experiments.run``'s check before anything is allocated: plan on the real devices and raise
    ``PlanError`` (with the knob to turn) when the peak exceeds a device's memory. On CPU devices
    the budget is the host's available memory (``available``, default MemAvailable), measured after
    planning, so what the planning compiles already holds is no longer in it. None where nothing can
    be checked (a CPU host without /proc, or a model source only loading can read).
    ``config``: a config or ``experiment.check_config``'s result (then it is not checked again)."""
    devices = jax.local_devices()  # every process checks its own
    budget = device_budget(devices)
    if budget is None and available is None and available_bytes() is None:
        return None  # a CPU host without /proc: nothing to check against
    try:
        exp = build_experiment(config, load=abstract_policy)
    except PlanError:
        if budget is not None:
            raise
        return None  # CPU: a source the planner cannot read without loading (e.g. a missing file) is the load's to report
    plan, iteration = plan_programs(exp)
    if budget is not None:
        if plan.peak_here > budget:
            raise PlanError(f"the run does not fit in device memory.\n{plan.report(budget)}")
        available = None  # an accelerator's memory is its own, not the host's
    else:  # CPU: the devices share the host's memory, and this process already holds its runtime.
        available = available_bytes() if available is None else available
        assert available is not None  # checked above: this host has /proc/meminfo
        # This process's devices: with a split, those of each part it holds (sampling, training or both)
        needed = plan.host_peak - plan.runtime
        if needed > available:
            _, knob = plan.largest_part()
            raise PlanError(
                f"the run needs {gib(needed)} of host memory beyond this process's "
                f"{gib(plan.runtime)}, but only {gib(available)} is available: {knob}.\n"
                f"{plan.report(available // len(devices))}"
            )
    return Fit(plan, available, iteration, iteration_program(exp))
