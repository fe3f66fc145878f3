"""RAGEN v1 defaults (StarPO-S on SimpleSokoban with Qwen2.5-0.5B-Instruct).

Every value here is the original's effective default (spec: ragen-v1-spec.md §2.1, §3.1-3.7), unless
a comment says otherwise; the rollout and update sections come from ``starpo_jax/settings.py``, where
each of their keys is declared once. Env files (``sokoban.py``, ``frozen_lake.py``, ``bandit.py``) and
``presets.py`` start from ``get_config()`` and override. Override any key on the command line:
``python -m experiments.run --config configs/sokoban.py --config.rollout.max_turn=3``.
"""

import copy
from collections.abc import Mapping
from typing import Any

from ml_collections import ConfigDict

import envs_jax
from starpo_jax.settings import SECTIONS, config_section

# The tags whose action budget the config lists (RAGEN's envs.yaml tags of the paper's envs).
BUDGET_TAGS = ("SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab", "FrozenLake", "Bandit", "BanditTest")


def env_split(tags, n_groups, group_size):
    """One side (train or val) of the env manager: which tags, how many groups each, group size."""
    return ConfigDict(dict(tags=tuple(tags), n_groups=tuple(n_groups), group_size=group_size))


def with_overrides(config: ConfigDict, changes: Mapping[str, Any]) -> ConfigDict:
    """A copy of ``config`` with ``changes`` ({"section.key": value}) applied in order.

    Every key must already exist (ConfigDict would silently add a misspelt one); a whole section
    such as ``envs.overrides`` may be replaced by a dict.
    """
    config = copy.deepcopy(config)
    for path, value in changes.items():
        *parents, key = path.split(".")
        node = config
        for name in [*parents, key]:
            if not isinstance(node, ConfigDict) or name not in node:
                raise ValueError(f"Config key {path!r} does not exist; check its spelling against configs/base.py.")
            parent, node = node, node[name]
        parent[key] = value
    return config


def get_config() -> ConfigDict:
    c = ConfigDict()
    c.model = ConfigDict(
        dict(
            # A hub id, a local Hugging Face folder, a GGUF file, or "smollm2-135m-instruct".
            source="Qwen/Qwen2.5-0.5B-Instruct",
            # Random weights of a named preset instead of a checkpoint (tests, benchmarks).
            random_init_preset="",
            dtype="bfloat16",  # compute dtype; master weights stay float32
            # The update's backward pass recomputes each layer ("layer"), or keeps all ("none"),
            # or keeps the projections too ("dots"): docs/scaling.md.
            remat="layer",
            # A Jinja chat template replacing the tokenizer's ("" keeps it); the rollout needs one
            # that renders past messages verbatim (ChatML: Qwen2.5, SmolLM2).
            chat_template="",
        )
    )
    c.envs = ConfigDict()
    # No envs.train.seed (RAGEN's seed.train = 10000): training draws fresh levels in JAX from the
    # run's key (trainer.seed; starpo_jax.train.collect), not from RAGEN's seeded generator, so such
    # a seed could not give RAGEN's training levels, and trainer.seed alone repeats or varies a run.
    c.envs.train = env_split(["SimpleSokoban"], [8], group_size=16)
    c.envs.val = env_split(["SimpleSokoban"], [256], group_size=1)
    c.envs.val.seed = 123  # quirk 13: every validation plays RAGEN's levels of seeds 123, 124, ...
    # Per-tag action budgets (RAGEN envs.yaml), each its env class's default_max_actions_per_traj;
    # a key per tag so that the command line can override it. A tag without a key takes its env's.
    c.envs.max_actions_per_traj = ConfigDict({tag: envs_jax.default_max_actions_per_traj(tag) for tag in BUDGET_TAGS})
    c.envs.prompt_max_tokens = 100  # only printed in the prompt: "Max response length: N words"
    # Extra constructor arguments per tag, e.g. {"Bandit": {"lo_arm_name": "Engineer"}}.
    c.envs.overrides = ConfigDict()
    # quirk 1: RAGEN's prompt legend shows the default symbols even for SokobanDifferentGridVocab.
    c.envs.legend_from_env_symbols = False

    # rollout, reward, filter, algorithm, actor, critic, lora: each key with its default, allowed
    # values and where it goes is declared once in starpo_jax/settings.py (SETTINGS).
    for section in SECTIONS:
        c[section] = config_section(section)
    # Devices: a data × fsdp × model mesh (starpo_jax/sharding.py); one size may be -1 (the devices
    # the others leave). data splits rows; fsdp splits rows and stores weights, critic, reference
    # and Adam moments 1/fsdp per device; model splits attention heads, MLP and vocabulary.
    c.mesh = ConfigDict(dict(data=-1, fsdp=1, model=1))
    # Many hosts (starpo_jax/distributed.py): the coordinator's host:port, the number of processes and
    # this one's index. Unset (""/-1): detected from SLURM, Open MPI or a TPU pod, else one process.
    c.distributed = ConfigDict(dict(coordinator_address="", num_processes=-1, process_id=-1))
    c.trainer = ConfigDict(
        dict(
            total_steps=200,
            test_freq=10,
            val_before_train=True,
            save_freq=-1,
            seed=0,
            output_dir="runs/default",
            resume=False,
            # A fresh run refuses a folder that holds an earlier run; True deletes that run's files first.
            overwrite=False,
            log_trajectories=20,
            # Validation runs as this many rollouts, each on 1/val_chunks of every tag's groups: the
            # same levels and metrics in a fraction of the memory (the KV cache is the largest buffer).
            val_chunks=1,
            export_hf=True,  # save the final policy as a Hugging Face folder (hf_policy/)
        )
    )
    return c
