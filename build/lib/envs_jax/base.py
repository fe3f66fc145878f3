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

Randomness inside ``step`` (FrozenLake's slips, Bandit's payouts) comes from ``draw_bits``: a
counter-based hash of the key carried in the state, not ``jax.random``. ``reset`` still uses
``jax.random``. Why: under ``vmap`` on CPU, ``jax.random.split`` + ``uniform`` per row and step
costs about 45 ns (three threefry blocks), more than the rest of the step; the hash about 2 ns.
``jax.random``'s other key implementations are slower on CPU (``rbg`` ~125 ns, ``unsafe_rbg``
~800 ns per row-step under ``vmap``).
"""

from __future__ import annotations

import abc
import math
from functools import cached_property
from typing import Any, Sequence

import jax
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


#: Added to the key's second word at every draw: an odd constant (2**32 / golden ratio), so the
#: keys ``(s, k)`` and ``(s, k + 1)`` (e.g. ``PRNGKey`` of consecutive seeds) do not reuse each
#: other's draws for about 2**32 / episode length steps.
KEY_INCREMENT = 0x9E3779B9


def mix32(x):
    """A bijective hash of ``uint32`` values (Wellons' "lowbias32"): each input bit flips about
    half of the output bits, so nearby inputs give unrelated outputs."""
    x = jnp.asarray(x, jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_words(a, b):
    """32 random-looking bits from two ``uint32`` words (broadcasting): ``mix32(a ^ mix32(b))``."""
    return mix32(jnp.asarray(a, jnp.uint32) ^ mix32(b))


def key_words(key):
    """The ``uint32`` words of a raw (``jax.random.PRNGKey``) or typed (``jax.random.key``) key."""
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


def draw_bits(key):
    """``(next_key, bits)``: 32 random bits from a PRNG key, and the key to draw from next time.

    The bits hash the key's first two words; the next key adds ``KEY_INCREMENT`` to its second
    word. Same key, same bits. ``key`` is a raw ``uint32`` key (``jax.random.PRNGKey``) or a typed
    one (``jax.random.key``); the next key has the same form.
    """
    words = key_words(key)
    bits = hash_words(words[0], words[1])
    words = jnp.concatenate([words[:1], words[1:2] + jnp.uint32(KEY_INCREMENT), words[2:]])
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    next_key = jax.random.wrap_key_data(words, impl=jax.random.key_impl(key)) if typed else words
    return next_key, bits


def hash_uniform(key, shape):
    """float32 uniforms in [0, 1) of ``shape``: each element hashes the key with its own index.

    Counter-based like ``draw_bits`` (one ``mix32`` per number, about 30x cheaper than
    ``jax.random.uniform`` under ``vmap`` on CPU). Same key, same numbers.
    """
    words = key_words(key)
    index = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
    return bits_to_uniform(hash_words(index, hash_words(words[0], words[1])))


def bits_to_uniform(bits):
    """float32 in [0, 1) from 32 random bits (their top 24, exactly representable)."""
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)


# --------------------------------------------------------------------------- bitboards
#
# A set of grid cells as bits: bit ``i % 32`` of word ``i // 32`` stands for the row-major cell
# ``i``, and the words are a tuple of ``uint32`` scalars (``num_words`` of them). Under ``vmap``
# each word is one ``uint32[batch]`` array, so a step's bit reads and writes are a handful of
# elementwise ops on batch-long vectors: the form that XLA vectorises on CPU, and several times less
# memory traffic than a grid of cells per row.


def num_words(shape) -> int:
    """Words needed for a bitboard of a ``(rows, cols)`` grid."""
    return -(-shape[0] * shape[1] // 32)


def flat_cells(shape):
    """int32[rows, cols]: each cell's row-major index."""
    return jnp.arange(shape[0] * shape[1], dtype=jnp.int32).reshape(shape)


def pack_cells(mask) -> tuple[jnp.ndarray, ...]:
    """The bitboard of ``bool[..., rows, cols]``."""
    mask = jnp.asarray(mask)
    shape = mask.shape[-2:]
    flat = mask.reshape(mask.shape[:-2] + (-1,)).astype(jnp.uint32)
    cells = jnp.arange(flat.shape[-1])
    bits = flat << (cells % 32).astype(jnp.uint32)
    # The bits of a word are distinct powers of two, so their sum is their bitwise or.
    return tuple(
        jnp.sum(bits[..., 32 * w : 32 * (w + 1)], axis=-1, dtype=jnp.uint32)
        for w in range(num_words(shape))
    )


def unpack_cells(words, shape):
    """``bool[..., rows, cols]`` from a bitboard. Each word's cells are shifted out of that word
    (static shifts, no gather: gathers compile to scalar code under ``vmap`` on CPU)."""
    size = shape[0] * shape[1]
    bits = [
        (words[w][..., None] >> jnp.arange(min(32, size - 32 * w), dtype=jnp.uint32)) & 1
        for w in range(len(words))
    ]
    flat = jnp.concatenate(bits, axis=-1)
    return flat.reshape(flat.shape[:-1] + tuple(shape)).astype(bool)


def cell_bit(words, cell):
    """Whether the bitboard holds ``cell`` (int32 index). A cell outside the grid reads an
    arbitrary bit: callers mask such reads out."""
    word = words[0]
    for w in range(1, len(words)):  # a select per word: no gather
        word = jnp.where(cell >> 5 == w, words[w], word)
    return (word >> (cell & 31).astype(jnp.uint32)) & 1 == 1


def toggle_cell(words, cell, on):
    """The bitboard with ``cell``'s bit flipped where ``on``."""
    bit = jnp.where(on, jnp.uint32(1) << (cell & 31).astype(jnp.uint32), jnp.uint32(0))
    return tuple(word ^ jnp.where(cell >> 5 == w, bit, jnp.uint32(0)) for w, word in enumerate(words))


def count_cells(words):
    """int32: cells in the bitboard."""
    return sum(jax.lax.population_count(word).astype(jnp.int32) for word in words)


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
