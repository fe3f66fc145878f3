"""Every setting of a config, declared once: ``SETTINGS``.

Each row names a config key, its default, the values it may take and where it goes:

- ``TrainSettings.<field>``: a static switch or size of the update (compiled into the program);
- ``Hyperparams.<field>``: a float that enters the compiled step as an array, so a sweep may vary
  it (``jax.vmap`` over settings; ``sweepable``);
- ``RolloutPlan.<field>``: a static size or switch of the rollout (``starpo_jax.rollout.multi_turn``);
- ``ModelConfig.<field>``: set on top of the checkpoint's model config (``experiment.model_compute``);
- ``run.<name>``: read on the host, outside the compiled step, by the code that owns its section:
  the model, tokenizer and prompt tables (``starpo_jax/runtime/experiment.py``), the mesh
  (``sharding.make_mesh``), the processes (``distributed.initialize``), the training loop
  (``experiments/run.py``).

Everything else is derived from the table: the defaults of ``configs/base.py`` (all but the env
sides, ``UNDECLARED``), the checks of a config (``check_settings``: one sentence naming the key and
what it may be), the fields of ``TrainSettings`` / ``Hyperparams`` / ``RolloutPlan`` /
``ModelConfig`` built from a config (``read_settings``), the defaults of ``TrainSettings``,
``RolloutPlan`` and ``Hyperparams`` (``setting_defaults``: ``setting_default`` in the fields'
declarations, ``Hyperparams.create``), and the keys ``experiments.sweep`` may vary
(``SWEEPABLE``). The allowed values come from the module that implements them. A check that
relates several keys, or a key to the devices or the envs, is made where those are known, and the
row's comment names it.

Adding a setting: one row here, one field in the class it goes to (``TrainSettings``,
``Hyperparams`` below, or ``RolloutPlan``; in the first and the last its default is
``setting_default(<class>, <field>)``), and the code that uses the field.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from ml_collections import ConfigDict

from starpo_jax.algo import advantages, filtering, losses, rewards
from starpo_jax.models.config import REMAT_MODES


class ConfigError(ValueError):
    """A config value that cannot work; the message names the key."""


# Rules beyond the type and the choices: (is valid, what the value must be).
Rule = tuple[Callable[[Any], bool], str]
POSITIVE: Rule = (lambda v: v > 0, "must be positive")
NON_NEGATIVE: Rule = (lambda v: v >= 0, "must be >= 0")
FRACTION: Rule = (lambda v: 0 < v <= 1, "must be in (0, 1]")
LORA_RANK: Rule = (lambda v: isinstance(v, int) and v >= 0, "must be a whole number >= 0 (0 = full fine-tuning)")


@dataclasses.dataclass(frozen=True)
class Setting:
    key: str  # the config key, "section.name"
    default: Any  # the config's default; ConfigDict holds overrides to its type
    target: str  # where the value goes: "TrainSettings.x", "Hyperparams.x", "RolloutPlan.x", "ModelConfig.x" or "run.x"
    choices: tuple = ()  # the values allowed (empty: any value of the default's type)
    rule: Rule | None = None
    cast_to: type | None = None  # the field's type where it is not the default's (lora.alpha: 64 -> 64.0)

    @property
    def owner(self) -> str:
        return self.target.split(".")[0]

    @property
    def field(self) -> str:
        return self.target.split(".")[1]

    @property
    def sweepable(self) -> bool:
        """Only hyperparameters enter the compiled step as arrays; any other setting changes the program."""
        return self.owner == "Hyperparams"

    def cast(self, value):
        return (self.cast_to or type(self.default))(value)

    def check(self, value) -> None:
        if isinstance(self.default, tuple) and not _numbers(value, len(self.default)):  # a command line gives a string
            raise ConfigError(f"{self.key} takes a tuple of {len(self.default)} numbers, e.g. {self.default}, "
                              f"not {value!r}.")
        if self.choices and value not in self.choices:
            raise ConfigError(f"{self.key} = {value!r} is not one of {', '.join(self.choices)}.")
        if self.rule and not self.rule[0](value):
            raise ConfigError(f"{self.key} {self.rule[1]}, not {value!r}.")


def _numbers(value, count: int) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == count and all(  # a list: a config read from JSON
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


S = Setting
# Every value is RAGEN v1's effective default (docs/ragen-reference.md §2.1, §3.1–3.7) unless a
# comment says otherwise. The order is configs/base.py's.
SETTINGS: tuple[Setting, ...] = (
    # model: what experiment.load_policy loads, and how it computes
    # a hub id, a local Hugging Face folder, a GGUF file, or "smollm2-135m-instruct"
    S("model.source", "Qwen/Qwen2.5-0.5B-Instruct", "run.source"),
    # random weights of a named preset instead of a checkpoint (tests, benchmarks); the tokenizer is source's
    S("model.random_init_preset", "", "run.random_init_preset"),
    S("model.dtype", "bfloat16", "ModelConfig.dtype", ("float32", "bfloat16")),  # compute; master weights float32
    # the update's backward pass recomputes each layer ("layer"), or keeps all ("none"), or keeps the
    # projections too ("dots"): docs/scaling.md
    S("model.remat", "layer", "ModelConfig.remat", REMAT_MODES),
    # a Jinja chat template replacing the tokenizer's ("" keeps it); the rollout needs one that renders
    # past messages verbatim (ChatML: Qwen2.5, SmolLM2)
    S("model.chat_template", "", "run.chat_template"),
    # envs: the prompt's settings (multi_turn.build_tables); the sides and per-tag keys are UNDECLARED
    S("envs.prompt_max_tokens", 100, "run.max_tokens"),  # only printed in the prompt: "Max response length: N words"
    # quirk 1: RAGEN's prompt legend shows the default symbols even for SokobanDifferentGridVocab
    S("envs.legend_from_env_symbols", False, "run.legend_from_env_symbols"),
    # rollout
    S("rollout.max_turn", 5, "RolloutPlan.max_turn", rule=POSITIVE),
    S("rollout.max_actions_per_turn", 5, "RolloutPlan.max_actions_per_turn", rule=POSITIVE),
    S("rollout.enable_think", True, "RolloutPlan.enable_think"),
    S("rollout.format_penalty", -0.1, "RolloutPlan.format_penalty"),
    S("rollout.response_length", 400, "RolloutPlan.response_length", rule=POSITIVE),  # max new tokens per turn
    S("rollout.max_model_len", 3600, "RolloutPlan.max_len", rule=POSITIVE),  # tokens per trajectory, all turns
    S("rollout.temperature", 1.0, "TrainSettings.rollout_temperature"),
    S("rollout.top_p", 1.0, "RolloutPlan.top_p"),
    S("rollout.top_k", -1, "RolloutPlan.top_k"),  # <= 0: no top-k filter
    S("rollout.val_temperature", 0.5, "run.val_temperature"),
    # old log-probs recomputed by the training forward (RAGEN), or the sampler's
    S("rollout.use_sampler_logprobs", False, "TrainSettings.use_sampler_logprobs"),
    # reward: how trajectory scores are normalised
    S("reward.grouping", "state", "TrainSettings.reward_grouping", rewards.GROUPINGS),
    S("reward.method", "identity", "TrainSettings.reward_method", rewards.METHODS),
    S("reward.use_turn_scores", False, "TrainSettings.use_turn_scores"),
    # filter: StarPO-S keeps the top 25 % of groups by in-group reward std
    S("filter.ratio", 0.25, "Hyperparams.filter_ratio", rule=FRACTION),
    S("filter.type", "std", "TrainSettings.filter_type", filtering.MODES),
    # what the spread is measured on: RAGEN's raw env reward, or the trajectory score (penalties in)
    S("filter.rank_by", "env_reward", "TrainSettings.filter_rank_by", filtering.RANK_BY),
    # algorithm
    S("algorithm.adv_estimator", "gae", "TrainSettings.adv_estimator", advantages.ESTIMATORS),
    S("algorithm.gamma", 1.0, "Hyperparams.gamma"),
    S("algorithm.lam", 1.0, "Hyperparams.lam"),
    S("algorithm.high_level_gamma", 0.95, "Hyperparams.high_level_gamma"),
    S("algorithm.grpo_norm_by_std", True, "TrainSettings.grpo_norm_by_std"),
    # GiGPO (adv_estimator="gigpo"; verl-agent's algorithm.gigpo.*, not in RAGEN): ω, the weight of the
    # step advantage, and the normalisation of both levels, mean only (verl-agent's default) or mean
    # and std (grpo_norm_by_std is not read). Its step returns discount by algorithm.gamma per turn,
    # as verl-agent's do.
    S("algorithm.gigpo_step_weight", 1.0, "Hyperparams.gigpo_step_weight"),
    S("algorithm.gigpo_mode", "mean_norm", "TrainSettings.gigpo_mode", advantages.GIGPO_MODES),
    S("algorithm.kl_in_reward", False, "TrainSettings.kl_in_reward"),
    S("algorithm.kl_in_reward_coef", 0.0, "Hyperparams.kl_in_reward_coef"),
    S("algorithm.kl_penalty", "kl", "TrainSettings.kl_penalty", losses.KL_KINDS),
    # actor (with LoRA its learning rate is lora.actor_lr)
    S("actor.lr", 1e-6, "Hyperparams.actor_lr", rule=NON_NEGATIVE),
    S("actor.weight_decay", 0.01, "TrainSettings.actor_weight_decay"),
    S("actor.betas", (0.9, 0.999), "TrainSettings.actor_betas"),
    S("actor.grad_clip", 1.0, "TrainSettings.actor_grad_clip"),
    S("actor.clip_ratio_low", 0.2, "Hyperparams.clip_ratio_low"),
    S("actor.clip_ratio_high", 0.28, "Hyperparams.clip_ratio_high"),
    S("actor.clip_ratio_c", 3.0, "Hyperparams.clip_ratio_c"),
    S("actor.entropy_coeff", 0.001, "Hyperparams.entropy_coeff"),
    S("actor.use_kl_loss", False, "TrainSettings.use_kl_loss"),
    S("actor.kl_loss_coef", 0.0, "Hyperparams.kl_loss_coef"),
    S("actor.kl_loss_type", "kl", "TrainSettings.kl_loss_type", losses.KL_KINDS),
    # RAGEN's effective mode (its token-mean over micro-batches of one sequence)
    S("actor.loss_agg_mode", "seq-mean-token-mean", "TrainSettings.loss_agg_mode", losses.AGG_MODES),
    S("actor.ppo_mini_batch_size", 32, "TrainSettings.ppo_mini_batch_size"),
    S("actor.micro_batch_size", 4, "TrainSettings.micro_batch_size"),
    S("actor.ppo_epochs", 1, "TrainSettings.ppo_epochs"),
    # Format warm-up (starpo_jax/format_warmup.py; an addition, RAGEN has none): supervised steps on
    # random valid answers to fresh levels' first prompts before RL, at their own learning rate
    S("actor.format_warmup_steps", 0, "run.format_warmup_steps", rule=(lambda v: v >= 0, "must be >= 0 (0: none)")),
    S("actor.format_warmup_lr", 1e-5, "run.format_warmup_lr", rule=POSITIVE),
    # critic (with LoRA its learning rate is lora.critic_lr)
    S("critic.lr", 1e-5, "Hyperparams.critic_lr", rule=NON_NEGATIVE),
    S("critic.weight_decay", 0.01, "TrainSettings.critic_weight_decay"),
    S("critic.betas", (0.9, 0.999), "TrainSettings.critic_betas"),
    S("critic.grad_clip", 1.0, "TrainSettings.critic_grad_clip"),
    S("critic.cliprange_value", 0.5, "TrainSettings.cliprange_value"),
    S("critic.warmup_steps", 0, "TrainSettings.critic_warmup"),
    # LoRA on every linear layer of actor and critic (ragen-reference.md §5); rank 0 = full fine-tuning, else the
    # learning rates are lora.actor_lr / lora.critic_lr instead of actor.lr / critic.lr
    S("lora.rank", 0, "TrainSettings.lora_rank", rule=LORA_RANK),
    S("lora.alpha", 64, "TrainSettings.lora_alpha", cast_to=float),
    S("lora.actor_lr", 1e-5, "Hyperparams.actor_lr", rule=NON_NEGATIVE),
    S("lora.critic_lr", 1e-4, "Hyperparams.critic_lr", rule=NON_NEGATIVE),
    # Devices: a data × fsdp × model mesh (starpo_jax/runtime/sharding.py); one size may be -1 (the devices
    # the others leave). data splits rows; fsdp splits rows and stores weights, critic, reference and
    # Adam moments 1/fsdp per device; model splits attention heads, MLP and vocabulary. Checked
    # together against the devices by sharding.make_mesh (experiment.device_mesh).
    S("mesh.data", -1, "run.data"),
    S("mesh.fsdp", 1, "run.fsdp"),
    S("mesh.model", 1, "run.model"),
    # Split devices (docs/scaling.md, "Rollout and update at once"): the last k devices sample, the
    # others (process 0's first) train, each part a mesh of the sizes above (-1 taking that part's devices); 0: every
    # device does both. Needs trainer.staleness=1 (check_settings); checked against the devices by
    # experiment.device_meshes.
    S("mesh.rollout_devices", 0, "run.rollout_devices",
      rule=(lambda v: isinstance(v, int) and v >= 0, "must be a whole number >= 0 (0: every device samples and trains)")),
    # Many hosts (starpo_jax/runtime/distributed.py): the coordinator's host:port, the number of processes and
    # this one's index. Unset (""/-1): detected from SLURM, Open MPI or a TPU pod, else one process.
    # Checked together by distributed.initialize, which runs before anything else touches the devices.
    S("distributed.coordinator_address", "", "run.coordinator_address"),
    S("distributed.num_processes", -1, "run.num_processes"),
    S("distributed.process_id", -1, "run.process_id"),
    # trainer: the training loop (experiments/run.py; experiments/sweep.py reads seed, total_steps,
    # output_dir and overwrite)
    S("trainer.total_steps", 200, "run.total_steps"),
    S("trainer.test_freq", 10, "run.test_freq"),
    S("trainer.val_before_train", True, "run.val_before_train"),
    S("trainer.save_freq", -1, "run.save_freq"),
    # also save after a step when this many minutes have passed since the last save (0: off; an
    # addition, RAGEN saves by steps only): a killed run loses at most about that much. Either
    # schedule may call a save; the checkpoint manager keeps the last 3 (runtime/checkpoint.py)
    S("trainer.save_every_minutes", 10.0, "run.save_every_minutes", rule=(lambda v: v >= 0, "must be >= 0 (0: off)")),
    S("trainer.seed", 0, "run.seed"),
    # 0: each step samples its batch, then updates on it (RAGEN). 1: the rollout of step t+1 runs
    # while update t does, with the weights update t starts from, so every batch is at most one
    # update old (an addition; docs/scaling.md). Needs rollout.use_sampler_logprobs=True (check_settings).
    S("trainer.staleness", 0, "run.staleness",
      rule=(lambda v: v in (0, 1) and not isinstance(v, bool), "must be 0 (rollout, then update) or 1 (the next "
            "rollout runs during the update, one update behind)")),
    S("trainer.output_dir", "runs/default", "run.output_dir"),
    S("trainer.resume", False, "run.resume"),  # excludes overwrite (experiments.run.check_output_dir)
    # a fresh run refuses a folder that holds an earlier run; True deletes that run's files first
    S("trainer.overwrite", False, "run.overwrite"),
    # the first N training trajectories of every step go to train/step_N.jsonl (the run report shows
    # them); with N > 0 each validation also prints one of its trajectories
    S("trainer.log_trajectories", 20, "run.log_trajectories"),
    # Validation runs as this many rollouts, each on 1/val_chunks of every tag's groups: the same
    # levels and metrics in a fraction of the memory (the KV cache is the largest buffer). It must
    # divide every envs.val.n_groups (experiment.check_val_chunks).
    S("trainer.val_chunks", 1, "run.val_chunks"),
    # Template collapse (RAGEN-2, starpo_jax/diagnostics/template_collapse.py): the first answers of
    # ``mi_prompts`` groups per env tag scored after each of those groups' first prompts, at every
    # validation and every ``mi_freq`` training steps (0: never; an addition, RAGEN v1 has none)
    S("trainer.mi_freq", 5, "run.mi_freq", rule=(lambda v: v >= 0, "must be >= 0 (0: never)")),
    S("trainer.mi_prompts", 8, "run.mi_prompts",
      rule=(lambda v: v == 0 or v >= 2, "must be 0 (never) or at least 2 (prompts to tell apart)")),
    S("trainer.export_hf", True, "run.export_hf"),  # save the final policy as a Hugging Face folder (hf_policy/)
    # The exported weights' dtype: "source", that of model.source's stored weights (a training run's
    # float32 policy then takes half the disk when the source is bfloat16), or a dtype named here.
    S("trainer.export_dtype", "source", "run.export_dtype", ("source", "float32", "bfloat16", "float16")),
)
del S

# Config keys the table does not declare: each side's env tags, group counts and size, and the
# dictionaries keyed by env tag. A row holds one value of a fixed type under a "section.name" key;
# these are sections of their own whose keys depend on the tags (configs/base.py writes them), and
# they are checked together against the env registry and each env's contract
# (experiment.rollout_plan).
UNDECLARED = ("envs.train", "envs.val", "envs.max_actions_per_traj", "envs.overrides")

BY_KEY: dict[str, Setting] = {s.key: s for s in SETTINGS}
SECTIONS = tuple(dict.fromkeys(s.key.split(".")[0] for s in SETTINGS))  # config sections, in order
# config key -> Hyperparams field, for experiments.sweep
SWEEPABLE: dict[str, str] = {s.key: s.field for s in SETTINGS if s.sweepable}
# The learning rates of full fine-tuning and, with lora.rank > 0, the LoRA ones that replace them.
LORA_LEARNING_RATES = {"actor.lr": "lora.actor_lr", "critic.lr": "lora.critic_lr"}


def unused_keys(lora_rank: int) -> set[str]:
    """The learning-rate keys a run with this LoRA rank does not read."""
    return set(LORA_LEARNING_RATES) if lora_rank > 0 else set(LORA_LEARNING_RATES.values())


def config_section(section: str) -> ConfigDict:
    """The defaults of one config section (``configs/base.py``)."""
    return ConfigDict({s.key.split(".")[1]: s.default for s in SETTINGS if s.key.split(".")[0] == section})


def _value(config: ConfigDict, key: str):
    section, name = key.split(".")
    return config[section][name]


def check_settings(config: ConfigDict) -> None:
    """Raise ``ConfigError`` for the first setting of ``config`` that is not allowed."""
    for s in SETTINGS:
        s.check(_value(config, s.key))
    if config.lora.rank and not config.lora.alpha > 0:  # alpha only matters with LoRA
        raise ConfigError(f"lora.alpha must be positive, not {config.lora.alpha!r}.")
    check_staleness(config.trainer.staleness, config.rollout.use_sampler_logprobs, config.mesh.rollout_devices)


def check_staleness(staleness: int, use_sampler_logprobs: bool, rollout_devices: int) -> None:
    """A stale batch's PPO ratio must be taken against the policy that sampled it, whose log-probs
    only the sampler has (the trainer's weights have moved on: docs/design.md, "One step off");
    and devices split apart sample while the update runs, which only a stale batch allows."""
    if staleness and not use_sampler_logprobs:
        raise ConfigError(
            "trainer.staleness=1 needs rollout.use_sampler_logprobs=True: a batch sampled one update ago must "
            "be scored by the log-probs of the weights that sampled it, which only the sampler has."
        )
    if rollout_devices and not staleness:
        raise ConfigError(
            f"mesh.rollout_devices={rollout_devices} splits the devices so that the rollout runs while the "
            "update does, which needs trainer.staleness=1 (with 0 each part would wait for the other)."
        )


def read_settings(config: ConfigDict, owner: str) -> dict[str, Any]:
    """``{field: value}`` of every field of ``owner`` ("TrainSettings", "Hyperparams", "RolloutPlan",
    "ModelConfig") the config sets, each checked and cast to the field's type."""
    skip = unused_keys(config.lora.rank)
    values = {}
    for s in SETTINGS:
        if s.owner == owner and s.key not in skip:
            value = _value(config, s.key)
            s.check(value)
            values[s.field] = s.cast(value)
    return values


def setting_defaults(owner: str) -> dict[str, Any]:
    """``{field: config default}`` of every field of ``owner`` the table sets, each cast to the
    field's type; a field that two rows set (actor.lr, lora.actor_lr) takes the first row's."""
    defaults: dict[str, Any] = {}
    for s in SETTINGS:
        if s.owner == owner:
            defaults.setdefault(s.field, s.cast(s.default))
    return defaults


def setting_default(owner: str, field: str) -> Any:
    """The config default of the field ``owner.field`` (``setting_defaults``), for the field's
    declaration in its class, e.g. in ``RolloutPlan``: ``max_turn: int = setting_default("RolloutPlan",
    "max_turn")``. The default is written as the field's own, so a type checker reads the class as it
    runs, and the value still comes from the table only."""
    defaults = setting_defaults(owner)
    if field not in defaults:
        raise KeyError(f"No row of SETTINGS targets {owner}.{field}.")
    return defaults[field]


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Static switches and sizes of the update (a sweep does not vary these). A field with a config
    key takes its config default from SETTINGS (``setting_default``)."""

    adv_estimator: str = setting_default("TrainSettings", "adv_estimator")
    grpo_norm_by_std: bool = setting_default("TrainSettings", "grpo_norm_by_std")
    gigpo_mode: str = setting_default("TrainSettings", "gigpo_mode")
    reward_grouping: str = setting_default("TrainSettings", "reward_grouping")
    reward_method: str = setting_default("TrainSettings", "reward_method")
    use_turn_scores: bool = setting_default("TrainSettings", "use_turn_scores")
    filter_type: str = setting_default("TrainSettings", "filter_type")
    filter_rank_by: str = setting_default("TrainSettings", "filter_rank_by")
    kept_groups: int = 2  # static upper bound of kept groups (int(ratio * env_groups) for top-k)
    loss_agg_mode: str = setting_default("TrainSettings", "loss_agg_mode")
    ppo_mini_batch_size: int = setting_default("TrainSettings", "ppo_mini_batch_size")
    micro_batch_size: int = setting_default("TrainSettings", "micro_batch_size")
    ppo_epochs: int = setting_default("TrainSettings", "ppo_epochs")
    use_kl_loss: bool = setting_default("TrainSettings", "use_kl_loss")
    kl_loss_type: str = setting_default("TrainSettings", "kl_loss_type")
    kl_in_reward: bool = setting_default("TrainSettings", "kl_in_reward")
    kl_penalty: str = setting_default("TrainSettings", "kl_penalty")
    rollout_temperature: float = setting_default("TrainSettings", "rollout_temperature")
    use_sampler_logprobs: bool = setting_default("TrainSettings", "use_sampler_logprobs")
    critic_warmup: int = setting_default("TrainSettings", "critic_warmup")
    actor_betas: tuple[float, float] = setting_default("TrainSettings", "actor_betas")
    critic_betas: tuple[float, float] = setting_default("TrainSettings", "critic_betas")
    actor_weight_decay: float = setting_default("TrainSettings", "actor_weight_decay")
    critic_weight_decay: float = setting_default("TrainSettings", "critic_weight_decay")
    actor_grad_clip: float = setting_default("TrainSettings", "actor_grad_clip")
    critic_grad_clip: float = setting_default("TrainSettings", "critic_grad_clip")
    cliprange_value: float = setting_default("TrainSettings", "cliprange_value")
    logprob_chunk: int = 512  # positions per chunk when computing log-probs from hidden states
    lora_rank: int = setting_default("TrainSettings", "lora_rank")  # 0: full fine-tuning
    lora_alpha: float = setting_default("TrainSettings", "lora_alpha")

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator in advantages.CRITIC_ESTIMATORS

    @property
    def uses_ref(self) -> bool:
        return self.use_kl_loss or self.kl_in_reward

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0


def check_batch_split(settings: TrainSettings, group_size: int) -> None:
    """The update batch must split into whole mini-batches, and those into micro-batches (checked
    when a config is read and again when a step is built from hand-made settings)."""
    k, mini, micro = settings.kept_groups, settings.ppo_mini_batch_size, settings.micro_batch_size
    batch = k * group_size
    if batch % mini or mini % micro:
        raise ConfigError(
            f"The update batch ({k} kept groups × {group_size} = {batch} trajectories) must split into mini-batches "
            f"of actor.ppo_mini_batch_size ({mini}), and those into micro-batches of actor.micro_batch_size ({micro}); "
            "change filter.ratio, actor.ppo_mini_batch_size or actor.micro_batch_size."
        )


class Hyperparams(flax.struct.PyTreeNode):
    """The values a sweep varies, as float32 arrays (scalars, or [S] under ``vmap``)."""

    actor_lr: jax.Array
    critic_lr: jax.Array
    clip_ratio_low: jax.Array
    clip_ratio_high: jax.Array
    clip_ratio_c: jax.Array
    entropy_coeff: jax.Array
    kl_loss_coef: jax.Array
    kl_in_reward_coef: jax.Array
    filter_ratio: jax.Array
    gamma: jax.Array
    lam: jax.Array
    high_level_gamma: jax.Array
    gigpo_step_weight: jax.Array

    @classmethod
    def create(cls, **values: float) -> "Hyperparams":
        """Hyperparameters from floats; a field not given takes its config default
        (``setting_defaults``): ``Hyperparams.create()`` is RAGEN's defaults, and
        ``Hyperparams.create(actor_lr=1e-3)`` those with one changed."""
        return cls(**{k: jnp.asarray(v, jnp.float32) for k, v in (setting_defaults("Hyperparams") | values).items()})
