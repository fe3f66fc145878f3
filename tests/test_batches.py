"""One step off (``trainer.staleness=1``, ``starpo_jax.runtime.batches``): the first batch is fresh,
every later one is sampled by the weights the update before it started from, on the sampler's own
devices when ``mesh.rollout_devices`` gives it some; bad settings are refused in one sentence."""

import shutil
import subprocess
import sys
import tempfile

import jax
import numpy as np
import pytest

from helpers import REPO, TINY_BANDIT, command_env, config_flags, read_metrics, run, train_lines

# The tiny Bandit, one step off; a learning rate that moves every weight, so that a batch sampled
# by the updated weights cannot pass for one sampled by the initial ones.
STALE = {**TINY_BANDIT, "rollout.enable_think": False, "rollout.use_sampler_logprobs": True, "trainer.staleness": 1,
         "algorithm.adv_estimator": "grpo", "actor.lr": 1e-2}


def check_one_step_off(rollout_devices: int) -> None:
    """Two synchronous steps against two steps one step off, from the same initial state and key:
    batch 1 is the same, batch 2 is what the initial weights sample for step 2 and not what the
    once-updated weights sample, and a checkpoint taken while batch 2 is in flight resumes into the
    same batch 2. With ``rollout_devices`` the batches are sampled on those devices and trained on
    the others."""
    from configs import base
    from starpo_jax.runtime import batches, checkpoint, planning, sharding
    from starpo_jax.runtime.experiment import build_experiment, check_config
    from starpo_jax.train import init_train_state, jit_iteration, make_train_step

    checked = check_config(base.with_overrides(base.get_config(), {**STALE, "mesh.rollout_devices": rollout_devices}))
    # The run's memory check compiles the sampler's rollout for the inputs OneStepOff gives it, and
    # hands it to the run (a compiled program refuses inputs of other shapes or placements).
    fit = planning.check_fits(checked, available=64 * 2**30)
    assert fit is not None and (fit.plan.rollout_mesh is not None) == bool(rollout_devices)
    exp = build_experiment(checked)
    planned = fit.iteration_for(exp)
    assert planned is not None and isinstance(planned.collect, jax.stages.Compiled)
    key = jax.random.PRNGKey(0)
    with sharding.use_mesh(exp.mesh):
        iteration = jit_iteration(make_train_step(exp.settings, exp.model.graphdef, exp.train_plan), exp.settings,
                                  exp.train_plan)

        def initial_state():  # a copy each: the update donates it, and the actor would be the model's own weights
            return sharding.shard(init_train_state(exp.settings, exp.model, jax.random.PRNGKey(1)), exp.mesh, copy=True)

        def learn(state, traj):
            return iteration.learn(state, traj, exp.hyper, iteration.layout(traj))[0]

        state, synchronous = initial_state(), []
        for _ in range(2):
            batch = batches.sample_now(iteration.collect, state, exp.train_tables, key)
            synchronous.append(jax.device_get(batch.traj))
            state = learn(state, batch.traj)
        # What the initial weights sample for step 2 (its levels and keys): a synchronous batch at step 1.
        initial_weights_step_2 = jax.device_get(iteration.collect(initial_state().replace(step=1), exp.train_tables, key))

        ahead = batches.OneStepOff(planned.collect, exp.train_tables, key, exp.mesh, exp.rollout_mesh)
        state, stale = initial_state(), []
        for more in (True, False):
            batch = ahead.next(state, more)
            stale.append(jax.device_get(batch.traj))
            if rollout_devices:  # sampled on the last devices, trained on the others (process 0's first)
                sampler_devices, trainer_devices = set(exp.rollout_mesh.devices.flat), set(exp.mesh.devices.flat)
                assert sampler_devices == set(jax.devices()[-rollout_devices:])
                assert sampler_devices.isdisjoint(trainer_devices)
                assert batch.sampled.tokens.sharding.device_set == sampler_devices
                assert all(w.sharding.device_set == sampler_devices for w in jax.tree.leaves(batch.sampler))
                assert batch.traj.tokens.sharding.device_set == trainer_devices
            state = learn(state, batch.traj)
            if more:  # a checkpoint now holds the weights of batch 2, in flight; resumed, they sample it again
                with tempfile.TemporaryDirectory() as folder:
                    mgr = checkpoint.manager(folder)
                    checkpoint.save(mgr, 1, state, {}, ahead.pending_actor)
                    restored = checkpoint.restore(mgr, state, like_pending=state.actor)
                resumed = batches.OneStepOff(planned.collect, exp.train_tables, key, exp.mesh, exp.rollout_mesh)
                resumed.resume(restored.state, restored.pending)
                resumed_batch_2 = jax.device_get(resumed.next(restored.state, more=False).traj)
        assert ahead.pending is None  # nothing is sampled past the last step

    def same(a, b) -> bool:
        return all(np.array_equal(getattr(a, f), getattr(b, f)) for f in ("tokens", "length", "sampler_logprobs"))

    assert same(stale[0], synchronous[0])  # the first batch is fresh
    assert same(stale[1], initial_weights_step_2)  # the second was sampled before the first update
    assert same(resumed_batch_2, stale[1])
    assert not np.array_equal(stale[1].sampler_logprobs, synchronous[1].sampler_logprobs)  # which moved the weights


def test_second_batch_is_sampled_by_the_initial_weights():
    check_one_step_off(rollout_devices=0)


def test_split_devices_sample_apart_and_one_step_off():
    """Two simulated devices, the second sampling, the first training."""
    script = "import test_batches; test_batches.check_one_step_off(rollout_devices=1)"
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO / "tests", capture_output=True, text=True,
                          timeout=600, env=command_env(devices=2, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_one_step_off_on_shared_devices_is_planned_with_both_programs_at_once():
    """Sharing the devices, the next batch's rollout may run beside the update: the plan counts both
    programs' memory at once, so memory that holds the synchronous run's peak is refused to it, in
    one sentence naming the knob. The rollout's part holds two copies of the policy (the batch being
    trained keeps the weights that sampled it), not the train state."""
    from configs import base
    from starpo_jax.runtime import planning
    from starpo_jax.runtime.experiment import build_experiment, check_config

    def plan(flags):
        exp = build_experiment(check_config(base.with_overrides(base.get_config(), flags)), load=planning.abstract_policy)
        return exp, planning.plan_memory(exp)

    synchronous = plan({**STALE, "trainer.staleness": 0})[1]
    exp, stale = plan(STALE)
    assert stale.concurrent and stale.peak == stale.rollout_peak + stale.update_peak > synchronous.peak
    policy = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(exp.model.params))
    assert stale.rollout_peak - stale.rollout_temp >= 2 * policy
    assert stale.rollout_peak - stale.rollout_temp < synchronous.rollout_peak - synchronous.rollout_temp  # no Adam moments
    holds_synchronous = synchronous.peak + (stale.peak - synchronous.peak) // 2
    assert planning.check_fits(check_config(base.with_overrides(base.get_config(), {**STALE, "trainer.staleness": 0})),
                               available=holds_synchronous) is not None
    with pytest.raises(planning.PlanError) as err:
        planning.check_fits(check_config(base.with_overrides(base.get_config(), STALE)), available=holds_synchronous)
    first = str(err.value).splitlines()[0]
    assert first.startswith("the run needs ") and "is available: " in first


def test_a_resumed_run_samples_the_batch_in_flight_again(tmp_path):
    """A one-step-off run killed after saving step 1 of 2: its checkpoint holds the weights that
    sampled batch 2 before update 1, and the resumed run samples batch 2 again with them, so its
    step 2 is the uninterrupted run's, exactly: the same programs on the same machine, fed the same
    bits. (Sampled by the restored, once-updated weights instead, batch 2 and its update differ.)"""
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    flags = config_flags({**STALE, "trainer.test_freq": 0, "trainer.export_hf": False, "trainer.log_trajectories": 0,
                          "trainer.save_freq": 1})
    run(*flags, f"--config.trainer.output_dir={whole}")
    shutil.copytree(whole, killed)
    shutil.rmtree(killed / "checkpoints" / "2")  # killed before step 2's checkpoint was written
    proc = run(*flags, f"--config.trainer.output_dir={killed}", "--config.trainer.resume=True")
    said = proc.stdout + proc.stderr
    assert "resumed from step 1" in said and "holds no batch in flight" not in said
    uninterrupted, resumed = (train_lines(read_metrics(out)) for out in (whole, killed))
    assert [r["step"] for r in resumed] == [1, 2]
    for key in ("train/reward/mean", "train/response_length", "actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"):
        assert uninterrupted[1][key] == resumed[1][key], key


def one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


@pytest.mark.parametrize("flags, devices, says", [
    ({"mesh.rollout_devices": 1}, 2, "mesh.rollout_devices=1 splits the devices so that the rollout runs while"),
    ({**STALE, "mesh.rollout_devices": 2}, 2, "mesh.rollout_devices=2 leaves no device to train on: 2 devices visible"),
    ({**STALE, "mesh.rollout_devices": 1, "mesh.data": 2}, 3,
     "Sampling on 1 device (mesh.rollout_devices=1): mesh.data × mesh.fsdp × mesh.model = 2 × 1 × 1 needs 2"),
    ({**STALE, "mesh.rollout_devices": 1, "envs.train.n_groups": (3,), "envs.train.group_size": 1,
      "actor.ppo_mini_batch_size": 3, "actor.micro_batch_size": 1}, 3,
     "Training on the other 2 devices (mesh.rollout_devices=1 of 3): the training batch (n_groups × group_size) (3)"),
])
def test_bad_staleness_settings_are_refused_in_one_sentence(flags, devices, says, tmp_path):
    """Before the model loads: the source named here does not exist."""
    proc = run(*config_flags(flags), "--config.model.source=/no/model.gguf", f"--config.trainer.output_dir={tmp_path}",
               check=False, devices=devices)
    assert says in one_line_error(proc)


def test_a_sweep_is_not_one_step_off(tmp_path):
    proc = run(*config_flags(STALE), "--config.model.source=/no/model.gguf", f"--config.trainer.output_dir={tmp_path}",
               "--sweep", "actor.lr=0,1e-3", check=False, module="experiments.sweep")
    assert "experiments.sweep samples each batch before its update" in one_line_error(proc)


def test_a_split_across_processes_needs_parts_of_equal_size(monkeypatch):
    """JAX moves an array between processes only onto as many devices, so with several processes the
    sampler and the trainer must have as many devices each; here 1 of 3 is refused, 2 of 4 is not."""
    from configs import base
    from starpo_jax.runtime import experiment

    config = base.get_config()
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    refused = "across processes the sampler and the trainer must have as many devices each"
    for k, visible, says in ((1, 3, "use an even number of devices"), (1, 4, "set it to 2")):
        config.mesh.rollout_devices = k
        monkeypatch.setattr(jax, "devices", lambda n=visible: jax.local_devices()[:1] * n)
        with pytest.raises(experiment.ConfigError) as error:
            experiment.device_meshes(config, {}, {})
        assert refused in str(error.value) and says in str(error.value), error.value
    config.mesh.rollout_devices = 2  # half of 4: a trainer's mesh and a sampler's of 2 devices each
    trainer, sampler = experiment.device_meshes(config, {}, {})
    assert trainer.devices.size == sampler.devices.size == 2
