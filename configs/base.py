"""RAGEN v1 defaults (StarPO-S on SimpleSokoban with Qwen2.5-0.5B-Instruct).

Every value here is the original's effective default (docs/ragen-reference.md §2.1, §3.1–3.7), unless
a comment says otherwise; every key but the env sides comes from ``starpo_jax/runtime/settings.py``, where
each is declared once. Env files (``sokoban.py``, ``frozen_lake.py``, ``bandit.py``) and
``presets.py`` start from ``get_config()`` and override. Override any key on the command line:
``python -m experiments.run --config configs/sokoban.py --config.rollout.max_turn=3``.
"""

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ml_collections import ConfigDict

import envs_jax
from starpo_jax.runtime.settings import SECTIONS, ConfigError, config_section

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


def saved_config(path: str | Path) -> ConfigDict:
    """A run's ``config.json``; a setting added to the project since it was written takes its
    default, so that an earlier run folder can still be evaluated or compared."""

    def merged(default: dict, saved: dict) -> dict:
        return {**default, **{key: merged(default[key], value) if isinstance(value, dict)
                              and isinstance(default.get(key), dict) else value for key, value in saved.items()}}

    try:
        saved = json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ConfigError(f"{path} is not a run's config: it is not valid JSON ({err}).") from None
    if not isinstance(saved, dict):
        raise ConfigError(f"{path} is not a run's config: it holds no JSON object.")
    return ConfigDict(merged(get_config().to_dict(), saved))


def get_config() -> ConfigDict:
    c = ConfigDict()
    # Every section's keys, with their defaults, allowed values and where they go, are declared once
    # in starpo_jax/runtime/settings.py (SETTINGS); the env sides below are not (settings.UNDECLARED says why).
    for section in SECTIONS:
        c[section] = config_section(section)
    # No envs.train.seed (RAGEN's seed.train = 10000): training draws fresh levels in JAX from the
    # run's key (trainer.seed; starpo_jax.train.collect), not from RAGEN's seeded generator, so such
    # a seed could not give RAGEN's training levels, and trainer.seed alone repeats or varies a run.
    c.envs.train = env_split(["SimpleSokoban"], [8], group_size=16)
    c.envs.val = env_split(["SimpleSokoban"], [256], group_size=1)
    c.envs.val.seed = 123  # quirk 13: every validation plays RAGEN's levels of seeds 123, 124, ...
    # Per-tag action budgets (RAGEN envs.yaml), each its env class's default_max_actions_per_traj;
    # a key per tag so that the command line can override it. A tag without a key takes its env's.
    c.envs.max_actions_per_traj = ConfigDict({tag: envs_jax.default_max_actions_per_traj(tag) for tag in BUDGET_TAGS})
    # Extra constructor arguments per tag, e.g. {"Bandit": {"lo_arm_name": "Engineer"}}.
    c.envs.overrides = ConfigDict()
    return c
