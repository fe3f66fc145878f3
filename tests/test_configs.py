"""Config files and presets: each loads through ml_collections' config_flags (as
``experiments.run`` loads it), passes the experiment's checks, maps to rollout plans and update
settings with consistent batch arithmetic, and carries the paper's values. No model is loaded."""

from pathlib import Path

import pytest
from absl import flags
from ml_collections import config_flags

import envs_jax
from configs import base, presets
from experiments import cli
from helpers import TINY
from starpo_jax.runtime import experiment

ROOT = Path(__file__).resolve().parents[1]
CONFIG_FILES = ["base.py", "sokoban.py", "frozen_lake.py", "bandit.py", "countdown.py", "quickstart.py", "learn_bandit.py",
                "learn_frozen_lake.py"]
ENVS = ["sokoban", "frozen_lake", "bandit"]
ALGORITHMS = ["starpo_s", "starpo_ppo", "starpo_grpo", "starpo_s_grpo", "base_ppo_cliphigh", "base_ppo_nokl"]


def load(spec: str, *overrides: str):
    """The config of ``--config=configs/<spec>`` plus overrides, parsed by absl + config_flags."""
    return parsed(["prog", f"--config={ROOT / 'configs' / spec}", *overrides])


def parsed(argv: list[str]):
    """The config a command line ``argv`` names, parsed by absl + config_flags."""
    values = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=values, sys_argv=argv)
    values(argv)
    return values.config


def plans(config):
    checked = experiment.check_config(config)
    return checked.train_plan, checked.val_plan, checked.settings


def mini_batches_per_rollout(config) -> int:
    train, _, settings = plans(config)
    return settings.kept_groups * train.group_size // settings.ppo_mini_batch_size


def flat(config) -> dict:
    def walk(node, prefix):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    return dict(walk(config.to_dict(), ""))


def changed_keys(a, b) -> set:
    fa, fb = flat(a), flat(b)
    return {k for k in fa.keys() | fb.keys() if fa.get(k) != fb.get(k)}


SPECS = (
    CONFIG_FILES
    + [f"presets.py:{name}" for name in presets.PRESETS]
    + [f"presets.py:{env}+{alg}" for env in ENVS[1:] for alg in ALGORITHMS]
)


@pytest.mark.parametrize("spec", SPECS)
def test_config_maps_to_plans_with_consistent_batches(spec):
    config = load(spec)
    train, val, settings = plans(config)
    for side, plan in (("train", train), ("val", val)):
        split = config.envs[side]
        assert [t.name for t in plan.tags] == list(split.tags)
        assert plan.batch_size == sum(split.n_groups) * split.group_size
    kept_trajectories = settings.kept_groups * train.group_size
    assert settings.kept_groups == max(1, int(config.filter.ratio * train.num_groups))
    assert kept_trajectories % settings.ppo_mini_batch_size == 0
    assert settings.ppo_mini_batch_size % settings.micro_batch_size == 0
    assert settings.uses_critic == (config.algorithm.adv_estimator == "gae")


def test_env_files_are_the_env_presets():
    for env in ENVS:
        assert flat(load(f"{env}.py")) == flat(load(f"presets.py:{env}"))
    assert changed_keys(load("sokoban.py"), load("base.py")) == {"trainer.output_dir"}


def test_starpo_s_is_the_default_and_updates_once_per_rollout():
    config = load("presets.py:starpo_s")
    assert changed_keys(config, load("base.py")) == {"trainer.output_dir"}
    assert (config.filter.ratio, config.filter.type) == (0.25, "std")
    assert (config.actor.clip_ratio_low, config.actor.clip_ratio_high) == (0.2, 0.28)
    assert config.algorithm.adv_estimator == "gae" and config.reward.method == "identity"
    _, _, settings = plans(config)
    assert not settings.uses_ref  # no KL anywhere, so no reference model
    assert mini_batches_per_rollout(config) == 1  # quirk 7: 2 kept groups x 16 = one mini-batch of 32


def test_vanilla_ppo_puts_a_k1_kl_in_the_reward():
    config = load("presets.py:starpo_ppo")
    assert (config.filter.ratio, config.actor.clip_ratio_high) == (1.0, 0.2)
    assert config.algorithm.kl_in_reward and config.algorithm.kl_in_reward_coef == 0.001
    assert config.algorithm.kl_penalty == "kl" and not config.actor.use_kl_loss
    assert plans(config)[2].uses_ref
    assert float(experiment.hyperparams(config).kl_in_reward_coef) == pytest.approx(0.001)
    assert mini_batches_per_rollout(config) == 4


def test_vanilla_grpo_uses_the_kl_loss_and_state_normalised_scores():
    config = load("presets.py:starpo_grpo")
    assert config.algorithm.adv_estimator == "grpo"
    assert (config.reward.grouping, config.reward.method) == ("state", "mean_std")
    assert config.actor.use_kl_loss and config.actor.kl_loss_coef == 0.001 and config.actor.kl_loss_type == "kl"
    assert not config.algorithm.kl_in_reward
    assert (config.filter.ratio, config.actor.clip_ratio_high) == (1.0, 0.2)
    _, _, settings = plans(config)
    assert settings.uses_ref and not settings.uses_critic


def test_starpo_s_grpo_changes_only_the_estimator():
    assert changed_keys(load("presets.py:starpo_s_grpo"), load("presets.py:starpo_s")) == {
        "algorithm.adv_estimator",
        "reward.method",
        "trainer.output_dir",
    }


def test_fig8_ablations_change_one_factor_of_vanilla_ppo():
    ppo = load("presets.py:starpo_ppo")
    cliphigh = load("presets.py:base_ppo_cliphigh")
    nokl = load("presets.py:base_ppo_nokl")
    assert changed_keys(cliphigh, ppo) == {"actor.clip_ratio_high", "trainer.output_dir"}
    assert cliphigh.actor.clip_ratio_high == 0.28
    kl_keys = {"algorithm.kl_in_reward", "algorithm.kl_in_reward_coef", "actor.kl_loss_coef"}
    assert changed_keys(nokl, ppo) == kl_keys | {"trainer.output_dir"}
    assert not plans(nokl)[2].uses_ref


@pytest.mark.parametrize("prefix", ["", "grpo_"])
def test_filter_ablation_keeps_r_of_the_groups(prefix):
    for ratio, mini_batches in ((0.25, 1), (0.5, 2), (0.75, 3), (1.0, 4)):
        config = load(f"presets.py:{prefix}filter_{ratio}")
        assert config.filter.ratio == ratio
        assert config.algorithm.adv_estimator == ("grpo" if prefix else "gae")
        assert mini_batches_per_rollout(config) == mini_batches


def check_generalisation_val(val_plan):
    assert [(t.name, t.n_groups) for t in val_plan.tags] == [
        ("SimpleSokoban", 128),
        ("LargerSokoban", 128),
        ("SokobanDifferentGridVocab", 128),
        ("FrozenLake", 128),
    ]
    assert val_plan.group_size == 1 and val_plan.batch_size == 512


def test_sokoban_generalisation_suite_validates_on_four_envs():
    train, val, _ = plans(load("presets.py:sokoban_generalisation"))
    check_generalisation_val(val)
    assert [(t.name, t.n_groups) for t in train.tags] == [("SimpleSokoban", 8)] and train.group_size == 16
    assert not load("presets.py:sokoban_generalisation_nothink").rollout.enable_think


@pytest.mark.parametrize("groups,size", [(4, 32), (8, 16), (16, 8), (32, 4), (64, 2), (128, 1)])
def test_table2_diversity_fixes_the_batch_at_128(groups, size):
    train, val, settings = plans(load(f"presets.py:diversity_{groups}x{size}"))
    assert (train.num_groups, train.group_size, train.batch_size) == (groups, size, 128)
    assert settings.kept_groups * size == 32  # keep 25 %: always one mini-batch
    check_generalisation_val(val)


@pytest.mark.parametrize("k", range(1, 9))
def test_table3_actions_per_turn_allow_5k_actions_per_episode(k):
    train, val, _ = plans(load(f"presets.py:actions_per_turn_{k}"))
    assert train.max_actions_per_turn == k
    assert {t.max_actions_per_traj for t in train.tags + val.tags} == {5 * k}
    check_generalisation_val(val)


def test_table3_k6_values():
    train, val, _ = plans(load("presets.py:actions_per_turn_6"))
    assert (train.max_actions_per_turn, train.tags[0].max_actions_per_traj, val.tags[2].max_actions_per_traj) == (6, 30, 30)


@pytest.mark.parametrize("k", [2, 5, 10])
def test_online_k_takes_k_optimizer_steps_per_rollout(k):
    config = load(f"presets.py:online_{k}")
    assert mini_batches_per_rollout(config) == k
    assert config.trainer.total_steps * k == 200  # same update budget as Online-1 (online-10: 20, not 80)
    assert config.trainer.test_freq * k == 10
    check_generalisation_val(plans(config)[1])


def test_bandit_is_one_turn_one_action_and_validates_on_both_arm_pairs():
    config = load("bandit.py")
    train, val, _ = plans(config)
    assert (train.max_turn, train.max_actions_per_turn, train.response_length) == (1, 1, 500)
    assert [(t.name, t.n_groups) for t in val.tags] == [("Bandit", 256), ("BanditTest", 256)]
    arms = [(t.env.lo_arm_name, t.env.hi_arm_name) for t in val.tags]
    assert arms == [("Phoenix", "Dragon"), ("Trader", "Librarian")]
    assert {t.max_actions_per_traj for t in val.tags} == {1}


@pytest.mark.parametrize(
    "name,train_arms,test_arms",
    [
        ("bandit_normal", ("Engineer", "Teacher"), ("Trader", "Librarian")),
        ("bandit_rev", ("Teacher", "Engineer"), ("Librarian", "Trader")),
    ],
)
def test_bandit_generalisation_arms(name, train_arms, test_arms):
    for suffix, think in (("", True), ("_nothink", False)):
        config = load(f"presets.py:{name}{suffix}")
        train, val, _ = plans(config)
        assert config.rollout.enable_think == think and train.enable_think == think
        assert (train.tags[0].env.lo_arm_name, train.tags[0].env.hi_arm_name) == train_arms
        assert [(t.env.lo_arm_name, t.env.hi_arm_name) for t in val.tags] == [train_arms, test_arms]
        assert train.max_turn == 1 and train.max_actions_per_turn == 1


def test_model_presets_only_change_the_checkpoint():
    config = load("presets.py:sokoban_generalisation+qwen2.5_1.5b_instruct")
    assert config.model.source == "Qwen/Qwen2.5-1.5B-Instruct"
    assert changed_keys(config, load("presets.py:sokoban_generalisation")) == {"model.source", "trainer.output_dir"}
    assert load("presets.py:r1_distill_qwen_7b").model.source == "deepseek-ai/DeepSeek-R1-Distill-Qwen-7B"


def test_quickstart_is_small_and_validates_before_and_after_training():
    config = load("quickstart.py")
    assert (config.model.source, config.model.dtype) == ("smollm2-135m-instruct", "float32")
    assert not config.rollout.enable_think  # a 135M model answers, but does not finish thinking, in 48 tokens
    train, val, settings = plans(config)
    assert (train.num_groups, train.group_size) == (2, 4)
    assert settings.kept_groups * train.group_size == settings.ppo_mini_batch_size == 8
    assert settings.micro_batch_size == 4 and not settings.uses_critic
    assert (val.batch_size, val.group_size) == (8, 1)
    assert config.trainer.total_steps == 3
    assert config.trainer.val_before_train and config.trainer.total_steps % config.trainer.test_freq == 0
    assert config.trainer.output_dir == "runs/quickstart"


@pytest.mark.parametrize("spec, env, groups, kept, val_groups", [("learn_bandit.py", "Bandit", 16, 4, [256, 256]),
                                                                ("learn_frozen_lake.py", "FrozenLake", 8, 2, [64])])
def test_learning_presets_are_starpo_s_grpo(spec, env, groups, kept, val_groups):
    """The presets that learn on a CPU: StarPO-S (the filter keeping the top 25 % of groups of 8,
    clip 0.2 / 0.28, no KL) with GRPO, the bundled model in float32 and log-probs from the sampler,
    validating before, half-way and after training."""
    config = load(spec)
    train, val, settings = plans(config)
    assert (config.model.source, config.model.dtype) == ("smollm2-135m-instruct", "float32")
    assert [t.name for t in train.tags] == [env] and (train.num_groups, train.group_size) == (groups, 8)
    assert settings.kept_groups == kept == groups // 4 and settings.filter_type == "std"
    assert settings.adv_estimator == "grpo" and settings.use_sampler_logprobs
    assert not (settings.use_kl_loss or settings.kl_in_reward or settings.uses_critic)
    assert (config.actor.clip_ratio_low, config.actor.clip_ratio_high) == (0.2, 0.28)
    assert settings.ppo_mini_batch_size == kept * train.group_size  # one optimiser step per rollout
    assert [t.n_groups for t in val.tags] == val_groups and val.group_size == 1
    assert all(n % config.trainer.val_chunks == 0 for n in val_groups)
    assert config.trainer.total_steps == 2 * config.trainer.test_freq and config.trainer.val_before_train


def test_bandit_preset_centres_rewards_without_the_std_and_answers_only():
    """docs/results.md: dividing by the group's std favours the safe arm; the kept groups in one
    micro-batch, so groups that drew the same first prompt compute it once."""
    config = load("learn_bandit.py")
    train, _, settings = plans(config)
    assert (settings.reward_method, settings.grpo_norm_by_std, config.model.remat) == ("mean", False, "none")
    assert settings.micro_batch_size == settings.kept_groups * train.group_size and not train.enable_think


def test_frozen_lake_preset_thinks_and_normalises_by_the_std_as_ragen():
    """With <think> the untrained model sometimes copies the prompt's example answer; without it,
    never (configs/learn_frozen_lake.py); three turns of 48 tokens in a 640-token context; one group
    a micro-batch, so each kept group's first prompt is computed once."""
    config = load("learn_frozen_lake.py")
    train, _, settings = plans(config)
    assert train.enable_think and (train.max_turn, train.response_length, train.max_len) == (3, 48, 640)
    assert (settings.reward_method, settings.grpo_norm_by_std, config.model.remat) == ("identity", True, "none")
    assert settings.micro_batch_size == train.group_size


def test_val_chunks_must_split_every_validation_tag():
    with pytest.raises(experiment.ConfigError, match="trainer.val_chunks must be a whole number >= 1 that divides"):
        plans(load("learn_bandit.py", "--config.trainer.val_chunks=3"))


def test_presets_compose_left_to_right():
    config = load("presets.py:frozen_lake+starpo_ppo")
    assert config.envs.train.tags == ("FrozenLake",) and config.algorithm.kl_in_reward
    assert config.trainer.output_dir == "runs/frozen_lake+starpo_ppo"
    assert load("presets.py:filter_0.5+filter_1.0").filter.ratio == 1.0


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(ValueError, match="Unknown preset 'starpo_x'.*starpo_grpo.*diversity_32x4"):
        presets.get_config("starpo_x")
    with pytest.raises(flags.Error, match="Unknown preset 'nope'"):
        load("presets.py:frozen_lake+nope")


def test_action_budgets_are_the_env_classes():
    """configs/base.py lists RAGEN's per-tag budgets (envs.yaml) as each env class declares them."""
    budgets = base.get_config().envs.max_actions_per_traj.to_dict()
    assert budgets == {"SimpleSokoban": 10, "LargerSokoban": 10, "SokobanDifferentGridVocab": 10, "FrozenLake": 10,
                       "Bandit": 1, "BanditTest": 1}
    assert budgets == {tag: envs_jax.make(tag).default_max_actions_per_traj for tag in base.BUDGET_TAGS}
    assert load("base.py", "--config.envs.max_actions_per_traj.Bandit=3").envs.max_actions_per_traj.Bandit == 3


def test_only_validation_has_a_level_seed():
    """Training levels follow trainer.seed (drawn in JAX); validation plays RAGEN's levels 123, 124, ..."""
    envs = base.get_config().envs
    assert "seed" not in envs.train and envs.val.seed == 123


def test_command_line_overrides():
    config = load("presets.py:starpo_ppo", "--config.rollout.max_turn=3", "--config.envs.val.n_groups=(64,)")
    train, val, _ = plans(config)
    assert train.max_turn == 3 and val.batch_size == 64
    arms = load("bandit.py", "--config.envs.overrides.Bandit.lo_arm_name=Engineer")
    assert plans(arms)[0].tags[0].env.lo_arm_name == "Engineer"


def test_actor_and_critic_optimisers_take_their_own_betas():
    config = load("base.py", "--config.actor.betas=(0.8,0.99)", "--config.critic.betas=(0.5,0.9)")
    settings = plans(config)[2]
    assert (settings.actor_betas, settings.critic_betas) == ((0.8, 0.99), (0.5, 0.9))


def test_misspelt_override_key_names_the_key():
    with pytest.raises(AttributeError, match="max_trun"):
        load("sokoban.py", "--config.rollout.max_trun=3")


def test_wrong_override_type_names_the_key():
    with pytest.raises(flags.IllegalFlagValueError, match="config.rollout.max_turn=abc"):
        load("sokoban.py", "--config.rollout.max_turn=abc")


def test_with_overrides_rejects_unknown_keys_and_copies():
    config = base.get_config()
    with pytest.raises(ValueError, match="'rollout.max_trun' does not exist"):
        base.with_overrides(config, {"rollout.max_trun": 3})
    with pytest.raises(ValueError, match="'rolout.max_turn' does not exist"):
        base.with_overrides(config, {"rolout.max_turn": 3})
    changed = base.with_overrides(config, {"rollout.max_turn": 3})
    assert (changed.rollout.max_turn, config.rollout.max_turn) == (3, 5)


def test_docs_list_every_preset():
    docs = (ROOT / "docs" / "configs.md").read_text()
    missing = [name for name in presets.PRESETS if f"`{name}`" not in docs]
    assert not missing, f"docs/configs.md does not mention presets {missing}"


def command_error(*overrides: str) -> str:
    """The line ``experiments.run`` prints after "error: " for the tiny run's config (tests/helpers.py)
    with ``overrides``, found in this process as the command finds it: a flag that does not parse as
    ``experiments.cli`` words it (the last of a setting given twice counts), else ``check_config``'s."""
    argv = cli.last_overrides_only(["prog", *TINY, *overrides])
    try:
        plans(parsed(argv))
    except experiment.ConfigError as err:
        return str(err)
    except cli.CONFIG_ERRORS as err:
        return cli.flag_error_message(err, argv)
    raise AssertionError(f"{overrides} raised nothing")


def test_bad_settings_are_one_sentence_naming_the_key():
    """What a command says for a value of the wrong type or settings that do not fit together, before
    any model loads (tests/test_run.py starts the command itself for the errors of its start)."""
    unknown = command_error("--config.envs.train.tags=('Sokobon',)", "--config.envs.train.n_groups=(2,)")
    assert "Sokobon" in unknown and "Known envs" in unknown
    assert command_error("--config.trainer.total_steps=abc") == (
        "--config.trainer.total_steps=abc: trainer.total_steps takes a whole number, not 'abc'.")
    assert "actor.betas takes a tuple of 2 numbers" in command_error("--config.actor.betas=abc")
    assert "envs.train.n_groups takes a tuple of whole numbers" in command_error("--config.envs.train.n_groups=(1.5,1,1)")
    # A setting given twice takes its last value, a tuple too (absl alone would join the two tuples).
    assert "envs.train.tags has 3 entries but envs.train.n_groups has 2" in command_error(
        "--config.envs.train.n_groups=(4,4,4)", "--config.envs.train.n_groups=(1,1)")
    assert "ppo_mini_batch_size (3)" in command_error("--config.actor.ppo_mini_batch_size=3")
    assert "mesh.model=2" in command_error("--config.mesh.model=2")  # one device here
    assert "trainer.staleness must be 0 (rollout, then update) or 1" in command_error("--config.trainer.staleness=2")
    assert "trainer.staleness=1 needs rollout.use_sampler_logprobs=True" in command_error("--config.trainer.staleness=1")
