"""Env variants by name, as in RAGEN's ``config/envs.yaml``.

``make("SimpleSokoban", num_boxes=2)`` builds the variant's env class with the variant's defaults,
overridden by keyword. An unknown name or parameter is a ``ValueError`` listing what exists.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

# name -> ("module:Class", default constructor kwargs)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "Bandit": ("envs_jax.bandit:Bandit", dict(lo_arm_name="Phoenix", hi_arm_name="Dragon")),
    "BanditTest": ("envs_jax.bandit:Bandit", dict(lo_arm_name="Trader", hi_arm_name="Librarian")),
    "SimpleSokoban": ("envs_jax.sokoban:Sokoban", dict(dim_room=(6, 6), num_boxes=1, search_depth=300)),
    "LargerSokoban": ("envs_jax.sokoban:Sokoban", dict(dim_room=(8, 8), num_boxes=2, search_depth=10)),
    "SokobanDifferentGridVocab": (
        "envs_jax.sokoban:Sokoban",
        dict(
            dim_room=(6, 6),
            num_boxes=1,
            search_depth=30,
            grid_symbols=("W", ".", "G", "C", "B", "A", "@"),
        ),
    ),
    "FrozenLake": ("envs_jax.frozen_lake:FrozenLake", dict(size=4, p=0.8, is_slippery=True)),
}


def _env_class(name: str):
    module, cls = VARIANTS[name][0].split(":")
    return getattr(importlib.import_module(module), cls)


def env_parameters(name: str) -> list[str]:
    """Constructor parameters a variant accepts as overrides."""
    sig = inspect.signature(_env_class(name).__init__)
    return [p for p in sig.parameters if p != "self"]


def make(name: str, **overrides):
    """Build the env variant ``name`` with its defaults, overridden by ``overrides``."""
    if name not in VARIANTS:
        raise ValueError(f"Unknown env {name!r}. Known envs: {', '.join(sorted(VARIANTS))}.")
    allowed = env_parameters(name)
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ValueError(
            f"Unknown parameter(s) {', '.join(unknown)} for env {name!r}. "
            f"Valid parameters: {', '.join(allowed)}."
        )
    env = _env_class(name)(**{**VARIANTS[name][1], **overrides})
    env.name = name
    return env
