"""Env variants by name, as in RAGEN's ``config/envs.yaml``, and registration of your own.

``make("SimpleSokoban", num_boxes=2)`` builds the variant's env class with the variant's defaults,
overridden by keyword. A name that is no variant but a path ``"package.module:Class"`` imports
that class and builds it with the keywords, so a user's env needs no registration at all
(``--config.envs.train.tags=('mypkg.myenv:Maze',)``). ``register("Maze", Maze, size=5)`` (a class
or such a path, and default keywords) adds a variant by name. An unknown name or parameter is a
``ValueError`` listing what exists.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

# name -> ("module:Class" or the class, default constructor kwargs)
VARIANTS: dict[str, tuple[Any, dict[str, Any]]] = {
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
    # A language-action env: its step reads the answer text (answer_width bytes).
    "Countdown": ("envs_jax.countdown:Countdown", {}),
}


def register(name: str, env_class, **defaults) -> None:
    """Make ``name`` a variant: ``env_class`` (a ``TextEnv`` subclass or ``"module:Class"``) built
    with ``defaults``. Registering a name again replaces it."""
    if not name or ":" in name:
        raise ValueError(f"Env name {name!r} must be non-empty and without ':' (':' marks a class path).")
    VARIANTS[name] = (env_class, dict(defaults))


def is_class_path(name: str) -> bool:
    return ":" in name


def is_known(name: str) -> bool:
    """Whether ``make(name)`` can build something: a variant or a class path."""
    return name in VARIANTS or is_class_path(name)


def known_names() -> str:
    return ", ".join(sorted(VARIANTS)) + ", or a class path 'package.module:Class'"


def import_class(path: str):
    """The class a ``"package.module:Class"`` path names; a clear ``ValueError`` if it cannot be found."""
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"Env class path {path!r}: cannot import module {module_name!r} ({err}).") from err
    if not hasattr(module, attr):
        raise ValueError(f"Env class path {path!r}: module {module_name!r} has no {attr!r}.")
    return getattr(module, attr)


def _spec(name: str):
    if name in VARIANTS:
        target, defaults = VARIANTS[name]
    elif is_class_path(name):
        target, defaults = name, {}
    else:
        raise ValueError(f"Unknown env {name!r}. Known envs: {known_names()}.")
    return (import_class(target) if isinstance(target, str) else target), defaults


def env_parameters(name: str) -> list[str]:
    """Constructor parameters a variant accepts as overrides."""
    sig = inspect.signature(_spec(name)[0].__init__)
    return [p for p in sig.parameters if p not in ("self", "args", "kwargs")]


def default_max_actions_per_traj(name: str) -> int:
    """The action budget of an episode of ``name`` where the config gives none: its class's
    ``default_max_actions_per_traj`` (read without building the env)."""
    return int(_spec(name)[0].default_max_actions_per_traj)


def make(name: str, **overrides):
    """Build the env variant (or class path) ``name`` with its defaults, overridden by ``overrides``."""
    cls, defaults = _spec(name)
    allowed = env_parameters(name)
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ValueError(
            f"Unknown parameter(s) {', '.join(unknown)} for env {name!r}. "
            f"Valid parameters: {', '.join(allowed) or 'none'}."
        )
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise ValueError(
            f"Env {name!r} ({cls.__name__}) does not declare {', '.join(missing)}, which the environment "
            "contract requires (envs_jax.base.TextEnv, docs/environments.md)."
        )
    env = cls(**{**defaults, **overrides})
    env.name = name
    return env
