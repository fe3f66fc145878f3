"""Observation grids to token ids, inside jit.

A BPE tokenizer with a regex pre-tokenizer first cuts text into chunks and merges bytes only
inside a chunk. A grid row followed by its newline is such a run of whole chunks for the
tokenizers we use (Qwen2.5: a punctuation run absorbs the newlines that follow it, letters absorb
at most one preceding non-newline; SmolLM2 / GPT-2 byte-level: a single newline is its own chunk),
so a grid's text tokenizes as the concatenation of its rows' tokens. The tests check this claim
against the tokenizer on many random states.

``GridTokenTable.build`` therefore tokenizes every possible row once on the host, keyed by the
mixed-radix number of the row's symbol ids, and ``render_grid_tokens`` renders a symbol grid by
looking up its rows and packing their variable-length token runs contiguously. With
``border_is_wall`` (Sokoban rooms always have a wall border) only the interior cells of a row
vary, so a 6x6 room needs 7^4 rows and an 8x8 room 7^6.

``pack_runs`` is the packing primitive: it concatenates several stacks of padded token runs into one
fixed-length vector with a single scatter, so packing costs the same for every row of a batch.
"""

from __future__ import annotations

import functools
import itertools
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct

PAD_ID = 0  # value of the positions past a rendered sequence's length


def tokenize_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, with no special tokens added, in one batched call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: ~2x faster than __call__ on 100k rows
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)  # _fast: tokenizers>=0.21
        return [e.ids for e in encode(list(texts), add_special_tokens=False)]
    return tokenizer(list(texts), add_special_tokens=False)["input_ids"]


def padded_table(token_lists: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged token lists as ``(int32[n, max_len] padded with PAD_ID, int32[n] lengths)``."""
    lengths = np.array([len(t) for t in token_lists], np.int32)
    ids = np.full((len(token_lists), max(1, int(lengths.max(initial=0)))), PAD_ID, np.int32)
    for i, tokens in enumerate(token_lists):
        ids[i, : len(tokens)] = tokens
    return ids, lengths


def pack_runs(runs, out_len: int):
    """Concatenate padded token runs into ``(int32[out_len], length)``.

    ``runs`` is a static list of ``(ids[n, T], lengths[n])`` stacks (a single run is ``n = 1``);
    the runs are laid out in order, each occupying only its first ``length`` tokens. Positions past
    the total length hold ``PAD_ID``. ``out_len`` must bound the total length (callers size it from
    the tables' maxima).
    """
    ids = [jnp.asarray(i, jnp.int32) for i, _ in runs]
    lengths = jnp.concatenate([jnp.reshape(n, (-1,)).astype(jnp.int32) for _, n in runs])
    starts = jnp.cumsum(lengths) - lengths
    positions, values, first = [], [], 0
    for stack in ids:
        n, width = stack.shape
        offsets = jnp.arange(width)[None, :]
        pos = starts[first : first + n, None] + offsets
        valid = offsets < lengths[first : first + n, None]
        positions.append(jnp.where(valid, pos, out_len).ravel())  # out_len: dropped by the scatter
        values.append(stack.ravel())
        first += n
    out = jnp.full((out_len,), PAD_ID, jnp.int32)
    out = out.at[jnp.concatenate(positions)].set(jnp.concatenate(values), mode="drop")
    return out, jnp.sum(lengths)


@struct.dataclass
class GridTokenTable:
    """Token ids of every possible grid row (with its trailing newline), keyed by row content.

    Row key: the symbol ids of the row's varying cells read as a base-``num_symbols`` number, first
    cell most significant. With ``border_is_wall`` the first and last columns are the wall and not
    part of the key (the all-wall top and bottom rows are the key of an all-wall interior).
    """

    ids: jnp.ndarray  # int32[num_symbols ** key_width, max_row_tokens]
    lengths: jnp.ndarray  # int32[num_symbols ** key_width]
    num_symbols: int = struct.field(pytree_node=False)
    grid_shape: tuple[int, int] = struct.field(pytree_node=False)
    border_is_wall: bool = struct.field(pytree_node=False)

    @property
    def max_len(self) -> int:
        """Static bound on a rendered grid's token count."""
        return self.grid_shape[0] * self.ids.shape[1]

    @classmethod
    def build(
        cls,
        tokenizer,
        symbols: Sequence[str],
        grid_shape: tuple[int, int],
        border_is_wall: bool = False,
        wall_symbol: int = 0,
    ) -> "GridTokenTable":
        """Tokenize all ``len(symbols) ** width`` rows in one batch (117,649 rows take ~2 s).

        ``border_is_wall``: every grid has symbol ``wall_symbol`` all around its border (Sokoban),
        so only the ``cols - 2`` interior cells of a row vary.
        """
        rows, cols = grid_shape
        width = cols - 2 if border_is_wall else cols
        if width < 1:
            raise ValueError(f"Grid shape {grid_shape} leaves no varying cells in a row.")
        wall = symbols[wall_symbol] if border_is_wall else ""
        ids, lengths = _row_table(tokenizer, tuple(symbols), width, wall)
        return cls(
            ids=jnp.asarray(ids),
            lengths=jnp.asarray(lengths),
            num_symbols=len(symbols),
            grid_shape=(rows, cols),
            border_is_wall=border_is_wall,
        )

    def row_keys(self, symbol_grid) -> jnp.ndarray:
        """Jittable: ``int32[rows]`` table keys of a ``[rows, cols]`` symbol grid."""
        cells = jnp.asarray(symbol_grid, jnp.int32)
        if self.border_is_wall:
            cells = cells[:, 1:-1]
        weights = self.num_symbols ** jnp.arange(cells.shape[1] - 1, -1, -1, dtype=jnp.int32)
        return cells @ weights


@functools.lru_cache(maxsize=8)  # several tags / thinking modes share one env's rows
def _row_table(tokenizer, symbols: tuple[str, ...], width: int, wall: str):
    # itertools.product enumerates in mixed-radix order, first cell most significant.
    texts = [wall + "".join(cells) + wall + "\n" for cells in itertools.product(symbols, repeat=width)]
    return padded_table(tokenize_texts(tokenizer, texts))


def grid_runs(table: GridTokenTable, symbol_grid):
    """Jittable: the grid's rows as a stack of padded token runs ``(ids[rows, T], lengths[rows])``."""
    keys = table.row_keys(symbol_grid)
    return table.ids[keys], table.lengths[keys]


def render_grid_tokens(table: GridTokenTable, symbol_grid):
    """Jittable, vmappable: token ids of the grid's text plus a final newline.

    Returns ``(int32[table.max_len], length)``; equals
    ``tokenizer(render_text(state) + "\\n")`` on the first ``length`` positions.
    """
    return pack_runs([grid_runs(table, symbol_grid)], table.max_len)
