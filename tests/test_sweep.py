"""How many sweep settings train at a time: XLA's memory estimate of the compiled step decides."""

import sys
import types

import jax
import numpy as np
import pytest

from experiments import sweep

GIB = 2**30


def fake_compile(per_setting: float, shared: float = 0.0):
    """compile_for(size) whose program needs ``shared + size * per_setting`` GiB; records sizes."""
    sizes = []

    def compile_for(size):
        sizes.append(size)
        need = int((shared + size * per_setting) * GIB)
        return types.SimpleNamespace(need=need)

    return compile_for, sizes


def test_all_settings_at_once_when_they_fit():
    compile_for, sizes = fake_compile(per_setting=2.0)
    size, _ = sweep.fit_in_memory(compile_for, 4, free=16 * GIB)  # 8 GiB needed, 12.8 allowed
    assert size == 4 and sizes == [4]


def test_as_many_as_fit_then_group_after_group():
    # the README's quick-start sweep on a 24 GB machine with 15 GiB free: ~5.9 GiB per setting
    compile_for, sizes = fake_compile(per_setting=5.9)
    size, _ = sweep.fit_in_memory(compile_for, 4, free=15 * GIB)
    assert size == 2 and sizes == [4, 2]


def test_refuses_in_one_sentence_when_one_setting_does_not_fit():
    compile_for, _ = fake_compile(per_setting=3.0, shared=10.0)
    with pytest.raises(MemoryError, match=r"One sweep setting needs about 13.0 GiB .* reduce envs.train.n_groups"):
        sweep.fit_in_memory(compile_for, 2, free=12 * GIB)


def test_every_setting_at_once_where_free_memory_is_unknown():
    compile_for, sizes = fake_compile(per_setting=2.0)
    size, _ = sweep.fit_in_memory(compile_for, 4, free=None)  # a CPU host without /proc
    assert size == 4 and sizes == [4]


@pytest.mark.parametrize("spec, message", [
    ("actor.lr=-1e-6,1e-6", "--sweep 'actor.lr=-1e-6,1e-6': actor.lr must be >= 0, not -1e-06."),
    ("filter.ratio=0,1", "--sweep 'filter.ratio=0,1': filter.ratio must be in (0, 1], not 0.0."),
])
def test_every_swept_value_is_checked_as_the_config_checks_it(spec, message):
    with pytest.raises(ValueError) as err:
        sweep.parse_sweeps([spec])
    assert str(err.value) == message


def test_an_earlier_sweep_log_is_kept_unless_overwrite(tmp_path):
    from starpo_jax.runtime.experiment import ConfigError

    sweep.check_sweep_log(tmp_path, overwrite=False)  # an empty folder is fine
    (tmp_path / "sweep.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="earlier sweep.*trainer.overwrite=True"):
        sweep.check_sweep_log(tmp_path, overwrite=False)
    sweep.check_sweep_log(tmp_path, overwrite=True)
    assert (tmp_path / "sweep.jsonl").read_text() == '{"step": 1}\n'  # the check itself deletes nothing


def test_a_setting_that_cannot_fit_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """The sweep checks its config and plans one setting as ``experiments.run`` does
    (``planning.check_fits``) before it loads anything."""
    from helpers import TINY
    from starpo_jax.runtime import experiment, planning

    planned = []

    def does_not_fit(checked):
        planned.append(checked)
        raise planning.PlanError("the run does not fit in device memory.")

    monkeypatch.setattr(sweep, "check_fits", does_not_fit)
    monkeypatch.setattr(sweep, "build_experiment", lambda *args, **kwargs: pytest.fail("the model loaded"))
    argv = ["sweep", *TINY, f"--config.trainer.output_dir={tmp_path}", "--sweep", "filter.ratio=0.25,1.0"]
    monkeypatch.setattr(sys, "argv", argv)
    sweep.FLAGS(argv)
    try:
        assert sweep.main([]) == 2
    finally:
        sweep.FLAGS.unparse_flags()
    assert capsys.readouterr().err.strip() == "error: the run does not fit in device memory."
    (checked,) = planned
    assert isinstance(checked, experiment.CheckedConfig) and checked.config.filter.ratio == 1.0  # the largest batch


def test_a_sweep_step_with_the_batchs_layout_gives_the_full_layouts_metrics(smollm2_tokenizer):
    """The sweep's iteration (rollout vmapped over the settings, one layout for all of them picked
    on the host, update vmapped with it) gives each setting the metrics of the vmapped full-layout
    step, today's ``step`` on the same key: the same rollout, and the same attention in matmuls of
    other shapes. Their float32 rounding (ε = 1.2e-7) over sums of a few hundred terms (attention
    over ≤ 320 positions, 64-wide hidden states, a 49k vocabulary's softmax) is ~100 ulps relative:
    rtol 2e-5; atol 1e-6 where a metric is a mean that cancels to ~0 (the KL at the old policy).
    Compared on the second step, when the two learning rates have moved the settings apart."""
    import dataclasses

    import envs_jax
    from helpers import tiny_llama_for
    from starpo_jax.rollout.multi_turn import RolloutPlan, TagPlan, build_tables, stop_tokens_for
    from starpo_jax.train import (
        Hyperparams,
        TrainSettings,
        init_train_state,
        jit_iteration,
        make_train_step,
        replicate,
    )

    plan = RolloutPlan(
        tags=(TagPlan("Bandit", envs_jax.make("Bandit"), 2, 1),), group_size=4, max_turn=1,
        max_actions_per_turn=1, response_length=8, max_len=320, enable_think=False,
    )
    tables = build_tables(smollm2_tokenizer, plan)
    plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(smollm2_tokenizer, tables))
    model = tiny_llama_for(smollm2_tokenizer)
    # GAE with a KL loss: the old log-probs, the reference's and the critic's values all computed
    settings = TrainSettings(adv_estimator="gae", use_kl_loss=True, reward_method="mean_std", kept_groups=2,
                             ppo_mini_batch_size=8, micro_batch_size=4, logprob_chunk=16)
    hyper = Hyperparams.create(actor_lr=1e-3, critic_lr=1e-3, entropy_coeff=0.0, kl_loss_coef=0.1, filter_ratio=1.0)
    hypers = sweep.swept_hyper(hyper, [{"actor.lr": 0.0, "filter.ratio": 0.5}, {"actor.lr": 3e-2, "filter.ratio": 1.0}])
    step = make_train_step(settings, model.graphdef, plan)
    states, axes = replicate(init_train_state(settings, model, jax.random.PRNGKey(0)), 2)
    iteration = jit_iteration(step, settings, plan, axes)
    key = jax.random.PRNGKey(3)
    states, _ = iteration(states, tables, hypers, key)

    fused = jax.jit(jax.vmap(step.step, in_axes=(axes, None, 0, None), out_axes=(axes, 0)))
    _, full = fused(states, tables, hypers, key)
    traj = iteration.collect(states, tables, key)
    layout = iteration.layout(traj)
    assert 0 < layout.prefix and layout.prefix + layout.width < plan.max_len  # less than every position
    _, metrics = iteration.learn(states, traj, hypers, layout)  # donates states: last
    assert set(metrics) == set(full)
    for name in full:
        np.testing.assert_allclose(metrics[name], full[name], rtol=2e-5, atol=1e-6, err_msg=name)
    assert float(full["rollout/filter_kept_groups"][0]) == 1 and float(full["rollout/filter_kept_groups"][1]) == 2
