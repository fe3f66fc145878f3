"""From a config (``configs/*.py``) to the objects a run needs: model, tokenizer, rollout plans and
tables for training and validation, update settings and hyperparameters.

Everything a user can get wrong in a config is checked here (each setting against its declaration
in ``starpo_jax/runtime/settings.py``), once per run (``check_config``), with a message that names the key
and what to do.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import jax
from flax import nnx
from ml_collections import ConfigDict

import envs_jax
from starpo_jax.algo.filtering import num_kept_groups
from starpo_jax.format_warmup import check_named_actions
from starpo_jax.models import bundled
from starpo_jax.models.config import preset
from starpo_jax.models.decoder import Decoder, ModelState
from starpo_jax.models.loading import load_model, load_tokenizer, resolve_source, smollm2_tokenizer
from starpo_jax.rollout.multi_turn import (
    RolloutPlan,
    RolloutTables,
    TagPlan,
    build_tables,
    fit_to_tables,
    shared_head,
    stop_tokens_for,
)
from starpo_jax.rollout.prompts import PieceCutError
from starpo_jax.runtime import sharding
from starpo_jax.runtime.contract import check_env
from starpo_jax.runtime.settings import (
    ConfigError,
    Hyperparams,
    TrainSettings,
    check_batch_split,
    check_settings,
    read_settings,
)


@dataclasses.dataclass
class Experiment:
    config: ConfigDict
    model: ModelState  # float32 master weights, compute dtype from the config
    tokenizer: Any
    train_plan: RolloutPlan
    train_tables: RolloutTables
    val_plan: RolloutPlan
    val_tables: RolloutTables
    settings: TrainSettings
    hyper: Hyperparams
    mesh: Any  # jax.sharding.Mesh the run trains over (starpo_jax.runtime.sharding)
    rollout_mesh: Any = None  # the sampler's own Mesh with mesh.rollout_devices > 0; None: ``mesh`` samples too

    def seed_key(self) -> jax.Array:
        """The run's key, ``PRNGKey(trainer.seed)``: its first train state is drawn from it, and each
        training rollout from it with the step folded in (``train.collect``). Every program that
        stands for the run (``experiments.run``, ``sweep``, ``bench.ceilings``) takes it here."""
        return jax.random.PRNGKey(self.config.trainer.seed)


def device_mesh(config: ConfigDict, **batch_sizes: int):
    """``config.mesh`` as a mesh of every device, checked against the batches it splits into rows
    over ``data × fsdp`` (named as the user sets them)."""
    return _mesh_of(config, None, "", batch_sizes)


def _mesh_of(config: ConfigDict, devices, part: str, batch_sizes: dict[str, int]):
    """``device_mesh`` over ``devices`` (None: all); ``part`` opens an error with the devices it is about."""
    try:
        mesh = sharding.make_mesh(int(config.mesh.data), int(config.mesh.fsdp), int(config.mesh.model), devices)
        sharding.check_batch(mesh, **batch_sizes)
    except ValueError as err:
        raise ConfigError(f"{part}{err}") from err
    return mesh


def device_meshes(config: ConfigDict, trainer_batches: dict[str, int], sampler_batches: dict[str, int]):
    """(the trainer's mesh, the sampler's). ``mesh.rollout_devices=k``: the last k devices sample
    and the others train (so process 0, which writes the logs and exports, trains; with several
    processes the parts may lie on different hosts), each part a mesh of ``config.mesh``'s sizes
    checked against the batches it splits; 0: one mesh of every device does both (the sampler's is
    None)."""
    k = int(config.mesh.rollout_devices)
    if not k:
        return _mesh_of(config, None, "", trainer_batches), None
    devices = jax.devices()  # of every process, ordered by process
    if k >= len(devices):
        raise ConfigError(f"mesh.rollout_devices={k} leaves no device to train on: {_devices(len(devices))} "
                          f"visible; set it below {len(devices)}, or to 0 for every device to sample and train.")
    n = len(devices) - k
    if jax.process_count() > 1 and k != n:
        half = f"set it to {len(devices) // 2}" if len(devices) % 2 == 0 else "use an even number of devices"
        raise ConfigError(f"mesh.rollout_devices={k} of {len(devices)} devices in a run of {jax.process_count()} "
                          f"processes: across processes the sampler and the trainer must have as many devices each "
                          f"(JAX moves an array between processes only onto as many devices); {half}, or 0 for every "
                          "device to sample and train.")
    sampler = _mesh_of(config, devices[n:], f"Sampling on {_devices(k)} (mesh.rollout_devices={k}): ",
                       sampler_batches)
    trainer = _mesh_of(config, devices[:n], f"Training on the other {_devices(n)} (mesh.rollout_devices="
                       f"{k} of {len(devices)}): ", trainer_batches)
    return trainer, sampler


def _devices(n: int) -> str:
    return f"{n} device{'s' * (n != 1)}"


def model_compute(config: ConfigDict) -> dict[str, Any]:
    """The ``ModelConfig`` fields a config sets on top of the checkpoint's: compute dtype, float32
    master weights, rematerialisation (``model.remat``)."""
    return {**read_settings(config, "ModelConfig"), "param_dtype": "float32"}


def load_policy(config: ConfigDict):
    """(ModelState, tokenizer) from ``config.model``."""
    compute = model_compute(config)
    if config.model.random_init_preset:
        # Random weights of a preset (tests and benchmarks); the tokenizer still comes from `source`.
        tokenizer = _tokenizer_only(config.model.source)
        cfg = dataclasses.replace(preset(config.model.random_init_preset), vocab_size=len(tokenizer), **compute)
        model = Decoder(cfg, rngs=nnx.Rngs(config.trainer.seed))
    else:
        model, tokenizer = load_model(config.model.source, **compute)
    return ModelState.split(model), tokenizer


def _tokenizer_only(source: str):
    """The tokenizer of a model source, without reading its weights ("qwen2.5": the bundled one)."""
    if source == bundled.SMOLLM2_NAME:
        return smollm2_tokenizer()  # cached
    if source == "qwen2.5":
        return bundled.qwen_tokenizer()

    return load_tokenizer(resolve_source(source)[1])


def _tag_plans(config: ConfigDict, side: str) -> tuple[TagPlan, ...]:
    split = config.envs[side]
    # tuples, or lists in a config read back from a run's config.json
    if not (isinstance(split.tags, (tuple, list)) and all(isinstance(t, str) for t in split.tags)):
        raise ConfigError(f"envs.{side}.tags takes a tuple of env names, e.g. ('SimpleSokoban',), not {split.tags!r}.")
    if not (isinstance(split.n_groups, (tuple, list)) and all(isinstance(n, int) and n > 0 for n in split.n_groups)):
        raise ConfigError(f"envs.{side}.n_groups takes a tuple of whole numbers > 0, one per tag, e.g. (8,), "
                          f"not {split.n_groups!r}.")
    if len(split.tags) != len(split.n_groups):
        raise ConfigError(
            f"envs.{side}.tags has {len(split.tags)} entries but envs.{side}.n_groups has "
            f"{len(split.n_groups)}; give one group count per tag."
        )
    plans = []
    for tag, n in zip(split.tags, split.n_groups):
        if not envs_jax.is_known(tag):
            raise ConfigError(f"envs.{side}.tags: unknown env {tag!r}. Known envs: {envs_jax.known_names()}.")
        overrides = dict(config.envs.overrides.get(tag, {}))
        try:
            env = envs_jax.make(tag, **overrides)
        except ValueError as err:
            raise ConfigError(f"envs.{'overrides.' + tag if overrides else side + '.tags'}: {err}") from err
        try:
            _check_env_once(env, tag, overrides)
        except ValueError as err:
            raise ConfigError(f"envs.{side}.tags: {err}") from err
        # The config's per-tag budget (RAGEN's envs.yaml), else the env's own default.
        budget = config.envs.max_actions_per_traj.get(tag, env.default_max_actions_per_traj)
        plans.append(TagPlan(tag, env, int(n), int(budget)))
    return tuple(plans)


_CHECKED_ENVS: set = set()


def _check_env_once(env, tag: str, overrides: dict) -> None:
    """``check_env``, once per process for each env class and constructor arguments: training and
    validation usually share envs, and the check compiles the env's step."""
    key = (type(env), tag, repr(sorted(overrides.items())))
    if key not in _CHECKED_ENVS:
        check_env(env, tag)
        _CHECKED_ENVS.add(key)


def rollout_plan(config: ConfigDict, side: str, tokenizer=None) -> RolloutPlan:
    return RolloutPlan(
        tags=_tag_plans(config, side), group_size=int(config.envs[side].group_size), pad_id=_pad_id(tokenizer),
        **read_settings(config, "RolloutPlan"),
    )


def _pad_id(tokenizer) -> int:
    return int(getattr(tokenizer, "pad_token_id", None) or 0) if tokenizer is not None else 0


def train_settings(config: ConfigDict, plan: RolloutPlan) -> TrainSettings:
    f = config.filter
    if f.type == "top_p_var":
        kept = plan.num_groups  # how many groups top-p keeps is data dependent: keep room for all
    else:
        kept = int(num_kept_groups(f.ratio, plan.num_groups))
    settings = TrainSettings(kept_groups=kept, **read_settings(config, "TrainSettings"))
    check_batch_split(settings, plan.group_size)
    return settings


def hyperparams(config: ConfigDict) -> Hyperparams:
    return Hyperparams.create(**read_settings(config, "Hyperparams"))


@dataclasses.dataclass(frozen=True)
class CheckedConfig:
    """A config that passed every check needing no model, and what those checks built."""

    config: ConfigDict
    train_plan: RolloutPlan  # without the tokenizer's pad and stop ids
    val_plan: RolloutPlan
    settings: TrainSettings
    hyper: Hyperparams
    mesh: Any
    rollout_mesh: Any = None


def check_config(config: ConfigDict) -> CheckedConfig:
    """Every check that needs no model (settings, model dtype and remat, envs, batch sizes, mesh), so a mistake is reported
    in a second rather than after the model has loaded. ``build_experiment`` takes the result, so
    a run checks its config once."""
    check_settings(config)
    model_compute(config)
    train_plan, val_plan = rollout_plan(config, "train"), rollout_plan(config, "val")
    check_val_chunks(config.trainer.val_chunks, val_plan)
    if config.actor.format_warmup_steps:
        check_named_actions(train_plan)
    settings = train_settings(config, train_plan)
    hyper = hyperparams(config)
    mesh, rollout_mesh = device_meshes(config, _mesh_batches(config, train_plan, val_plan), _sampler_batches(train_plan))
    return CheckedConfig(config=config, train_plan=train_plan, val_plan=val_plan, settings=settings, hyper=hyper,
                         mesh=mesh, rollout_mesh=rollout_mesh)


def check_val_chunks(chunks, val_plan: RolloutPlan) -> None:
    """``trainer.val_chunks`` splits every validation tag's groups evenly (``multi_turn.chunked_rollout``)."""
    counts = [t.n_groups for t in val_plan.tags]
    if not isinstance(chunks, int) or chunks < 1 or any(n % chunks for n in counts):
        raise ConfigError(
            f"trainer.val_chunks must be a whole number >= 1 that divides every envs.val.n_groups {tuple(counts)}, "
            f"not {chunks!r}."
        )


def _mesh_batches(config: ConfigDict, train_plan: RolloutPlan, val_plan: RolloutPlan) -> dict[str, int]:
    """The batches split over the mesh's ``data`` axis, named as the user sets them."""
    return {
        "the training batch (n_groups × group_size)": train_plan.batch_size,
        "the validation batch (n_groups × group_size / trainer.val_chunks)": val_plan.batch_size // config.trainer.val_chunks,
        "actor.micro_batch_size": config.actor.micro_batch_size,
    }


def _sampler_batches(train_plan: RolloutPlan) -> dict[str, int]:
    """The batch split over the sampler's rows when it has devices of its own (validation stays
    on the trainer's)."""
    return {"the training batch (n_groups × group_size)": train_plan.batch_size}


def build_experiment(config: ConfigDict | CheckedConfig, load=load_policy) -> Experiment:
    """Load the model and tokenise every prompt piece: the host-side work before training.

    ``config``: a config (checked here first) or ``check_config``'s result. ``load(config) ->
    (ModelState, tokenizer)``; ``experiments.plan.abstract_policy`` gives the model's shapes
    without its weights."""
    checked = config if isinstance(config, CheckedConfig) else check_config(config)
    config = checked.config
    model, tokenizer = load(config)
    vocab_size = model.merge().config.vocab_size
    train_plan, train_tables = tokenized_plan(config, "train", checked.train_plan, tokenizer, vocab_size)
    val_plan, val_tables = tokenized_plan(config, "val", checked.val_plan, tokenizer, vocab_size)
    return Experiment(
        config=config,
        model=model,
        tokenizer=tokenizer,
        train_plan=train_plan,
        train_tables=train_tables,
        val_plan=val_plan,
        val_tables=val_tables,
        settings=checked.settings,
        hyper=checked.hyper,
        mesh=checked.mesh,
        rollout_mesh=checked.rollout_mesh,
    )


def tokenized_plan(config: ConfigDict, side: str, plan: RolloutPlan, tokenizer, vocab_size: int | None):
    """``(plan, tables)``: one side's plan with the tokenizer's pad and stop ids, and its prompt
    pieces, action names and token bytes as tables (host, once per plan; ``experiments.evaluate``
    builds its plans with it too). ``vocab_size``: the model's logit count (None: the tokenizer's)."""
    plan = dataclasses.replace(plan, pad_id=_pad_id(tokenizer))
    try:
        tables = _built_tables(
            tokenizer, plan, max_tokens=config.envs.prompt_max_tokens,
            legend_from_env_symbols=config.envs.legend_from_env_symbols,
            chat_template=config.model.get("chat_template", "") or None, vocab_size=vocab_size,
        )
    except PieceCutError as err:  # an env's pieces cut where this tokenizer merges: one sentence
        raise ConfigError(f"envs.{side}.tags: {err}") from err
    # Buffers, KV cache and the update's widest rows sized to what the prompts can reach, not to
    # rollout.max_model_len when that is more (the same rows play; see fit_to_tables).
    plan = dataclasses.replace(fit_to_tables(plan, tables), stop_tokens=stop_tokens_for(tokenizer, tables),
                               shared_head=shared_head(tables))
    return plan, tables


_TABLES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> {(plan, options): tables}


def _built_tables(tokenizer, plan: RolloutPlan, **options) -> RolloutTables:
    """``build_tables``, once per process for each tokenizer, plan and options: ``experiments.run``
    builds the experiment twice (``planning.check_fits`` plans it without weights first), and the
    tables (immutable arrays) are the same both times."""
    built = _TABLES.setdefault(tokenizer, {})
    key = (plan, tuple(sorted(options.items())))
    if key not in built:
        built[key] = build_tables(tokenizer, plan, **options)
    return built[key]
