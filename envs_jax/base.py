"""The environment interface every starpo-jax env follows.

Envs are jumanji ``Environment`` subclasses: ``reset(key)`` and ``step(state, action)`` are pure,
``jit``- and ``vmap``-able and return ``(state, TimeStep)``. Static parameters (room size, symbols,
payouts) live on the env object; everything that varies lives in the state pytree.

On top of jumanji, a text env also provides what the LLM rollout needs:

- ``action_names``: action names in action-id order (ids are 0-based; RAGEN's ``k`` is our ``k-1``).
- ``render_text(state) -> str``: the observation exactly as RAGEN renders it (host side).
- ``reset_from_seed(seed) -> state``: host-side reproduction of RAGEN's ``reset(seed)``, so
  validation sets are RAGEN's levels.
- grid envs: ``symbols`` (the glyph of each symbol id) and ``render_symbols(state)`` (jittable,
  ``int32[rows, cols]`` symbol ids), from which text and token ids are rendered; and
  ``state_from_text(text)`` for custom levels.

Terminated and truncated stay apart: a terminated step has discount 0, a truncated one discount 1,
both are ``StepType.LAST``. ``extras`` holds per-step ``success``, ``action_is_effective`` and
``action_is_valid`` (RAGEN's ``info`` keys).
"""

from __future__ import annotations

import abc
from functools import cached_property
from typing import Any, Sequence

import jax.numpy as jnp
from jumanji import specs
from jumanji.env import Environment
from jumanji.types import StepType, TimeStep


def make_timestep(
    observation: Any,
    reward: jnp.ndarray,
    terminated: jnp.ndarray,
    truncated: jnp.ndarray,
    extras: dict[str, jnp.ndarray],
) -> TimeStep:
    """A jittable TimeStep from explicit flags (jumanji's helpers pick the step type in Python)."""
    last = jnp.logical_or(terminated, truncated)
    return TimeStep(
        step_type=jnp.where(last, StepType.LAST, StepType.MID).astype(jnp.int8),
        reward=jnp.asarray(reward, jnp.float32),
        discount=jnp.where(terminated, 0.0, 1.0).astype(jnp.float32),
        observation=observation,
        extras=extras,
    )


def first_timestep(observation: Any) -> TimeStep:
    """The TimeStep returned by ``reset``."""
    return TimeStep(
        step_type=jnp.asarray(StepType.FIRST, jnp.int8),
        reward=jnp.zeros((), jnp.float32),
        discount=jnp.ones((), jnp.float32),
        observation=observation,
        extras={
            "success": jnp.zeros((), bool),
            "action_is_effective": jnp.zeros((), bool),
            "action_is_valid": jnp.zeros((), bool),
        },
    )


def step_extras(success, effective, valid=True) -> dict[str, jnp.ndarray]:
    return {
        "success": jnp.asarray(success, bool),
        "action_is_effective": jnp.asarray(effective, bool),
        "action_is_valid": jnp.asarray(valid, bool),
    }


class TextEnv(Environment, abc.ABC):
    """A jumanji environment whose observations an LLM reads as text."""

    #: registry name of the variant (e.g. "SimpleSokoban"); set by ``envs_jax.make``.
    name: str = ""

    @property
    @abc.abstractmethod
    def action_names(self) -> tuple[str, ...]:
        """Action names in action-id order."""

    @abc.abstractmethod
    def render_text(self, state) -> str:
        """The observation text exactly as RAGEN renders it."""

    @abc.abstractmethod
    def reset_from_seed(self, seed: int):
        """Host-side reproduction of RAGEN's ``reset(seed)``; returns a state."""

    @abc.abstractmethod
    def observe(self, state):
        """Jittable: what the prompt shows of ``state`` (the TimeStep observation)."""

    @property
    def action_name_orders(self) -> tuple[tuple[str, ...], ...]:
        """Every ordering of action names an episode can have (Bandit's arm order varies)."""
        return (self.action_names,)

    def action_name_order(self, state) -> jnp.ndarray:
        """Jittable: index into ``action_name_orders`` of this episode's names."""
        return jnp.zeros((), jnp.int32)


class GridEnv(TextEnv, abc.ABC):
    """A text env whose observation is a grid of symbols, one glyph per cell."""

    #: The glyph of each symbol id, e.g. Sokoban ``("#", "_", "O", "√", "X", "P", "S")``; set in ``__init__``.
    grid_symbols: tuple[str, ...] = ()

    @property
    def symbols(self) -> tuple[str, ...]:
        return self.grid_symbols

    @cached_property
    def action_spec(self):
        return specs.DiscreteArray(len(self.action_names), name="action")

    @property
    @abc.abstractmethod
    def grid_shape(self) -> tuple[int, int]:
        """(rows, cols) of the rendered grid."""

    @abc.abstractmethod
    def render_symbols(self, state) -> jnp.ndarray:
        """Jittable: ``int32[rows, cols]`` symbol ids of the observation."""

    @abc.abstractmethod
    def state_from_text(self, text: str):
        """A state from a rendered grid; a malformed grid is a ``ValueError`` naming the problem."""

    def observe(self, state) -> jnp.ndarray:
        return self.render_symbols(state)

    def render_text(self, state) -> str:
        return symbols_to_text(self.render_symbols(state), self.symbols)


def symbols_to_text(grid, symbols: Sequence[str]) -> str:
    """Rows of glyphs joined by newlines, no trailing newline (RAGEN's text rendering)."""
    import numpy as np

    grid = np.asarray(grid)
    return "\n".join("".join(symbols[int(c)] for c in row) for row in grid)


def parse_grid_text(text: str, symbols: Sequence[str], what: str) -> list[list[int]]:
    """Split a rendered grid into symbol ids; ragged rows or unknown glyphs are ValueErrors."""
    lookup = {s: i for i, s in enumerate(symbols)}
    rows = text.strip("\n").split("\n")
    if not rows or not rows[0]:
        raise ValueError(f"{what} level is empty.")
    width = len(rows[0])
    ids = []
    for r, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(
                f"{what} level has ragged rows: row {r} has {len(row)} cells, row 0 has {width}."
            )
        for c, ch in enumerate(row):
            if ch not in lookup:
                raise ValueError(
                    f"{what} level has unknown symbol {ch!r} at row {r}, column {c}; "
                    f"known symbols: {' '.join(symbols)}."
                )
        ids.append([lookup[ch] for ch in row])
    return ids
