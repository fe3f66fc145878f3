"""Parsing the agent's ``<think>…</think><answer>A1 || A2</answer>`` reply (ragen-reference.md §2.2–2.4).

Two implementations of the same function:

- ``parse_response_text``: the plain-Python oracle, RAGEN's ``ctx_manager._parse_response`` plus
  the action mapping and format-penalty rule of ``es_manager.step``, on the decoded text.
- An in-graph byte machine on token ids (``init_parser_state`` → ``parser_feed_tokens`` per token
  → ``parser_result``), ``jit``/``vmap``-able, with about sixty int32s of state per row.
  ``parse_response_tokens`` runs it over a whole ``[B, T]`` response with ``lax.scan``; the
  rollout calls that once a turn's responses are decoded (``multi_turn.parse_turn``), in the same
  compiled program, so parsing never leaves the device. (Fed one token at a time, it could run
  inside the decode loop instead; nothing the rollout does needs that.)

**What the oracle computes.** The text is ``tokenizer.decode(ids, skip_special_tokens=True,
clean_up_tokenization_spaces=False)`` (both bundled tokenizers set the clean-up flag to False, and
transformers ≥ 5 never applies it to BPE tokenizers; ``decode_response`` pins it). RAGEN
prepends the forced prefix (``<think>``, or ``<answer>`` without thinking) and takes the first
match of ``<think>(.*?)</think>\\s*<answer>(.*?)</answer>`` (DOTALL), or of
``<answer>(.*?)</answer>``. From each capture it removes, in this order, the strings
``<think> </think> <answer> </answer> <|im_start|> <|im_end|>`` (``str.replace``, one stage per
tag: a tag that only forms once an earlier-stage tag inside it is gone is removed too) and strips
it. The
actions are ``[a.strip() for a in answer.split("||") if a.strip()]``, the first
``max_actions_per_turn`` are kept. The es_manager maps each kept string case-insensitively to an
action id (0-based, in ``action_names`` order) and drops unknown ones; the turn earns the format
penalty when no kept string is a valid action or any kept string is unknown.
Envs without action names (language actions: RAGEN's Countdown) get the kept strings themselves,
and the penalty only when there is none.

**How the byte machine matches action names without buffering text.** Each token id is looked
up in a ``[vocab, max_bytes]`` table of the exact bytes it adds to the decoded text (special tokens add
none). Per byte, a row is in one of three phases:

1. *search*: a DFA over bytes finds the first ``</think>\\s*<answer>`` (the forced ``<think>`` is
   implied). Because ``(.*?)`` is lazy, the regex uses exactly this first occurrence, and matches
   iff a ``</answer>`` follows it. Skipped without thinking.
2. *answer*: a DFA finds the first raw ``</answer>``. The answer's characters are consumed eagerly
   by a *piece* machine: a pending ``|`` (two make a separator), whether the piece has started
   (leading whitespace skipped), the byte position in the piece and a bitmask of action names
   still equal to it (ASCII lower-cased), and the id of the name equal to the piece up to its last
   non-space byte (which is what ``strip`` keeps). A piece longer than every name simply matches
   nothing: no buffer.
   Tag removal uses snapshots: each ``<`` pushes the piece state onto a small stack of open tag
   candidates; when the candidate completes a tag, the piece state is restored from its snapshot,
   so the tag's characters never happened. A candidate interrupted by another ``<`` stays open
   only while the inner one can complete as a tag of an *earlier* removal stage (that is exactly
   when ``str.replace`` stage by stage would join the outer tag across the removed inner one), so
   the stack never needs more than six entries. The raw ``</answer>`` is the open candidate on top
   of the stack, so its snapshot is the final piece state.
3. *done*: matched; later bytes are ignored.

**Answer text** (``answer_width`` > 0, for language-action envs): each piece also carries its
bytes from its first non-space character, in a buffer of ``answer_width`` bytes inside the piece
state, so a completed tag's snapshot restores the text as well; an ``end`` mark after the last
non-space character is what ``strip`` keeps. A kept piece's text is exactly the oracle's action
string (UTF-8), cut at ``answer_width`` bytes; broken UTF-8 stays raw bytes.

Whitespace is Python's ``str.isspace`` set, which is also what ``\\s`` and ``strip()`` use,
multi-byte characters (U+00A0, U+3000, …) included.

**Known divergence.** Python lower-cases U+212A KELVIN SIGN to ASCII ``k``; the byte machine only
lower-cases ASCII, so a piece spelling an action name with a Kelvin sign is unknown here and valid
in RAGEN. It is the only non-ASCII character whose ``lower()`` is ASCII; action names must be
ASCII.

**Think length.** ``think_tokens`` is the number of generated tokens before the token that
completes the ``</think>`` of the match (the forced prefix is not generated; inactive tokens are
not counted); −1 without a match and 0 without thinking.

**[quirk] 4 (ragen-reference.md §2.4; docs/design.md's quirks):** RAGEN trains on the normalised
``llm_response`` it rebuilds from the parse. The byte machine does not rebuild text: under token-in /
token-out the rollout trains on the sampled tokens. The oracle still returns ``llm_response`` for
logs and parity checks.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# Removal order of RAGEN's special_token_list; a tag's stage is its 1-based position.
TAGS = ("<think>", "</think>", "<answer>", "</answer>", "<|im_start|>", "<|im_end|>")
ACTION_SEP = "||"
THINK_PATTERN = re.compile(r"<think>(.*?)</think>\s*<answer>(.*?)</answer>", re.DOTALL)
ANSWER_PATTERN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)

# ----------------------------------------------------------------------------------------------
# The oracle
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
    """One parsed reply, as RAGEN's ctx_manager and es_manager see it."""

    matched: bool
    think: str
    answer: str
    actions: tuple[str, ...]  # kept action strings (at most max_actions_per_turn)
    action_ids: tuple[int, ...]  # one per kept string, -1 where unknown (language actions: none)
    n_valid: int
    format_error: bool  # the turn earns the format penalty: no valid action, or an unknown one
    llm_response: str  # what RAGEN stores in the history and trains on

    @property
    def valid_action_ids(self) -> tuple[int, ...]:
        """The ids the env executes, in order (unknown strings dropped)."""
        return tuple(i for i in self.action_ids if i >= 0)


def _check_action_names(action_names: Sequence[str]) -> list[str]:
    names = [str(n).lower() for n in action_names]
    if not names or any(not n or not n.isascii() for n in names):
        raise ValueError(f"Action names must be non-empty ASCII strings; got {list(action_names)!r}.")
    if len(set(names)) != len(names):
        raise ValueError(f"Action names must differ case-insensitively; got {list(action_names)!r}.")
    return names


def _remove_tags(text: str) -> str:
    for tag in TAGS:  # one str.replace stage per tag, as RAGEN does
        text = text.replace(tag, "").strip()
    return text


def parse_response_text(
    text: str, action_names: Sequence[str] | None, max_actions_per_turn: int, enable_think: bool = True
) -> ParsedResponse:
    """RAGEN's parse of a decoded reply (without the forced prefix) and its action mapping.

    ``action_names=None``: a language-action env (RAGEN's envs without ``action_lookup``, e.g.
    Countdown) takes every kept string as is; the turn's format error is then "no string at all".
    """
    language = action_names is None
    lookup = {} if action_names is None else {name: i for i, name in enumerate(_check_action_names(action_names))}
    response = ("<think>" if enable_think else "<answer>") + text
    match = (THINK_PATTERN if enable_think else ANSWER_PATTERN).search(response)
    if match is None:
        return ParsedResponse(False, "", "", (), (), 0, True, response)
    think, answer = match.groups() if enable_think else ("", match.group(1))
    think, answer = _remove_tags(think), _remove_tags(answer)
    actions = [a.strip() for a in answer.split(ACTION_SEP) if a.strip()]
    if len(actions) > max_actions_per_turn:
        actions = actions[:max_actions_per_turn]
        answer = f" {ACTION_SEP} ".join(actions)
    llm_response = (
        f"<think>{think}</think><answer>{answer}</answer>" if enable_think else f"<answer>{answer}</answer>"
    )
    ids = () if language else tuple(lookup.get(a.lower(), -1) for a in actions)
    n_valid = len(actions) if language else sum(i >= 0 for i in ids)
    format_error = n_valid == 0 or n_valid != len(actions)
    return ParsedResponse(True, think, answer, tuple(actions), ids, n_valid, format_error, llm_response)


def decode_response(tokenizer, token_ids) -> str:
    """The reply text RAGEN parses: special tokens skipped, no clean-up of spaces."""
    return tokenizer.decode(list(token_ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


# ----------------------------------------------------------------------------------------------
# Tables built once on the host
# ----------------------------------------------------------------------------------------------


def build_token_bytes_table(tokenizer, vocab_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(bytes uint8[V, max_bytes], lengths int32[V])``: what each id adds to ``decode_response``.

    Mirrors the tokenizers ByteLevel decoder: a token whose characters are all in the GPT-2
    byte alphabet decodes to those bytes, any other token to its UTF-8 text; special tokens
    (skipped by ``skip_special_tokens``) and ids past the tokenizer (a model's padded vocab,
    ``vocab_size``) add nothing. Concatenating rows then decoding as UTF-8 with replacement
    reproduces ``decode_response`` exactly (tested for Qwen2.5 and SmolLM2).
    """
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # here: seconds to import, for one table

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.decoder).__name__ != "ByteLevel":
        raise ValueError(
            "build_token_bytes_table needs a fast byte-level BPE tokenizer (Qwen2/2.5, SmolLM2, "
            f"Llama-3); got {type(tokenizer).__name__} with decoder "
            f"{type(getattr(backend, 'decoder', None)).__name__}."
        )
    byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
    special = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
    n = max(backend.get_vocab_size(with_added_tokens=True), vocab_size or 0)
    pieces = []
    for i in range(n):
        token = backend.id_to_token(i)
        if token is None or i in special:
            pieces.append(b"")
        elif all(char in byte_of for char in token):
            pieces.append(bytes(byte_of[char] for char in token))
        else:
            pieces.append(token.encode("utf-8"))
    lengths = np.array([len(p) for p in pieces], np.int32)
    table = np.zeros((n, max(int(lengths.max()), 1)), np.uint8)
    for i, p in enumerate(pieces):
        table[i, : len(p)] = np.frombuffer(p, np.uint8)
    return table, lengths


class ActionNames(struct.PyTreeNode):
    """Lower-cased ASCII action names as bytes: ``bytes int32[..., A, L]``, ``lengths int32[..., A]``.

    Leading dims are per-row names (Bandit arms): ``jax.tree.map(lambda a: a[idx], bank)`` picks
    a row's names from a bank of orderings.
    """

    bytes: jax.Array
    lengths: jax.Array


def encode_action_names(action_names, max_name_bytes: int | None = None) -> ActionNames:
    """``ActionNames`` from names in action-id order, or from one such list per row.

    Rows with fewer names are padded with empty names, which never match (pieces are non-empty).
    """
    shared = isinstance(action_names[0], str)
    rows = [_check_action_names(r) for r in ([action_names] if shared else action_names)]
    n_names = max(len(r) for r in rows)
    longest = max(len(n) for r in rows for n in r)
    width = longest if max_name_bytes is None else max_name_bytes
    if n_names > 31:
        raise ValueError(f"At most 31 action names are supported; got {n_names}.")
    if width < longest:
        raise ValueError(f"max_name_bytes={max_name_bytes} is shorter than the longest action name, {longest}.")
    table = np.zeros((len(rows), n_names, width), np.int32)
    lengths = np.zeros((len(rows), n_names), np.int32)
    for r, names in enumerate(rows):
        for a, name in enumerate(names):
            table[r, a, : len(name)] = list(name.encode())
            lengths[r, a] = len(name)
    if shared:
        table, lengths = table[0], lengths[0]
    return ActionNames(jnp.asarray(table), jnp.asarray(lengths))


class ParserTables(struct.PyTreeNode):
    token_bytes: jax.Array  # uint8[V, max_bytes]
    token_lengths: jax.Array  # int32[V]
    names: ActionNames  # [A, L] shared, or [B, A, L] per row


class _Nfa:
    """A byte NFA for unanchored search (state 0 loops on every byte)."""

    def __init__(self):
        self.edges: list[list[tuple[int, int]]] = [[(b, 0) for b in range(256)]]

    def state(self) -> int:
        self.edges.append([])
        return len(self.edges) - 1

    def literal(self, src: int, text: bytes, dst: int | None = None) -> int:
        for k, byte in enumerate(text):
            nxt = dst if (dst is not None and k == len(text) - 1) else self.state()
            self.edges[src].append((byte, nxt))
            src = nxt
        return src


def _subset_dfa(nfa: _Nfa, accept: int, mark: tuple[int, int] | None = None):
    """Determinise ``nfa``: (next int32[S, 256], accept bool[S], crossed int32[S, 256]).

    ``crossed[s, b]`` says the transition used the NFA edge ``mark = (src, byte)``. Accepting
    DFA states are absorbing.
    """
    start = frozenset([0])
    index, queue, rows = {start: 0}, [start], []
    while queue:
        current = queue.pop(0)
        nxt_row, crossed_row = [], []
        for byte in range(256):
            target = frozenset(d for s in current for b, d in nfa.edges[s] if b == byte)
            if accept in current:
                target = current
            if target not in index:
                index[target] = len(index)
                queue.append(target)
            nxt_row.append(index[target])
            crossed = mark is not None and mark[0] in current and byte == mark[1]
            crossed_row.append(crossed and accept not in current)
        rows.append((nxt_row, crossed_row))
    accepting = np.zeros(len(index), bool)
    for states, i in index.items():
        accepting[i] = accept in states
    return (
        np.array([r[0] for r in rows], np.int32),
        accepting,
        np.array([r[1] for r in rows], np.int32),
    )


def _whitespace() -> tuple[list[int], list[bytes]]:
    """Python's whitespace (``isspace``, ``\\s``, ``strip``): ASCII bytes and UTF-8 sequences."""
    chars = [chr(c) for c in range(sys.maxunicode + 1) if chr(c).isspace()]
    return [ord(c) for c in chars if ord(c) < 128], [c.encode() for c in chars if ord(c) >= 128]


def _trie(words: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """(next int32[N, 256] with 0 = no such prefix, word int32[N] = 1-based word index or 0)."""
    nodes: dict[bytes, int] = {b"": 0}
    for word in words:
        for k in range(1, len(word) + 1):
            nodes.setdefault(word[:k], len(nodes))
    nxt = np.zeros((len(nodes), 256), np.int32)
    word_of = np.zeros(len(nodes), np.int32)
    for prefix, i in nodes.items():
        if prefix:
            nxt[nodes[prefix[:-1]], prefix[-1]] = i
    for w, word in enumerate(words, start=1):
        word_of[nodes[word]] = w
    return nxt, word_of


def _trie_prefixes(nxt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(bytes int32[N, D], length int32[N]): the bytes each trie node stands for."""
    prefixes = {0: b""}
    for node in range(nxt.shape[0]):  # a child's id is larger than its parent's
        for byte in np.nonzero(nxt[node])[0]:
            prefixes[int(nxt[node, byte])] = prefixes[node] + bytes([int(byte)])
    depth = max(len(p) for p in prefixes.values())
    table = np.zeros((nxt.shape[0], depth), np.int32)
    for node, prefix in prefixes.items():
        table[node, : len(prefix)] = list(prefix)
    return table, np.array([len(prefixes[n]) for n in range(nxt.shape[0])], np.int32)


@functools.cache
def _machine_tables() -> dict[str, np.ndarray]:
    ascii_ws, multibyte_ws = _whitespace()

    # search for </think>\s*<answer>; the whitespace loop state sits right after "</think>"
    nfa = _Nfa()
    before_gt = nfa.literal(0, b"</think")
    loop = nfa.state()
    nfa.edges[before_gt].append((ord(">"), loop))
    for ws in ascii_ws:
        nfa.edges[loop].append((ws, loop))
    for seq in multibyte_ws:
        nfa.literal(loop, seq, dst=loop)
    accept = nfa.literal(loop, b"<answer>")
    think_next, think_accept, think_closed = _subset_dfa(nfa, accept, mark=(before_gt, ord(">")))

    nfa = _Nfa()
    accept = nfa.literal(0, b"</answer>")
    close_next, close_accept, _ = _subset_dfa(nfa, accept)

    tag_next, tag_stage = _trie([t.encode() for t in TAGS])
    tag_mask = np.zeros(len(tag_stage), np.int32)  # bit s-1: the node is a prefix of stage s's tag
    for s, tag in enumerate(TAGS, start=1):
        node = 0
        for tag_byte in tag.encode():
            node = tag_next[node, tag_byte]
            tag_mask[node] |= 1 << (s - 1)

    ws_next, ws_done = _trie(multibyte_ws)
    ws_bytes, ws_length = _trie_prefixes(ws_next)
    byte = np.arange(256)  # every byte value
    return dict(
        think_next=think_next,
        think_accept=think_accept,
        think_closed=think_closed,
        close_next=close_next,
        close_accept=close_accept,
        tag_next=tag_next,
        tag_stage=tag_stage,
        tag_mask=tag_mask,
        ws_next=ws_next,
        ws_done=(ws_done > 0),
        ws_bytes=ws_bytes,
        ws_length=ws_length,
        ascii_ws=np.isin(byte, ascii_ws),
        lower=np.where((byte >= ord("A")) & (byte <= ord("Z")), byte + 32, byte).astype(np.int32),
    )


def _table(name: str) -> jax.Array:
    return jnp.asarray(_machine_tables()[name])  # a constant of the traced graph


# ----------------------------------------------------------------------------------------------
# The byte machine
# ----------------------------------------------------------------------------------------------

SEARCH, ANSWER, DONE = 0, 1, 2
STACK = 6  # open tag candidates; a 7th could never complete (one removal stage per level)
_LT, _BAR = ord("<"), ord("|")


class PieceText(struct.PyTreeNode):
    """The piece's text, kept for envs that take the answer itself (language actions)."""

    bytes: jax.Array  # int32[W]: the piece's bytes from its first non-space character, tags removed
    size: jax.Array  # bytes written (past W they are dropped)
    end: jax.Array  # size after the last non-space character: what ``strip`` keeps


class AnswerText(struct.PyTreeNode):
    """The kept answer pieces as text: what a language-action env receives (RAGEN's action strings)."""

    bytes: jax.Array  # uint8[B, K, W] each kept piece's bytes, zero-padded, cut at W bytes
    lengths: jax.Array  # int32[B, K] bytes of each kept piece (at most W; 0: no piece)


class Piece(struct.PyTreeNode):
    """The answer piece being read (between separators), as int32 scalars per row."""

    pipe: jax.Array  # 1: a single '|' is pending (a second one makes the separator)
    ws: jax.Array  # node in the trie of multi-byte whitespace characters, 0 = none pending
    started: jax.Array  # 1: a non-space character was seen (leading whitespace is stripped)
    pos: jax.Array  # bytes read since the piece started
    alive: jax.Array  # bitmask of action names equal (so far) to the piece's bytes
    match: jax.Array  # action id equal to the piece up to its last non-space byte, else -1
    text: PieceText | None = None  # only when the parser keeps answer text (``answer_width`` > 0)


class ParserState(struct.PyTreeNode):
    """Per-row parser state; every field has the batch as its leading dim."""

    phase: jax.Array  # SEARCH, ANSWER or DONE
    search: jax.Array  # DFA state of the </think>\s*<answer> search
    close: jax.Array  # DFA state of the </answer> search
    n_tokens: jax.Array  # active tokens fed so far
    think_mark: jax.Array  # n_tokens when the latest </think> completed
    think_tokens: jax.Array
    piece: Piece
    stack_node: jax.Array  # [B, STACK] tag-trie node of each open candidate
    stack_floor: jax.Array  # [B, STACK] highest stage removed inside it (it must complete later)
    stack_snap: Piece  # [B, STACK] piece state before each candidate's '<'
    depth: jax.Array  # candidates pushed; open ones are levels base..depth-1 (slot = level % STACK)
    base: jax.Array
    n_pieces: jax.Array  # non-empty pieces ended so far
    n_valid: jax.Array  # kept pieces that are action names
    action_ids: jax.Array  # [B, K] id per kept piece, -1 unknown / none
    valid_ids: jax.Array  # [B, K] the valid ids in order, -1 padded
    answers: AnswerText | None = None  # int32 bytes [B, K, W] of the kept pieces (``answer_width`` > 0)


class ParseResult(struct.PyTreeNode):
    action_ids: jax.Array  # int32[B, K]: id per kept action string, -1 where unknown or absent
    valid_action_ids: jax.Array  # int32[B, K]: the ids the env executes, in order, -1 padded
    n_kept: jax.Array  # int32[B]: kept action strings
    n_valid: jax.Array  # int32[B]
    matched: jax.Array  # bool[B]: the regex matched
    format_error: jax.Array  # bool[B]: the turn earns the format penalty (no valid action, or an unknown one)
    think_tokens: jax.Array  # int32[B]: see the module docstring
    answers: AnswerText | None = None  # the kept pieces' text, with ``answer_width`` > 0


def _empty_piece(shape=(), answer_width: int = 0) -> Piece:
    zero = jnp.zeros(shape, jnp.int32)
    text = PieceText(jnp.zeros(shape + (answer_width,), jnp.int32), zero, zero) if answer_width else None
    return Piece(pipe=zero, ws=zero, started=zero, pos=zero, alive=zero - 1, match=zero - 1, text=text)


def init_parser_state(batch: int, max_actions_per_turn: int, enable_think=True, answer_width: int = 0) -> ParserState:
    """Fresh state for a turn; ``enable_think`` may be a bool or a bool[batch] array.

    ``answer_width`` > 0 also keeps each kept piece's text, its first ``answer_width`` bytes (for
    language-action envs); 0 keeps action ids only.
    """
    zero = jnp.zeros((batch,), jnp.int32)
    think = jnp.broadcast_to(jnp.asarray(enable_think, bool), (batch,))
    k = max_actions_per_turn
    answers = None
    if answer_width:
        answers = AnswerText(jnp.zeros((batch, k, answer_width), jnp.int32), jnp.zeros((batch, k), jnp.int32))
    return ParserState(
        phase=jnp.where(think, SEARCH, ANSWER).astype(jnp.int32),
        search=zero,
        close=zero,
        n_tokens=zero,
        think_mark=zero - 1,
        think_tokens=jnp.where(think, -1, 0).astype(jnp.int32),
        piece=_empty_piece((batch,), answer_width),
        stack_node=jnp.zeros((batch, STACK), jnp.int32),
        stack_floor=jnp.zeros((batch, STACK), jnp.int32),
        stack_snap=_empty_piece((batch, STACK), answer_width),
        depth=zero,
        base=zero,
        n_pieces=zero,
        n_valid=zero,
        action_ids=jnp.full((batch, max_actions_per_turn), -1, jnp.int32),
        valid_ids=jnp.full((batch, max_actions_per_turn), -1, jnp.int32),
        answers=answers,
    )


def _select(cond, a, b):
    def pick(x, y):
        extra = max(jnp.ndim(x), jnp.ndim(y)) - jnp.ndim(cond)
        if jnp.ndim(cond) and extra > 0:  # cond picks stack slots of a piece's text bytes
            return jnp.where(jnp.reshape(cond, jnp.shape(cond) + (1,) * extra), x, y)
        return jnp.where(cond, x, y)

    return jax.tree.map(pick, a, b)


def _put(piece: Piece, data, count, is_space) -> Piece:
    """Append ``data[:count]`` to the piece's text (if kept); a space does not move its end."""
    if piece.text is None:
        return piece
    t = piece.text
    slots = jnp.arange(data.shape[0])
    cols = jnp.where(slots < count, t.size + slots, t.bytes.shape[-1])  # past the width: dropped
    size = t.size + count
    return piece.replace(
        text=PieceText(t.bytes.at[cols].set(data, mode="drop"), size, jnp.where(is_space, t.end, size))
    )


def _release(piece: Piece) -> Piece:
    """A pending '|' or unfinished multi-byte space turns out to be ordinary text."""
    pipe = piece.pipe == 1
    data = jnp.where(pipe, jnp.full_like(_table("ws_bytes")[0], _BAR), _table("ws_bytes")[piece.ws])
    count = jnp.where(pipe, 1, _table("ws_length")[piece.ws])
    return _unknown_char(_put(piece, data, count, False))


def _unknown_char(piece: Piece) -> Piece:
    """A character no action name contains (a '|', a non-space non-ASCII character)."""
    return piece.replace(
        started=jnp.ones_like(piece.started), alive=jnp.zeros_like(piece.alive), match=jnp.full_like(piece.match, -1)
    )


def _extend(piece: Piece, names: ActionNames, byte, is_space) -> Piece:
    """Append one byte (lower-cased) to the piece and compare it with every action name."""
    n_names, width = names.bytes.shape
    bit = jnp.arange(n_names)
    hit = (piece.pos < names.lengths) & (names.bytes[:, jnp.minimum(piece.pos, width - 1)] == byte)
    alive = ((piece.alive >> bit) & 1).astype(bool) & hit
    pos = piece.pos + 1
    full = alive & (names.lengths == pos)
    return piece.replace(
        started=jnp.ones_like(piece.started),
        pos=pos,
        alive=jnp.sum(alive.astype(jnp.int32) << bit),
        match=jnp.where(is_space, piece.match, jnp.where(full.any(), jnp.argmax(full), -1)),
    )


def _eat(piece: Piece, names: ActionNames, c):
    """Feed one answer byte to the piece machine: (piece, split) where split ends the piece."""
    ws_next = _table("ws_next")[piece.ws, c]
    pending_ws = piece.ws != 0
    own_char = ~pending_ws | (ws_next == 0)  # c starts a character of its own
    is_bar = c == _BAR
    split = own_char & is_bar & (piece.pipe == 1)
    # a pending '|' not followed by '|', or a broken multi-byte sequence, is ordinary text
    released = (pending_ws & (ws_next == 0)) | ((piece.pipe == 1) & ~is_bar)
    zero = jnp.zeros_like(piece.pipe)
    p = _select(released, _release(piece), piece).replace(pipe=zero, ws=zero)

    lead = _table("ws_next")[0, c]  # first byte of a multi-byte space
    is_space = _table("ascii_ws")[c]
    char = _put(_extend(p, names, _table("lower")[c], is_space), jnp.reshape(c, (1,)), 1, is_space)
    as_char = _select(is_space & (p.started == 0), p, char)
    fresh = _select(is_bar, p.replace(pipe=zero + 1), _select(lead != 0, p.replace(ws=lead), as_char))
    fresh = _select(split, _empty_piece((), 0 if p.text is None else p.text.bytes.shape[-1]), fresh)
    # a completed multi-byte space: stripped at the ends, breaks any name inside
    spaced = piece.replace(ws=zero, alive=jnp.where(piece.started == 1, 0, piece.alive))
    spaced = _put(spaced, _table("ws_bytes")[ws_next], jnp.where(piece.started == 1, _table("ws_length")[ws_next], 0), True)
    ws_complete = pending_ws & _table("ws_done")[ws_next]
    out = _select(own_char, fresh, _select(ws_complete, spaced, piece.replace(ws=ws_next)))
    return out, split


def _finish(piece: Piece) -> Piece:
    """End of the answer: anything pending is ordinary text."""
    pending = (piece.pipe == 1) | (piece.ws != 0)
    return _select(pending, _release(piece), piece)


def _record(st: ParserState, ended, piece: Piece) -> ParserState:
    """Account for an ended piece (non-empty ones only; the first K are kept)."""
    k = st.action_ids.shape[-1]
    slots = jnp.arange(k)
    keep = ended & (piece.started == 1) & (st.n_pieces < k)
    valid = keep & (piece.match >= 0)
    if st.answers is not None:
        assert piece.text is not None  # both are kept exactly when answer_width > 0
        width = piece.text.bytes.shape[-1]
        length = jnp.minimum(piece.text.end, width)
        text = jnp.where(jnp.arange(width) < length, piece.text.bytes, 0)
        here = keep & (slots == st.n_pieces)
        st = st.replace(answers=AnswerText(
            jnp.where(here[:, None], text[None], st.answers.bytes), jnp.where(here, length, st.answers.lengths)
        ))
    return st.replace(
        action_ids=jnp.where(keep & (slots == st.n_pieces), piece.match, st.action_ids),
        valid_ids=jnp.where(valid & (slots == st.n_valid), piece.match, st.valid_ids),
        n_pieces=st.n_pieces + (ended & (piece.started == 1)),
        n_valid=st.n_valid + valid,
    )


def _search_step(st: ParserState, c) -> ParserState:
    nxt = _table("think_next")[st.search, c]
    mark = jnp.where(_table("think_closed")[st.search, c] == 1, st.n_tokens, st.think_mark)
    found = _table("think_accept")[nxt]
    return st.replace(
        search=nxt,
        think_mark=mark,
        phase=jnp.where(found, ANSWER, st.phase),
        think_tokens=jnp.where(found, mark, st.think_tokens),
    )


def _answer_step(st: ParserState, names: ActionNames, c) -> ParserState:
    close = _table("close_next")[st.close, c]
    slot = (st.depth - 1) % STACK
    has_top = st.depth > st.base
    node = _table("tag_next")[st.stack_node[slot], c]
    floor = st.stack_floor[slot]
    stage = _table("tag_stage")[node]
    completes = has_top & (stage > floor)
    survives = has_top & ((_table("tag_mask")[node] >> floor) != 0)
    snap = jax.tree.map(lambda a: a[slot], st.stack_snap)
    eaten, split = _eat(st.piece, names, c)
    slots = jnp.arange(STACK)

    # '<': open a candidate (the oldest open one is dropped when the stack is full)
    new = st.depth % STACK
    pushed = st.replace(
        stack_node=jnp.where(slots == new, _table("tag_next")[0, c], st.stack_node),
        stack_floor=jnp.where(slots == new, 0, st.stack_floor),
        stack_snap=_select(slots == new, st.piece, st.stack_snap),
        depth=st.depth + 1,
        base=jnp.maximum(st.base, st.depth + 1 - STACK),
        piece=eaten,
    )
    # a tag completes: undo its characters; the candidate below must now complete a later stage
    # (if it cannot, the next character it reads fails it, and every open one with it)
    below = (st.depth - 2) % STACK
    popped = st.replace(
        stack_floor=jnp.where(slots == below, jnp.maximum(st.stack_floor[below], stage), st.stack_floor),
        depth=st.depth - 1,
        piece=snap,
    )
    # an ordinary character: the top candidate goes on, or every open candidate fails
    plain = st.replace(
        stack_node=jnp.where(slots == slot, node, st.stack_node),
        base=jnp.where(survives, st.base, st.depth),
        piece=eaten,
    )
    plain = _record(plain, split, st.piece)
    # the raw </answer>: its '<' opened the top candidate, whose snapshot ends the answer
    closed = st.replace(phase=jnp.full_like(st.phase, DONE), close=close)
    closed = _record(closed, True, _finish(snap))

    out = _select(c == _LT, pushed, _select(completes, popped, plain)).replace(close=close)
    return _select(_table("close_accept")[close], closed, out)


def _byte_step(st: ParserState, names: ActionNames, c, on) -> ParserState:
    """One byte for one row (vmapped over rows)."""
    searching = on & (st.phase == SEARCH)
    answering = on & (st.phase == ANSWER)
    st = _select(searching, _search_step(st, c), st)
    return _select(answering, _answer_step(st, names, c), st)


def parser_feed_bytes(state: ParserState, names: ActionNames, data, lengths) -> ParserState:
    """Feed ``data[b, :lengths[b]]`` (int32[B, N]) to each row."""
    per_row = names.bytes.ndim == 3  # [B, A, L] names (Bandit arms) or one shared [A, L] table
    step = jax.vmap(_byte_step, in_axes=(0, 0 if per_row else None, 0, 0))

    def body(carry):
        i, st = carry
        column = jax.lax.dynamic_index_in_dim(data, i, axis=1, keepdims=False)
        return i + 1, step(st, names, column, i < lengths)

    _, state = jax.lax.while_loop(lambda carry: carry[0] < jnp.max(lengths), body, (jnp.int32(0), state))
    return state


def parser_feed_tokens(tables: ParserTables, state: ParserState, token_ids, active) -> ParserState:
    """Feed one sampled token per row (int32[B]); rows with ``active`` False are left unchanged.

    Ids past the table (a model's padded vocab) add no text, as in ``tokenizer.decode``.
    """
    active = jnp.asarray(active, bool)
    known = token_ids < tables.token_lengths.shape[0]
    lengths = jnp.where(active & known, tables.token_lengths[token_ids], 0)
    data = tables.token_bytes[token_ids].astype(jnp.int32)
    state = parser_feed_bytes(state, tables.names, data, lengths)
    return state.replace(n_tokens=state.n_tokens + active)


def parser_result(state: ParserState) -> ParseResult:
    """The parse once the turn's tokens are all fed; rows without a match get the penalty."""
    matched = state.phase == DONE
    n_kept = jnp.where(matched, jnp.minimum(state.n_pieces, state.action_ids.shape[-1]), 0)
    n_valid = jnp.where(matched, state.n_valid, 0)
    answers = None
    if state.answers is not None:
        answers = AnswerText(
            jnp.where(matched[:, None, None], state.answers.bytes, 0).astype(jnp.uint8),
            jnp.where(matched[:, None], state.answers.lengths, 0),
        )
    return ParseResult(
        action_ids=jnp.where(matched[:, None], state.action_ids, -1),
        valid_action_ids=jnp.where(matched[:, None], state.valid_ids, -1),
        n_kept=n_kept,
        n_valid=n_valid,
        matched=matched,
        format_error=~matched | (n_valid == 0) | (n_valid != n_kept),
        think_tokens=jnp.where(matched, state.think_tokens, -1),
        answers=answers,
    )


def parse_response_tokens(
    tables: ParserTables, token_ids, active, max_actions_per_turn: int, enable_think=True, answer_width: int = 0
) -> ParseResult:
    """Parse whole responses ``token_ids int32[B, T]`` (``active`` bool[B, T]) token by token;
    ``answer_width`` > 0 also keeps the answer pieces' text (``ParseResult.answers``)."""
    state = init_parser_state(token_ids.shape[0], max_actions_per_turn, enable_think, answer_width)

    def step(st, xs):
        return parser_feed_tokens(tables, st, *xs), None

    state, _ = jax.lax.scan(step, state, (token_ids.T, jnp.asarray(active, bool).T))
    return parser_result(state)
