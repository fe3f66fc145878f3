"""The memory planner: its figures for a tiny config are those of the programs that really run, it
names the knob to turn when a run does not fit, and its command line fails with one sentence."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from configs import base
from helpers import TINY_BANDIT, command_env, config_flags
from starpo_jax.rollout.multi_turn import longest_trajectory
from starpo_jax.runtime import host_memory
from starpo_jax.runtime import planning as planner
from starpo_jax.runtime.experiment import build_experiment

REPO = Path(__file__).resolve().parents[1]

TINY = {**TINY_BANDIT, "rollout.enable_think": False}


def test_planner_figures_are_those_of_the_programs_that_run():
    """Plan with abstract weights, then build the real run (weights allocated), compile and run its
    rollout and update: the same bytes, since the same programs are compiled for the same shapes."""
    from starpo_jax.runtime import sharding
    from starpo_jax.train import init_train_state, make_train_step

    config = base.with_overrides(base.get_config(), TINY)
    plan = planner.plan_memory(build_experiment(config, load=planner.abstract_policy))

    exp = build_experiment(config)
    step_fn = make_train_step(exp.settings, exp.model.graphdef, exp.train_plan)
    collect, learn = jax.jit(step_fn.collect), jax.jit(step_fn.learn, donate_argnums=0, static_argnums=3)
    key = jax.random.PRNGKey(0)
    with sharding.use_mesh(exp.mesh):
        state = sharding.shard(init_train_state(exp.settings, exp.model, key), exp.mesh)
        state_bytes = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
        collect_c = collect.lower(state, exp.train_tables, key).compile()
        traj = collect_c(state, exp.train_tables, key)
        learn_c = learn.lower(state, traj, exp.hyper, planner.planned_layout(exp)).compile()
        new_state, metrics = learn_c(state, traj, exp.hyper)
    assert int(new_state.step) == 1 and bool(jax.numpy.isfinite(metrics["actor/pg_loss"]))

    rollout, update = collect_c.memory_analysis(), learn_c.memory_analysis()
    assert rollout is not None and update is not None  # the CPU backend reports them
    assert plan.train_state == state_bytes
    assert plan.rollout_temp == rollout.temp_size_in_bytes
    assert plan.update_temp == update.temp_size_in_bytes
    assert plan.update_peak == planner.program_peak_bytes(learn_c)
    # The rollout's working memory holds its KV cache (2 · layers · rows · kv heads · length · head dim · 4 B),
    # its length the longest trajectory the prompts allow (one Bandit turn: ~210 tokens), not max_model_len.
    c, length = exp.model.merge().config, longest_trajectory(exp.train_plan, exp.train_tables)
    assert exp.train_plan.max_len == length < 320
    assert plan.kv_cache == 2 * c.num_layers * 4 * c.num_kv_heads * length * c.head_dim * 4
    assert plan.kv_cache <= plan.rollout_temp
    # The update donates the state: its buffers are reused for the new state.
    assert update.alias_size_in_bytes >= state_bytes - 64


def test_an_experiment_built_twice_checks_its_envs_and_tokenizes_its_prompts_once(monkeypatch):
    """``experiments.run`` checks the config, plans without weights, then builds the run: the env
    contract is checked once per env (training and validation share Bandit here), and the prompt
    tables are tokenized once, the real build reusing the planner's."""
    from starpo_jax.runtime import experiment

    checked_tags = []
    monkeypatch.setattr(experiment, "_CHECKED_ENVS", set())
    monkeypatch.setattr(experiment, "check_env", lambda env, tag: checked_tags.append(tag))
    config = base.with_overrides(base.get_config(), TINY)
    checked = experiment.check_config(config)
    experiment.check_config(config)
    assert checked_tags == ["Bandit"]
    planned, real = build_experiment(checked, load=planner.abstract_policy), build_experiment(checked)
    assert real.train_tables is planned.train_tables and real.val_tables is planned.val_tables
    other = base.with_overrides(config, {"envs.prompt_max_tokens": 50})  # the prompt states another length
    assert build_experiment(other, load=planner.abstract_policy).train_tables is not planned.train_tables


@pytest.mark.slow  # two planner compiles, ~1 min on 2 loaded cores; tests/models/test_remat.py checks the same on the decoder's gradient
def test_remat_lowers_the_updates_working_memory():
    """The real update of the tiny run with groups of one row (3 layers, 2 rows of T ≈ 210 tokens per
    gradient pass, each its own first prompt): without remat its backward pass keeps every layer's
    float32 attention probabilities [rows, heads, T, T]; recomputing each layer keeps one layer's at
    a time."""
    unshared = {**TINY, "envs.train.n_groups": (4,), "envs.train.group_size": 1}
    configs = {remat: base.with_overrides(base.get_config(), {**unshared, "model.remat": remat}) for remat in ("none", "layer")}
    exps = {remat: build_experiment(config, load=planner.abstract_policy) for remat, config in configs.items()}
    plans = {remat: planner.plan_memory(exp) for remat, exp in exps.items()}
    c, T = planner.model_config_and_tokenizer(configs["none"])[0], exps["none"].train_plan.max_len
    assert planner.planned_layout(exps["none"]).width == T  # nothing shared: every position of every row
    one_layer_probabilities = 2 * c.num_heads * T * T * 4
    assert plans["none"].update_temp - plans["layer"].update_temp >= (c.num_layers - 1) * one_layer_probabilities
    assert plans["none"].rollout_temp == plans["layer"].rollout_temp  # decoding has no backward pass
    assert (plans["none"].remat, plans["layer"].remat) == ("none", "layer")


def test_the_planned_update_layout_holds_a_batch_whose_answers_run_to_their_budget():
    """The plan compiles the update at the largest layout any batch can take, from the prompt tables'
    widths: rows of a random model, whose answers run to their budget, of two env tags whose first
    prompts differ by ~50 tokens, over two turns, fit it; and it is smaller than every position of
    every row, since a micro-batch's rows share their first prompt."""
    from starpo_jax.forward import first_prompt_split, full_layout, update_layout
    from starpo_jax.runtime import sharding
    from starpo_jax.train import init_train_state, jit_iteration, make_train_step

    mixed = {**TINY, "envs.train.tags": ("FrozenLake", "Bandit"), "envs.train.n_groups": (1, 1),
             "rollout.max_turn": 2, "rollout.max_model_len": 1024}
    exp = build_experiment(base.with_overrides(base.get_config(), mixed))
    plan, tables, micro = exp.train_plan, exp.train_tables, exp.settings.micro_batch_size
    planned = planner.planned_layout(exp)
    firsts = sorted(t.prompts.first_len for t in tables.tags)
    assert firsts[1] - firsts[0] > 40 and planned.prompts == 1
    iteration = jit_iteration(make_train_step(*planner.iteration_program(exp)), exp.settings, plan)
    with sharding.use_mesh(exp.mesh):
        state = sharding.shard(init_train_state(exp.settings, exp.model, jax.random.PRNGKey(0)), exp.mesh)
        traj = iteration.collect(state, tables, jax.random.PRNGKey(1))
    length, split = (np.asarray(x) for x in (traj.length, first_prompt_split(traj)))
    assert (np.asarray(traj.num_turns) == 2).any()
    assert split.max() <= planned.prefix and (length - split).max() <= planned.width
    layout = update_layout(traj, plan, micro)
    assert layout == planned  # answers that run to their budget take the largest layout: the bound is tight
    full = full_layout(plan.max_len)
    assert planned.prompts * planned.prefix + micro * planned.width < micro * full.width


def _plan(**parts):
    figures = dict(mesh={"data": 1, "fsdp": 1, "model": 1}, train_state=10, kv_cache=1, rollout_temp=2,
                   rollout_peak=13, update_temp=3, update_peak=14)
    return planner.MemoryPlan(**{**figures, **parts})


def test_advice_names_the_knob_for_the_largest_part():
    assert _plan().advice(budget=20) is None and "fits" in _plan().report(20)
    assert "mesh.fsdp" in _plan().advice(budget=12)
    assert "micro_batch_size (4 rows" in _plan(update_temp=50, update_peak=62, micro_rows=4).advice(budget=20)
    assert "max_model_len" in _plan(update_temp=50, update_peak=62, micro_rows=1).advice(budget=20)
    for remat in ("none", "dots"):  # recomputing each layer comes before smaller passes
        assert "model.remat=layer" in _plan(update_temp=50, update_peak=62, micro_rows=4, remat=remat).advice(20)
    assert "max_model_len" in _plan(kv_cache=40, rollout_temp=41, rollout_peak=52).advice(budget=20)
    assert "does NOT fit" in _plan().report(12)


def test_parse_bytes():
    assert planner.parse_bytes("80GiB") == 80 * 2**30
    assert planner.parse_bytes("24GB") == 24 * 10**9
    assert planner.parse_bytes("16e9") == 16 * 10**9
    for text in ("lots", "0", "0GiB", "1.2.3GiB"):  # none of these is a memory to plan for
        with pytest.raises(planner.PlanError, match="is not a size"):
            planner.parse_bytes(text)


def test_cli_help_and_bad_input():
    cmd = [sys.executable, "-m", "experiments.plan"]
    assert subprocess.run(cmd + ["--help"], cwd=REPO, capture_output=True, timeout=120).returncode == 0
    proc = subprocess.run(cmd + ["--device-memory=lots"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --device-memory 'lots' is not a size; write e.g. 80GiB, 24GB or 16e9."
    ]
    # No --config: ml_collections reads the default config with the overrides as the flag is defined.
    proc = subprocess.run(cmd + ["--config.rollout.max_trun=1"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --config.rollout.max_trun: config key 'max_trun' does not exist (see configs/base.py). "
        'Did you mean "max_turn" instead of "max_trun"?']


def test_a_config_error_is_the_only_line_on_stderr():
    """No jax log line about backends it looked for (absl shows INFO): the error alone."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}  # as a user runs it
    proc = subprocess.run([sys.executable, "-m", "experiments.plan", "--config.envs.train.tags=('Nope',)"],
                          cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: envs.train.tags: unknown env 'Nope'.")


# The tiny config as a run: one training step, one validation, no export.
MEASURED_RUN = ["--config=configs/base.py", *config_flags(TINY),
    "--config.trainer.total_steps=1", "--config.trainer.test_freq=1", "--config.trainer.val_before_train=False",
    "--config.trainer.export_hf=False"]
PEAK = ("import resource, runpy, sys\n"
        "try:\n    runpy.run_module('experiments.run', run_name='__main__')\n"
        "except SystemExit as e:\n    code = e.code\n"
        "print(f'peak rss {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}', file=sys.stderr)\n"
        "sys.exit(code)\n")


@pytest.mark.slow  # one tiny run in a subprocess, ~2-4 min on 2 loaded cores
def test_cpu_estimate_holds_the_measured_peak(tmp_path):
    """On CPU the run prints the planner's estimate of its peak resident memory (the runtime it
    measured after compiling + the programs' peak); the process's measured peak (ru_maxrss) is at
    least that, and at most 1.25 x: the estimate leaves out the programs the run compiles beyond the
    plan's two, the allocator's kept pages and the export's copies, which it says in one line.
    Measured runs came to 1.20 x (docs/scaling.md); 1.25 leaves room for the allocator's variation."""
    # A first run as users run it: the caches on (the default) but empty.
    env = command_env(STARPO_JAX_CACHE=str(tmp_path / "cache"))
    proc = subprocess.run([sys.executable, "-c", PEAK, *MEASURED_RUN, f"--config.trainer.output_dir={tmp_path}"],
                          cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("host memory: about "))
    estimate = float(line.split()[3]) * 2**30
    measured = int(proc.stderr.rsplit("peak rss ", 1)[1].split()[0])
    print(f"estimate {estimate / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB")
    assert estimate <= measured <= 1.25 * estimate, (line, measured)


def test_a_cpu_run_that_does_not_fit_the_host_is_refused_in_one_sentence():
    """The CPU check: the plan against the host's available memory (injected here: 1 MiB)."""
    config = base.with_overrides(base.get_config(), TINY)
    with pytest.raises(planner.PlanError) as err:
        planner.check_fits(config, available=2**20)
    sentence = str(err.value).splitlines()[0]
    assert sentence.startswith("the run needs ") and "but only 0.00 GiB is available: " in sentence
    assert "lower" in sentence or "raise" in sentence  # names the knob


def test_a_run_calls_the_programs_its_memory_check_compiled(caplog):
    """``check_fits`` hands the run its iteration: the model loaded with real weights has the planned
    structure, the rollout is the plan's compiled program (which refuses inputs of other shapes or
    shardings), and the update at the plan's layout runs without compiling again."""
    from starpo_jax.runtime import sharding
    from starpo_jax.runtime.experiment import check_config
    from starpo_jax.train import init_train_state

    checked = check_config(base.with_overrides(base.get_config(), TINY))
    fit = planner.check_fits(checked, available=64 * 2**30)
    assert fit is not None and fit.available == 64 * 2**30 and fit.plan.runtime > 0  # fits: the plan, with the host's runtime
    exp = build_experiment(checked)
    iteration = fit.iteration_for(exp)
    assert iteration is fit.iteration and isinstance(iteration.collect, jax.stages.Compiled)
    key = jax.random.PRNGKey(0)
    with jax.log_compiles(True), sharding.use_mesh(exp.mesh):
        state = sharding.shard(init_train_state(exp.settings, exp.model, key), exp.mesh)
        traj = iteration.collect(state, exp.train_tables, key)
        state, metrics = iteration.learn(state, traj, exp.hyper, planner.planned_layout(exp))
        jax.jit(lambda x: x + 1)(1.0)  # a compile, seen: the log is read
    assert int(state.step) == 1 and bool(jax.numpy.isfinite(metrics["actor/pg_loss"]))
    compiled = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling jit(")]
    assert any(m.startswith("Compiling jit(<lambda>)") for m in compiled), compiled
    assert not [m for m in compiled if m.startswith(("Compiling jit(collect)", "Compiling jit(learn)"))], compiled
    qwen = planner.abstract_policy(base.with_overrides(checked.config, {"model.random_init_preset": "tiny-qwen2"}))[0]
    assert fit.iteration_for(dataclasses.replace(exp, model=qwen)) is None  # another structure: the run jits its own


def test_proc_readers():
    assert host_memory.available_bytes("MemTotal:  100 kB\nMemAvailable:   2048 kB\n") == 2 * 2**20
    assert host_memory.resident_bytes("VmHWM:\t 9 kB\nVmRSS:\t  3 kB\n") == 3 * 2**10
    assert host_memory.peak_resident_bytes("VmHWM:\t 9 kB\nVmRSS:\t  3 kB\n") == 9 * 2**10
    available = host_memory.available_bytes()
    assert available is not None and available > 0
    assert host_memory.peak_resident_bytes() >= host_memory.resident_bytes() > 0


def test_a_gguf_file_is_planned_from_its_header():
    """A local .gguf source (here the bundled file by its path) plans without dequantising a weight."""
    from starpo_jax.models import bundled

    config = base.with_overrides(base.get_config(), {**TINY, "model.random_init_preset": "",
                                                     "model.source": str(bundled.smollm2_gguf_path())})
    got = planner.model_config_and_tokenizer(config)[0]
    want = planner.model_config_and_tokenizer(base.with_overrides(config, {"model.source": "smollm2-135m-instruct"}))[0]
    shape = ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "vocab_size", "intermediate_size")
    assert [getattr(got, f) for f in shape] == [getattr(want, f) for f in shape]


class _Device:
    def __init__(self, stats):
        self.stats = stats

    def memory_stats(self):
        return self.stats


def test_free_bytes_per_device_is_the_least_any_device_can_still_allocate(monkeypatch):
    """An accelerator has its limit less what it holds; CPU devices split the host's available
    memory between them, and without /proc there is nothing to split."""
    gpus = [_Device({"bytes_limit": 20, "bytes_in_use": 5}), _Device({"bytes_limit": 16, "bytes_in_use": 4})]
    assert planner.free_bytes_per_device(gpus) == 12
    cpus = jax.devices("cpu")[:1] * 4
    monkeypatch.setattr(planner, "available_bytes", lambda: 10 * 2**30)
    assert planner.free_bytes_per_device(cpus) == 10 * 2**30 // 4
    monkeypatch.setattr(planner, "available_bytes", lambda: None)
    assert planner.free_bytes_per_device(cpus) is None


def test_kv_cache_bytes_are_those_of_the_cache_the_sampler_allocates():
    from starpo_jax.models import KVCache, preset

    for name, dtype in (("tiny-llama", "float32"), ("tiny-qwen2", "bfloat16")):
        config = preset(name, dtype=dtype)
        cache = jax.eval_shape(lambda: KVCache.init(config, 3, 40))
        allocated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves((cache.k, cache.v)))
        assert planner.kv_cache_bytes(config, rows=3, length=40) == allocated, name
        assert planner.kv_bytes_per_token(config) * 3 * 40 == allocated, name


def test_a_programs_peak_counts_a_donated_buffer_once():
    """Its input and output: 2 MiB kept apart, 1 MiB when the output is written into the donated input."""
    x = jax.ShapeDtypeStruct((1024, 256), jax.numpy.float32)  # 1 MiB
    donated = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
    kept = jax.jit(lambda a: a * 2).lower(x).compile()
    assert planner.program_peak_bytes(kept) >= 2 * 2**20
    assert 2**20 <= planner.program_peak_bytes(donated) < planner.program_peak_bytes(kept)
    memory = planner.program_memory(donated)
    assert memory is not None and memory.aliased == 2**20


def test_device_peak_and_budget_read_the_allocator():
    """An accelerator's peak is its allocator's most bytes in use, the largest over devices; a CPU
    device counts none, and a run logs no peak there."""
    gpus = [_Device({"peak_bytes_in_use": 5, "bytes_limit": 20}), _Device({"peak_bytes_in_use": 7, "bytes_limit": 16})]
    assert planner.device_peak(gpus) == 7 and planner.device_budget(gpus) == 16
    assert planner.device_peak(jax.devices("cpu")) is None and planner.device_budget(jax.devices("cpu")) is None
