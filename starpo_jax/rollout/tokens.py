"""Observation pieces to token ids, inside jit.

A BPE tokenizer with a regex pre-tokenizer first cuts text into chunks and merges bytes only
inside a chunk. An env's observation pieces (``envs_jax.base.TextEnv``: a grid row with its
newline, a number with its leading separator, a fixed text) are cut where every tokenizer we use
starts a new chunk (Qwen2.5: a punctuation run absorbs the newlines that follow it, letters absorb
at most one preceding non-newline; SmolLM2 / GPT-2 byte-level: a single newline is its own chunk),
so an observation's text tokenizes as the concatenation of its pieces' tokens. The tests check
this claim against the tokenizer on many random states, and ``starpo_jax.rollout.prompts.check_cuts``
checks it for every env when its tables are built.

``PieceTable.build`` therefore tokenizes every piece of the env's table once on the host, and
``render_pieces`` renders an observation by looking up its pieces and packing their
variable-length token runs contiguously. A grid env's table holds every possible row (with a fixed
wall border, every possible interior: a 6x6 Sokoban room needs 7^4 rows, an 8x8 room 7^6).

``pack_runs`` is the packing primitive: it concatenates several stacks of padded token runs into one
fixed-length vector with a single scatter, so packing costs the same for every row of a batch.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax.numpy as jnp
import numpy as np
from flax import struct

PAD_ID = 0  # value of the positions past a rendered sequence's length


def tokenize_texts(tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, with no special tokens added, in one batched call."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer directly: __call__'s Python wrapping costs more on large tables
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


class PieceTable(struct.PyTreeNode):
    """Token ids of every observation piece of an env: piece ``k`` is ``ids[k, :lengths[k]]``."""

    ids: jnp.ndarray  # int32[num_pieces, max_piece_tokens]
    lengths: jnp.ndarray  # int32[num_pieces]
    num_pieces: int = struct.field(pytree_node=False)  # pieces per observation (its budget)

    @property
    def max_len(self) -> int:
        """Static bound on a rendered observation's token count."""
        return self.num_pieces * self.ids.shape[1]

    @classmethod
    def build(cls, tokenizer, texts: Sequence[str], num_pieces: int, followed_by: str) -> "PieceTable":
        """Tokenize the piece table in one batch (an 8x8 Sokoban room has 7^6 = 117,649 rows); each
        piece as it reads before ``followed_by`` (see ``tokenize_before``)."""
        ids, lengths = _tokenized_table(tokenizer, tuple(texts), followed_by)
        return cls(ids=jnp.asarray(ids), lengths=jnp.asarray(lengths), num_pieces=int(num_pieces))

    def piece_ids(self, piece: int) -> list[int]:
        """Host: the token ids of one piece."""
        # On the host (numpy): slicing the device array would compile a program per piece length.
        return np.asarray(self.ids)[piece, : int(np.asarray(self.lengths)[piece])].tolist()


@functools.lru_cache(maxsize=8)  # several tags / thinking modes share one env's pieces
def _tokenized_table(tokenizer, texts: tuple[str, ...], followed_by: str):
    return padded_table(tokenize_before(tokenizer, texts, followed_by))


def tokenize_before(tokenizer, texts: Sequence[str], word: str) -> list[list[int]]:
    """Token ids of each text as it is tokenized when ``word`` follows it.

    An observation piece is always followed by text (another piece, or the prompt's "You have"),
    never by the end of the string, and that can matter: GPT-2-style pre-tokenizers (SmolLM2) keep a
    run of newlines whole at the end of a string but split off its last newline before a word, so
    Bandit's text, ending in ".\\n" + "\\n", tokenizes differently alone. A text whose tokens
    before ``word`` do not end with ``word``'s own tokens merges with it; it keeps its own tokens
    (and the cut checks of ``starpo_jax.rollout.prompts`` then refuse the table if that matters).
    """
    word_ids = tokenize_texts(tokenizer, [word])[0]
    n = len(word_ids)
    before = tokenize_texts(tokenizer, [t + word for t in texts])
    merged = [i for i, ids in enumerate(before) if ids[-n:] != word_ids]
    alone = dict(zip(merged, tokenize_texts(tokenizer, [texts[i] for i in merged]))) if merged else {}
    return [alone[i] if i in alone else ids[:-n] for i, ids in enumerate(before)]


def piece_runs(table: PieceTable, pieces):
    """Jittable: the pieces as a stack of padded token runs ``(ids[P, T], lengths[P])``; a piece
    ``-1`` is empty."""
    pieces = jnp.asarray(pieces, jnp.int32)
    present = pieces >= 0
    safe = jnp.where(present, pieces, 0)
    return table.ids[safe], jnp.where(present, table.lengths[safe], 0)


def render_pieces(table: PieceTable, pieces):
    """Jittable, vmappable: token ids of an observation's text plus its final newline.

    Returns ``(int32[table.max_len], length)``; equals
    ``tokenizer(render_text(state) + "\\n")`` on the first ``length`` positions.
    """
    return pack_runs([piece_runs(table, pieces)], table.max_len)
