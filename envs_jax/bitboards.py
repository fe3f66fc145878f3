"""Sets of grid cells as bits (bitboards).

Bit ``i % 32`` of word ``i // 32`` stands for the row-major cell ``i``, and the words are a tuple of
``uint32`` scalars (``num_words`` of them). Under ``vmap`` each word is one ``uint32[batch]``
array, so a step's bit reads and writes are a handful of elementwise ops on batch-long vectors: the
form that XLA vectorises on CPU, and several times less memory traffic than a grid of cells per row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
