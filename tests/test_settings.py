"""The settings table (starpo_jax/runtime/settings.py): each config key is declared once (the env sides
apart), and the config defaults, checks, update settings, hyperparameters and sweepable keys all
follow from it."""

import dataclasses
import math

import jax
import pytest

from configs import base
from helpers import TINY_BANDIT
from starpo_jax.algo import losses
from starpo_jax.models.config import ModelConfig
from starpo_jax.rollout.multi_turn import RolloutPlan, longest_trajectory, shared_head
from starpo_jax.runtime import experiment
from starpo_jax.runtime.settings import (
    BY_KEY,
    SECTIONS,
    SETTINGS,
    SWEEPABLE,
    UNDECLARED,
    ConfigError,
    Hyperparams,
    TrainSettings,
)

# The fields of TrainSettings that no config key sets: derived from the plan, or fixed.
UNSET_FIELDS = {"kept_groups", "logprob_chunk"}


def config_keys(config, sections):
    return [f"{section}.{key}" for section in sections for key in config[section]]


def test_every_config_key_has_exactly_one_declaration():
    config = base.get_config()
    assert SECTIONS == ("model", "envs", "rollout", "reward", "filter", "algorithm", "actor", "critic", "lora", "mesh",
                        "distributed", "trainer")
    assert sorted(SECTIONS) == sorted(config)  # every section of the config
    keys = [s.key for s in SETTINGS]
    declared = [k for k in config_keys(config, SECTIONS) if k not in UNDECLARED]
    assert sorted(declared) == sorted(keys)  # a repeated key fails too
    assert set(UNDECLARED) <= set(config_keys(config, ["envs"]))


def test_every_target_is_a_field_and_every_field_is_filled():
    fields = {
        "TrainSettings": {f.name for f in dataclasses.fields(TrainSettings)},
        "Hyperparams": {f.name for f in dataclasses.fields(Hyperparams)},
        "RolloutPlan": {f.name for f in dataclasses.fields(RolloutPlan)},
        "ModelConfig": {f.name for f in dataclasses.fields(ModelConfig)},
    }
    for s in SETTINGS:
        assert s.owner == "run" or s.field in fields[s.owner], s.key
    filled = {owner: {s.field for s in SETTINGS if s.owner == owner} for owner in fields}
    assert filled["TrainSettings"] == fields["TrainSettings"] - UNSET_FIELDS
    assert filled["Hyperparams"] == fields["Hyperparams"]


def test_train_settings_defaults_are_the_config_defaults():
    config = base.get_config()
    settings = experiment.train_settings(config, experiment.rollout_plan(config, "train"))
    assert settings == TrainSettings(kept_groups=settings.kept_groups)
    assert TrainSettings().lora_alpha == 64.0 and isinstance(TrainSettings().lora_alpha, float)
    assert TrainSettings().actor_betas == (0.9, 0.999)


def test_hyperparams_defaults_are_the_config_defaults():
    """``Hyperparams.create()`` (what tests build their hyperparameters from) is what a run of the
    default config trains with; a value given replaces its default only."""
    from_config = experiment.hyperparams(base.get_config())
    assert jax.tree.map(float, Hyperparams.create()) == jax.tree.map(float, from_config)
    changed = Hyperparams.create(actor_lr=3e-3)
    assert jax.tree.map(float, changed) == jax.tree.map(float, from_config.replace(actor_lr=jax.numpy.float32(3e-3)))


@pytest.mark.parametrize("cls", [TrainSettings, RolloutPlan])
def test_dataclass_defaults_are_the_table_defaults(cls):
    """A default written by hand in the class (not taken from SETTINGS) must not drift from the table."""
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    for s in SETTINGS:
        if s.owner == cls.__name__:
            expected = s.cast(s.default)
            assert (defaults[s.field], type(defaults[s.field])) == (expected, type(expected)), s.key


def test_the_rollout_plan_of_the_default_config_is_the_default_plan():
    config = base.get_config()
    plan = experiment.rollout_plan(config, "train")
    assert plan == RolloutPlan(tags=plan.tags, group_size=plan.group_size)
    assert plan.top_k == -1  # RAGEN's "no top-k", as given to the sampler (starpo_jax.rollout.sampling: <= 0 is off)


def test_sweepable_keys_are_the_hyperparameters():
    assert SWEEPABLE == {
        "actor.lr": "actor_lr",
        "critic.lr": "critic_lr",
        "lora.actor_lr": "actor_lr",
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
        "algorithm.gigpo_step_weight": "gigpo_step_weight",
    }


def test_choices_come_from_the_implementing_module():
    assert BY_KEY["actor.kl_loss_type"].choices == BY_KEY["algorithm.kl_penalty"].choices == losses.KL_KINDS
    assert "k3" in losses.KL_KINDS
    assert BY_KEY["actor.loss_agg_mode"].choices == losses.AGG_MODES


def test_lora_learning_rates_replace_the_full_ones():
    config = base.get_config()
    assert float(experiment.hyperparams(config).actor_lr) == pytest.approx(1e-6)
    config.lora.rank = 2
    hyper = experiment.hyperparams(config)
    assert (float(hyper.actor_lr), float(hyper.critic_lr)) == pytest.approx((1e-5, 1e-4))


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("actor.kl_loss_type", "k4", "actor.kl_loss_type = 'k4' is not one of kl, k1, abs, mse, k2, low_var_kl, k3."),
        ("algorithm.adv_estimator", "ppo", "algorithm.adv_estimator = 'ppo' is not one of gae, grpo, bilevel_gae, gigpo."),
        ("filter.ratio", 0.0, "filter.ratio must be in (0, 1], not 0.0."),
        ("rollout.max_turn", 0, "rollout.max_turn must be positive, not 0."),
        ("lora.rank", -1, "lora.rank must be a whole number >= 0 (0 = full fine-tuning), not -1."),
        ("actor.ppo_mini_batch_size", 12,
         "The update batch (2 kept groups × 16 = 32 trajectories) must split into mini-batches of "
         "actor.ppo_mini_batch_size (12), and those into micro-batches of actor.micro_batch_size (4); change "
         "filter.ratio, actor.ppo_mini_batch_size or actor.micro_batch_size."),
    ],
)
def test_a_bad_value_is_one_sentence_naming_the_key_and_what_it_may_be(key, value, message):
    config = base.with_overrides(base.get_config(), {key: value})
    with pytest.raises(ConfigError) as err:
        experiment.check_config(config)
    assert str(err.value) == message


def tiny_config(**changes):
    """One Bandit turn of 6 tokens for 2 groups of 2 on a tiny random model."""
    return base.with_overrides(base.get_config(), {**TINY_BANDIT, **changes})


@pytest.fixture(scope="module")
def k3():
    """(checked config, experiment built from it) with k3 (losses.KL_KINDS' name for low_var_kl) for
    both KL terms: a config the old checks refused. Building does not check the config again."""
    config = tiny_config(**{
        "algorithm.adv_estimator": "grpo", "algorithm.kl_in_reward": True, "algorithm.kl_penalty": "k3",
        "algorithm.kl_in_reward_coef": 0.1, "actor.use_kl_loss": True, "actor.kl_loss_type": "k3",
        "actor.kl_loss_coef": 0.1, "actor.lr": 1e-2, "actor.ppo_epochs": 2,
    })
    checked = experiment.check_config(config)

    def fail(config):
        raise AssertionError("the config was checked again")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(experiment, "check_config", fail)
        return checked, experiment.build_experiment(checked)


def test_build_experiment_takes_the_checked_config(k3):
    checked, exp = k3
    assert exp.settings is checked.settings and exp.hyper is checked.hyper and exp.mesh is checked.mesh
    assert (exp.settings.kl_loss_type, exp.settings.kl_penalty) == ("k3", "k3")
    # the tokenizer's ids join the checked plans, whose length is fitted to what their prompts reach,
    # with the head their first prompts share
    assert exp.train_plan.stop_tokens and exp.train_plan.pad_id == exp.tokenizer.pad_token_id
    assert exp.train_plan.max_len == longest_trajectory(exp.train_plan, exp.train_tables) < checked.train_plan.max_len
    assert exp.train_plan.shared_head == shared_head(exp.train_tables) > 0
    assert exp.train_plan == dataclasses.replace(checked.train_plan, stop_tokens=exp.train_plan.stop_tokens,
                                                 pad_id=exp.tokenizer.pad_token_id, max_len=exp.train_plan.max_len,
                                                 shared_head=exp.train_plan.shared_head)


def test_a_k3_kl_trains(k3):
    from starpo_jax.train import init_train_state, make_train_step

    _, exp = k3
    step = jax.jit(make_train_step(exp.settings, exp.model.graphdef, exp.train_plan).step)
    state = init_train_state(exp.settings, exp.model, jax.random.PRNGKey(0))
    _, metrics = step(state, exp.train_tables, exp.hyper, jax.random.PRNGKey(1))
    assert all(math.isfinite(float(v)) for v in metrics.values())
    # The second epoch's actor differs from the reference: k3 is then positive (k1 could have any sign).
    assert float(metrics["actor/kl_loss"]) > 0
