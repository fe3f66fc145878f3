"""KV-cached generation: prefill / append a block of tokens, then a ``lax.while_loop`` decode.

Everything here jits and never syncs with the host inside the decode loop. The model enters as a
``ModelState`` (``nnx.split``: static graph + weight pytree).

Rows are ragged. A cache row has its own length; ``append`` writes each row's new tokens at that
row's offset (right padding inside the block is not written), and ``decode`` writes every emitted
token, the stop token included, so the next turn is just another ``append`` on the same cache: the
prefix is never recomputed.

Sampling follows vLLM's order: temperature, then top-k, then top-p. ``temperature`` is traced (a
scalar or one per row, 0 means greedy); ``top_k`` and ``top_p`` are static, so a disabled filter
costs nothing (top-p sorts the vocabulary every step).

Log-probs: the returned log-prob of a token is ``log_softmax(logits / temperature)[token]``, under
the temperature-scaled distribution *before* the top-k / top-p truncation. That is the quantity a
trainer recomputes from logits (RAGEN/veRL divide logits by the rollout temperature, and top-p = 1,
top-k off there anyway). Greedy rows (temperature 0) report ``log_softmax(logits)[token]``.

Randomness: step t uses ``jax.random.fold_in(key, t)`` for the whole batch, so the same key gives
the same tokens bit for bit. The Gumbel noise over the vocabulary is jax's threefry stream, drawn
with the hash unrolled (``_threefry_bits_unrolled``, the same bits): jax's CPU lowering is a rolled
loop that made the noise a fifth of a decode step's bytes. The token is ``jax.random.categorical``'s,
its argmax taken in blocks (``first_argmax``) so that XLA:CPU does not compute the noise inside a
reduction loop it cannot vectorise. On a CPU, where no top-k or top-p filter is on, the whole draw
is a kernel instead (``models.cpu_kernels``): XLA:CPU ran the noise, the argmax and the log-softmax
on one core each (docs/benchmarks.md, "The sampler as a kernel"). It draws the same bits; its logarithms agree with
XLA's to about an ulp, so a token can differ only where two candidates tie to that precision.

The decode loop reads the weights and the cache in place: ``decode`` splits the blocks' weights per
layer once per call, and the cache is one buffer per layer (``KVCache``) from its creation to the
rollout's end; each step runs the blocks unrolled (``Decoder.extend``). ``append`` runs its prompt
chunks through the same unrolled blocks. On a CPU both attend with the kernel of
``models.cpu_kernels``, which reads only each row's held slots; where it is not available, XLA's
attention takes a prompt chunk a few rows at a time (models/decoder.py says why, and what each
costs).

Cache window: XLA's attention (an accelerator's) reads every slot of the cache it is given, and a multi-turn
rollout's cache is sized for the last turn (RAGEN: 3,600 tokens) while early turns use a fraction
of it. ``decode`` and ``append`` therefore run in the smallest of a few static windows (``decode_windows``: the
whole cache, and for long caches 1/2, 1/4, 1/8 of it) that holds every live row plus its token
budget: the window's slots are copied out once per call, decoded in, and copied back, so each step
reads only the window. One ``lax.switch`` per call picks it; the results are the same as decoding
in the whole cache, since no live row can reach the window's end. (A rollout's first turn knows its
reach statically and runs in the head it can reach: ``multi_turn.LLMResponder.first_turn``.)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.extend.random
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from starpo_jax.models import cpu_kernels
from starpo_jax.models.config import ModelConfig
from starpo_jax.models.decoder import KVCache, ModelState, batch_splits
from starpo_jax.runtime import sharding

Array = jax.Array

__all__ = [
    "KVCache", "ModelState", "DecodeOutput", "DecodeState", "init_cache", "append", "decode",
    "decode_step", "initial_decode_state", "generate", "sample_logits", "sampling_policy",
]


class DecodeOutput(struct.PyTreeNode):
    tokens: Array  # [B, max_new] int32; slots at and past a row's length hold pad_id
    logprobs: Array  # [B, max_new] float32 (see the module docstring); 0 past a row's length
    lengths: Array  # [B] int32: tokens generated, the stop token included
    cache: KVCache  # with every generated token written
    # [B, V] logits after each row's last token (decode can go on from here); None from a responder
    # that runs no model (format_warmup.RandomAnswers, the tests' scripted ones)
    last_logits: Array | None


def init_cache(config: ModelConfig, batch_size: int, max_len: int) -> KVCache:
    """An empty cache with room for ``max_len`` tokens per row (prompt, generations, later turns)."""
    return KVCache.init(config, batch_size, max_len)


def even_chunks(width: int, most: int) -> tuple[int, int]:
    """(count, size): the fewest chunks of at most ``most`` tokens that hold ``width``, all of one
    size. A 275-token prompt runs as 3 × 92 positions, where chunks of 128 would compute 384."""
    count = -(-width // most)
    return count, -(-width // count)


CHUNK_SIZE = 128  # the most tokens of a prompt block ``append`` runs at once (on an accelerator)
CPU_CHUNK_POSITIONS = 1024  # rows × tokens from which XLA:CPU's weight products run at full rate
CPU_CHUNK_TOKENS = 16


def chunk_tokens(rows: int, most: int) -> int:
    """The most tokens a chunk of ``rows`` rows' prompt block holds: ``most`` on an accelerator;
    on a CPU as few as keep ``CPU_CHUNK_POSITIONS`` positions in each chunk's products (no fewer
    than ``CPU_CHUNK_TOKENS``). ``append`` stops after the last chunk that holds a real token, so
    smaller chunks compute less of the padding past the longest row's prompt (a later FrozenLake
    turn's block is 123 tokens wide, its prompts 96–99); on a CPU a chunk of 64 rows × 16 tokens
    costs no more than its share of one large chunk (docs/benchmarks.md)."""
    if jax.default_backend() != "cpu":
        return most
    return min(most, max(CPU_CHUNK_TOKENS, -(-CPU_CHUNK_POSITIONS // rows)))


def chunks_used(longest, size: int):
    """The chunks of ``size`` tokens that hold a real token of some row, the longest holding ``longest``:
    the trips of ``append``'s loop."""
    return (longest + size - 1) // size


@functools.partial(jax.jit, static_argnames=("chunk_size", "windowed"))
def append(
    model: ModelState, cache: KVCache, tokens: Array, num_new: Array, *, chunk_size: int = CHUNK_SIZE,
    windowed: bool = True,
) -> tuple[KVCache, Array]:
    """Prefill / continue: append tokens [B, T] (row b's first ``num_new[b]`` are real) to the cache.

    Returns the cache and the float32 logits [B, V] after each row's last new token. A row with
    ``num_new == 0`` is left unchanged and its logits are meaningless: mark it inactive in ``decode``.
    Long blocks go through the model in chunks of at most ``chunk_size`` tokens, so attention scores
    never exceed [B, heads, chunk_size, cache length] whatever the prompt length; on a CPU the chunks
    are smaller (``chunk_tokens``). The chunks share the block evenly (``even_chunks``), and a loop
    runs them only as far as the longest row's real tokens reach: a block's static width is a bound
    on every prompt it may hold, and the padding past the longest is never computed. Like ``decode``,
    it runs in the smallest window holding every row it writes (``windowed=False``: the whole
    cache).
    """
    decoder = model.merge()
    B, T = tokens.shape
    num_chunks, size = even_chunks(T, chunk_tokens(B, chunk_size))
    chunks = jnp.pad(tokens, ((0, 0), (0, num_chunks * size - T))).reshape(B, num_chunks, size).swapaxes(0, 1)
    used = chunks_used(jnp.max(num_new), size)

    def append_in(cache: KVCache) -> tuple[KVCache, Array]:
        weights = decoder.layers.per_layer()  # split once, read by every chunk

        def step(index, carry):
            cache, last_hidden = carry
            real = jnp.clip(num_new - index * size, 0, size)
            hidden, cache = decoder.extend(chunks[index], real, cache, weights, in_row_passes=True)
            at_last = jnp.take_along_axis(hidden, jnp.maximum(real - 1, 0)[:, None, None], axis=1)[:, 0]
            return cache, jnp.where((real > 0)[:, None], at_last, last_hidden)

        init = (cache, jnp.zeros((B, decoder.config.hidden_size), jnp.dtype(decoder.config.dtype)))
        return jax.lax.fori_loop(0, used, step, init)

    needed = jnp.max(jnp.where(num_new > 0, cache.lengths + num_new, 0))
    cache, last_hidden = in_smallest_window(append_in, cache, needed, windowed)
    return cache, decoder.logits(last_hidden)


def _top_k_filter(logits: Array, k: int) -> Array:
    kth = jax.lax.top_k(logits, k)[0][:, -1:]
    return jnp.where(logits < kth, -jnp.inf, logits)


def _top_p_filter(logits: Array, p: float) -> Array:
    """Keep the smallest set of most likely tokens whose probability mass reaches p (at least one)."""
    sorted_logits = jnp.flip(jnp.sort(logits, axis=-1), axis=-1)
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    num_kept = jnp.sum(mass_before < p, axis=-1, keepdims=True)
    threshold = jnp.take_along_axis(sorted_logits, jnp.maximum(num_kept - 1, 0), axis=-1)
    return jnp.where(logits < threshold, -jnp.inf, logits)


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # Threefry-2x32's, alternating every 4 rounds


def _threefry2x32(k1: Array, k2: Array, x1: Array, x2: Array) -> tuple[Array, Array]:
    """The Threefry-2x32 hash (20 rounds) of counters x1, x2 under key (k1, k2), unrolled as in
    jax's own lowering for accelerators."""
    ks = (k1, k2, k1 ^ k2 ^ np.uint32(0x1BD11BDA))
    x = [x1 + ks[0], x2 + ks[1]]
    for i in range(5):
        for r in _ROTATIONS[i % 2]:
            x[0] = x[0] + x[1]
            x[1] = x[0] ^ ((x[1] << np.uint32(r)) | (x[1] >> np.uint32(32 - r)))
        x[0] = x[0] + ks[(i + 1) % 3]
        x[1] = x[1] + ks[(i + 2) % 3] + np.uint32(i + 1)
    return x[0], x[1]


_THREEFRY = jax.extend.random.threefry_prng_impl


def _flat_counters(size: int) -> bool:
    """Whether jax draws ``size`` values of its threefry stream from the counters (0, i) of their flat
    indices i: the partitionable stream, below 2**32 values (the unrolled hash and the CPU kernel
    compute those counters; jax's other streams are left to jax)."""
    # jax.config's options are attributes it adds at runtime, unknown to a type checker
    return size < 2**32 and jax.config.jax_threefry_partitionable  # type: ignore[attr-defined]


def _threefry_bits_unrolled(key_data: Array, bit_width: int, shape: tuple[int, ...]) -> Array:
    """``jax.random.bits`` of a threefry key, the same bits, with the hash unrolled. jax lowers
    threefry for the CPU as a rolled loop of 5 steps that reads, writes and copies the [B, V]
    counters at each (a fifth of a decode step's bytes at Qwen2.5's vocabulary); unrolled, it is
    one fused pass. Other widths, huge shapes and the non-partitionable stream are left to jax."""
    size = math.prod(shape)
    if bit_width != 32 or not _flat_counters(size):
        return _THREEFRY.random_bits(key_data, bit_width, shape)
    # Counters 0, 1, ... (their high words are 0), flat: an iota of ``shape`` is a multiply-add of
    # two iotas, which XLA hoists out of the decode loop and then reads back at every token.
    counts = jax.lax.iota(jnp.uint32, size)
    bits1, bits2 = _threefry2x32(key_data[0], key_data[1], jnp.zeros_like(counts), counts)
    return (bits1 ^ bits2).reshape(shape)


_THREEFRY_UNROLLED = jax.extend.random.define_prng_impl(
    key_shape=(2,), seed=_THREEFRY.seed, split=_THREEFRY.split, random_bits=_threefry_bits_unrolled,
    fold_in=_THREEFRY.fold_in, name="threefry2x32_unrolled", tag="fru",
)


def _threefry_key_data(key: Array) -> Array | None:
    """A threefry key's (typed, or raw uint32[2]) data, uint32[2]; None for another generator's."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(key) if str(jax.random.key_impl(key)) == "threefry2x32" else None
    # a runtime option, unknown to a type checker
    return key if jax.config.jax_default_prng_impl == "threefry2x32" else None  # type: ignore[attr-defined]


def _unrolled(key: Array) -> Array:
    """A threefry key (typed, or raw uint32[2]) as the same key whose bits are drawn unrolled."""
    data = _threefry_key_data(key)
    return key if data is None else jax.random.wrap_key_data(data, impl=_THREEFRY_UNROLLED)


def sample_logits(
    logits: Array, key: Array, temperature: Array | float, top_k: int = 0, top_p: float = 1.0,
    rows: Array | None = None, of_rows: int = 0,
) -> tuple[Array, Array]:
    """Sample one token per row from logits [B, V]; returns (tokens [B] int32, logprobs [B] float32).

    temperature: scalar or [B]; rows with temperature <= 0 take the argmax. top_k <= 0 and
    top_p >= 1 are off. ``rows`` (int32[B]): these are rows ``rows`` of a batch of ``of_rows``,
    and each draws that row's noise, so it samples what it would in the whole batch (XLA computes
    the gathered rows' noise only). Unfiltered, on a CPU, the draw is ``models.cpu_kernels``'
    sampler (the same noise bits, the logarithms to an ulp).
    """
    logits = logits.astype(jnp.float32)
    temperature = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), logits.shape[:1])
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    B, V = logits.shape
    key_data = _threefry_key_data(key)
    if top_k <= 0 and top_p >= 1.0 and key_data is not None and _kernel_draws(max(of_rows, B) * V):
        return cpu_kernels.gumbel_sample(scaled, key_data, jnp.arange(B) if rows is None else rows, greedy)
    filtered = scaled
    if top_k > 0:
        filtered = _top_k_filter(filtered, top_k)
    if top_p < 1.0:
        filtered = _top_p_filter(filtered, top_p)
    # jax.random.categorical's Gumbel-max draw (the same noise, the same token), its argmax taken apart
    if rows is None:
        noise = jax.random.gumbel(_unrolled(key), filtered.shape, filtered.dtype)
    else:
        noise = jax.random.gumbel(_unrolled(key), (of_rows, filtered.shape[1]), filtered.dtype)[rows]
    noisy = filtered + noise
    tokens = jnp.where(greedy, first_argmax(logits), first_argmax(noisy))
    return tokens, _log_softmax_at(scaled, tokens)


def _kernel_draws(size: int) -> bool:
    """Whether the CPU kernel draws a sample of ``size`` noise values: where their counters are
    ``_flat_counters``, as the kernel computes them."""
    return _flat_counters(size) and cpu_kernels.available(cpu_kernels.SAMPLER)


#: Columns of ``first_argmax``'s blocks.
ARGMAX_BLOCK = 256


def first_argmax(x: Array) -> Array:
    """``jnp.argmax(x, axis=-1)`` of x [B, V] as int32, the first index of each row's maximum (NaN
    counted as +inf, since XLA:CPU's maxima may skip it), found in two steps: the maximum of each
    block of ``ARGMAX_BLOCK`` columns, then the first such block's first maximum. XLA fuses the
    producer of an argmax, here the sampler's noise, into the argmax's (value, index) reduction, a
    loop that XLA:CPU does not vectorise: at 64 rows × 49,152 it took ~7x as long as this, which
    computes the noise in a loop of its own and reduces with plain maxima (docs/benchmarks.md).
    With the vocabulary sharded (tensor parallel), it adds to argmax's small all-gathers one
    all-reduce of the chosen block."""
    B, V = x.shape
    no_nan = jnp.where(jnp.isnan(x), jnp.inf, x)
    padded = jnp.pad(no_nan, ((0, 0), (0, -V % ARGMAX_BLOCK)), constant_values=-jnp.inf)
    blocks = padded.reshape(B, -1, ARGMAX_BLOCK)
    block = jnp.argmax(jnp.max(blocks, axis=-1), axis=-1)
    within = jnp.argmax(jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0], axis=-1)
    return (block * ARGMAX_BLOCK + within).astype(jnp.int32)


def _log_softmax_at(x: Array, tokens: Array) -> Array:
    """``jax.nn.log_softmax(x)[b, tokens[b]]``, the same operations, without writing the [B, V]
    result (two passes over the vocabulary fewer per decode step): (x_t − max) − log Σ exp(x − max)."""
    top = jnp.max(x, axis=-1, keepdims=True)
    log_total = jnp.log(jnp.sum(jnp.exp(x - top), axis=-1))
    return (jnp.take_along_axis(x, tokens[:, None], axis=-1)[:, 0] - top[:, 0]) - log_total


def _stop_table(stop_tokens: Array | None, batch_size: int) -> Array:
    """Per-row stop ids [B, K]; -1 fills unused slots. None means no stop token."""
    if stop_tokens is None:
        return jnp.full((batch_size, 1), -1, jnp.int32)
    stop_tokens = jnp.asarray(stop_tokens, jnp.int32)
    if stop_tokens.ndim == 1:
        stop_tokens = jnp.broadcast_to(stop_tokens[None], (batch_size, stop_tokens.shape[0]))
    return stop_tokens


#: Caches shorter than this decode in full: a smaller window would save little and cost compile time.
MIN_WINDOWED_CACHE = 1024


def decode_windows(max_len: int) -> tuple[int, ...]:
    """The cache sizes a decode call may run in, ascending: ``max_len``, and for long caches
    ``max_len`` / 2, / 4, / 8 rounded down to multiples of 128."""
    if max_len < MIN_WINDOWED_CACHE:
        return (max_len,)
    return tuple(sorted({max_len} | {(max_len >> k) // 128 * 128 for k in (1, 2, 3)}))


def in_smallest_window(run, cache: KVCache, needed: Array, windowed: bool = True):
    """``run(cache) -> (cache, out)`` in the smallest of ``decode_windows`` holding ``needed`` slots
    of every row it touches: the window's slots copied out, run in, and written back (one
    ``lax.switch``). The same results as running in the whole cache, up to the order of sums over
    the masked slots: no row it writes reaches past the window, and the rows it leaves alone are
    copied back as they were."""
    windows = decode_windows(cache.max_len) if windowed else (cache.max_len,)
    if len(windows) == 1:
        return run(cache)
    branch = jnp.searchsorted(jnp.asarray(windows), jnp.minimum(needed, cache.max_len))
    return jax.lax.switch(branch, [functools.partial(in_head, run, size=size) for size in windows], cache)


def in_head(run, cache: KVCache, size: int):
    """``run(cache) -> (cache, out)`` in the first ``size`` slots of every row: they are copied
    out, run in and written back (the whole cache as it is where ``size`` covers it). The caller
    vouches that nothing ``run`` writes reaches past them."""
    if size >= cache.max_len:
        return run(cache)
    head, out = run(cache.head(size))
    return cache.with_head(head), out


class DecodeState(struct.PyTreeNode):
    """What the decode loop carries from one step to the next.

    The step samples its next token at its end, from the logits it has just computed, and carries
    that token ([B]) rather than the logits ([B, V]): a carried [B, V] buffer is read at the start
    of a step and rewritten at its end, and XLA copies it once per token to keep the two apart."""

    step: Array
    cache: KVCache
    next_token: Array  # [B] int32 sampled after each row's latest token (stale rows' are never read)
    next_logprob: Array  # [B] float32, its log-prob
    last_hidden: Array  # [B, hidden] after each row's last real token: finished rows keep theirs
    tokens: Array
    logprobs: Array
    lengths: Array
    budgets: Array  # [B] int32: the most tokens each row may generate
    done: Array


def initial_decode_state(cache: KVCache, first: tuple[Array, Array], hidden_like: Array, max_new_tokens: int,
                         active: Array | None, pad_id: int = 0, budgets: Array | None = None) -> DecodeState:
    """``first``: (tokens [B], log-probs [B]) sampled from the logits decoding starts from (step 0's
    draw); ``hidden_like``: [B, hidden] in the compute dtype (its values are not read); ``budgets``:
    [B] tokens each row may generate at most (default and cap: ``max_new_tokens``)."""
    token, logprob = first
    B = token.shape[0]
    active = jnp.ones((B,), bool) if active is None else jnp.asarray(active, bool)
    budgets = jnp.full((B,), max_new_tokens, jnp.int32) if budgets is None else jnp.minimum(budgets, max_new_tokens)
    return DecodeState(
        step=jnp.zeros((), jnp.int32),
        cache=cache,
        next_token=token.astype(jnp.int32),
        next_logprob=logprob.astype(jnp.float32),
        last_hidden=jnp.zeros_like(hidden_like),
        tokens=jnp.full((B, max_new_tokens), pad_id, jnp.int32),
        logprobs=jnp.zeros((B, max_new_tokens), jnp.float32),
        lengths=jnp.zeros((B,), jnp.int32),
        budgets=budgets.astype(jnp.int32),
        done=~active | (budgets <= 0) | (cache.lengths >= cache.max_len),
    )


def decode_step(decoder, weights, s: DecodeState, key: Array, temperature, top_k: int, top_p: float,
                stops: Array, pad_id: int, rows: Array | None = None, of_rows: int = 0) -> DecodeState:
    """One token for every live row: record the sampled ``s.next_token``, run it through the model,
    and sample the next one from the logits after it (step t draws with ``fold_in(key, t)``).
    ``weights``: the blocks' weights split per layer (``decoder.layers.per_layer()``), once per call;
    ``rows``, ``of_rows``: as ``sample_logits``'s."""
    live = ~s.done
    token = jnp.where(live, s.next_token, pad_id)
    logprob = jnp.where(live, s.next_logprob, 0.0)
    hidden, cache = decoder.extend(token[:, None], live.astype(jnp.int32), s.cache, weights)
    hidden = hidden[:, 0]
    stopped = jnp.any(token[:, None] == stops, axis=-1)
    # Every row samples, finished or not: a finished row's draw is never recorded, and ``decode``
    # recomputes its last logits from ``last_hidden``.
    next_token, next_logprob = sample_logits(
        decoder.logits(hidden), jax.random.fold_in(key, s.step + 1), temperature, top_k, top_p, rows, of_rows)
    return DecodeState(
        step=s.step + 1,
        cache=cache,
        next_token=next_token,
        next_logprob=next_logprob,
        last_hidden=jnp.where(live[:, None], hidden, s.last_hidden),
        tokens=s.tokens.at[:, s.step].set(token),
        logprobs=s.logprobs.at[:, s.step].set(logprob),
        lengths=s.lengths + live,
        budgets=s.budgets,
        done=s.done | (live & stopped) | (s.lengths + live >= s.budgets) | (cache.lengths >= cache.max_len),
    )


#: A decode moves its live rows into a quarter or a half of its batch where they fit
#: (``live_batch_sizes``) if each device keeps at least this many rows; ``multi_turn.on_live_rows``
#: does the same for a later turn. A step of fewer rows is hardly cheaper (it still reads every
#: weight, and a CPU's products slow as their rows shrink), while each size is one more copy of the
#: decode step's layers in the rollout program, whose compile and load grow faster than its size.
MIN_LIVE_ROWS = 32
#: ... and if at least this many steps of the budget remain: each move copies the live rows' cache
#: out and back, about the time of one step of the batch it leaves.
MIN_STEPS_AFTER_MOVE = 4


def live_batch_sizes(rows: int, min_rows: int) -> tuple[int, ...]:
    """The rows a batch of ``rows`` per device may shrink to, ascending: ``rows`` itself, and a
    quarter and a half of it where they divide it and hold ``min_rows`` at least."""
    return tuple(sorted({rows} | {rows // d for d in (2, 4) if rows % d == 0 and rows // d >= min_rows}))


def live_rows_of_each_shard(live: Array, shards: int, size: int) -> Array:
    """[shards, size]: each shard's first ``size`` live rows (``live`` [B], the batch in ``shards``
    equal shares), indices within the shard; ``B / shards`` past the last (no row)."""
    per = live.shape[0] // shards
    return jax.vmap(lambda a: jnp.nonzero(a, size=size, fill_value=per)[0])(live.reshape(shards, per))


def gather_local_rows(local: Array, x: Array) -> Array:
    """x [B, ...] -> [shards * n, ...]: rows ``local`` [shards, n] of each shard's ``B / shards``
    (an index past the shard's rows reads its last). A batched gather: a row-sharded batch moves no
    row between devices."""
    shards, per = local.shape[0], x.shape[0] // local.shape[0]
    pick = jax.vmap(lambda part, idx: part[jnp.minimum(idx, per - 1)])
    return pick(x.reshape(shards, per, *x.shape[1:]), local).reshape(-1, *x.shape[1:])


def scatter_local_rows(local: Array, x: Array, rows: Array) -> Array:
    """x [B, ...] with rows ``local`` [shards, n] of each shard set from ``rows`` [shards * n, ...]
    (an index past the shard's rows is dropped): the inverse of ``gather_local_rows``."""
    shards, n = local.shape
    put = jax.vmap(lambda part, idx, new: part.at[idx].set(new, mode="drop"))
    return put(x.reshape(shards, -1, *x.shape[1:]), local, rows.reshape(shards, n, *rows.shape[1:])).reshape(x.shape)


def decode_loop(step, s: DecodeState, per_row, max_new_tokens: int, sizes: tuple[int, ...], shards: int
                ) -> DecodeState:
    """``s`` decoded to its end by ``step(s, per_row) -> s``, the loop's step, moving the live rows
    into the next smaller of ``sizes`` (rows per device, descending from ``s``'s) once they fit it
    with ``MIN_STEPS_AFTER_MOVE`` steps of the budget left: rows that stopped early (a short answer,
    a spent budget) are no longer computed. ``per_row``: arrays [rows, ...] the step reads per row
    (its stop tokens, ...), gathered with the rows."""

    def going(s: DecodeState) -> Array:
        return (s.step < max_new_tokens) & ~jnp.all(s.done)

    def run(s: DecodeState, per_row, sizes: tuple[int, ...]) -> DecodeState:
        if len(sizes) == 1:
            return jax.lax.while_loop(going, lambda s: step(s, per_row), s)
        smaller = sizes[1]

        def fits(s: DecodeState) -> Array:
            most_live = jnp.max(jnp.sum((~s.done).reshape(shards, -1), axis=1))
            return (most_live <= smaller) & (s.step + MIN_STEPS_AFTER_MOVE <= max_new_tokens)

        def moved(s: DecodeState) -> DecodeState:
            local = live_rows_of_each_shard(~s.done, shards, smaller)
            take = functools.partial(gather_local_rows, local)
            inner = jax.tree.map(take, s.replace(step=None))
            inner = inner.replace(step=s.step, done=inner.done | (local >= sizes[0]).reshape(-1))
            inner = run(inner, jax.tree.map(take, per_row), sizes[1:])
            back = jax.tree.map(functools.partial(scatter_local_rows, local), s.replace(step=None),
                                inner.replace(step=None))
            return back.replace(step=inner.step)

        s = jax.lax.while_loop(lambda s: going(s) & ~fits(s), lambda s: step(s, per_row), s)
        return jax.lax.cond(going(s), moved, lambda s: s, s)

    return run(s, per_row, sizes)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "top_k", "top_p", "pad_id", "windowed", "of_rows",
                                             "min_live_rows"))
def decode(
    model: ModelState,
    cache: KVCache,
    last_logits: Array,
    key: Array,
    *,
    max_new_tokens: int,
    temperature: Array | float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Array | None = None,
    active: Array | None = None,
    budgets: Array | None = None,
    pad_id: int = 0,
    windowed: bool = True,
    rows: Array | None = None,
    of_rows: int = 0,
    min_live_rows: int = MIN_LIVE_ROWS,
) -> DecodeOutput:
    """Sample up to ``max_new_tokens`` tokens per row, starting from ``last_logits`` [B, V].

    A row stops after emitting one of its stop tokens (``stop_tokens``: [K] for all rows or [B, K],
    -1 = unused), when its budget is spent (``max_new_tokens``, or ``budgets`` [B] where smaller),
    or when its cache row is full. Rows with ``active[b] = False`` generate nothing and their cache
    row is untouched. The loop ends as soon as every row is done. Step t draws with ``fold_in(key,
    t)``: give each call (each turn) its own key. ``windowed=False`` always decodes in the whole
    cache (for comparison; see the module docstring). ``rows`` (int32[B]), ``of_rows``: these are
    rows ``rows`` of a batch of ``of_rows`` rows, and sample the tokens they would in it
    (``sample_logits``).

    Once the rows still going fit a half or a quarter of the batch (``live_batch_sizes`` with
    ``min_live_rows`` per device), the loop goes on with those rows only (``decode_loop``): a
    batch's answers end at different steps, and the loop runs until its longest ends. The moved rows
    sample what they would have in the whole batch; their products run in a smaller batch, so their
    logits agree to float32 rounding.
    """
    decoder = model.merge()
    weights = decoder.layers.per_layer()  # once per call, not per token
    B = last_logits.shape[0]
    stops = _stop_table(stop_tokens, B)
    active = jnp.ones((B,), bool) if active is None else jnp.asarray(active, bool)
    first = sample_logits(last_logits, jax.random.fold_in(key, 0), temperature, top_k, top_p, rows, of_rows)
    per_row = {"stops": stops, "temperature": jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), (B,)),
               "rows": jnp.arange(B, dtype=jnp.int32) if rows is None else rows}
    shards = batch_splits()

    def step(s: DecodeState, per_row) -> DecodeState:
        # The noise of rows ``per_row["rows"]`` of a batch of ``of_rows`` (of B: this call's whole batch).
        whole = rows is None and per_row["rows"].shape[0] == B
        return decode_step(decoder, weights, s, key, per_row["temperature"], top_k, top_p, per_row["stops"], pad_id,
                           None if whole else per_row["rows"], of_rows or B)

    def decode_in(cache: KVCache) -> tuple[KVCache, DecodeState]:
        hidden_like = jnp.zeros((B, decoder.config.hidden_size), jnp.dtype(decoder.config.dtype))
        init = initial_decode_state(cache, first, hidden_like, max_new_tokens, active, pad_id, budgets)
        sizes = live_batch_sizes(B // shards, min_live_rows)[::-1]
        s = decode_loop(step, init, per_row, max_new_tokens, sizes, shards)
        return s.cache, s.replace(cache=None)

    needed = jnp.max(jnp.where(active, cache.lengths, 0)) + max_new_tokens
    cache, s = in_smallest_window(decode_in, cache, needed, windowed)
    # A row that generated keeps the logits after its last token; one that did not, those it came with.
    last_logits = jnp.where((s.lengths > 0)[:, None], decoder.logits(s.last_hidden), last_logits.astype(jnp.float32))
    return DecodeOutput(tokens=s.tokens, logprobs=s.logprobs, lengths=s.lengths, cache=cache, last_logits=last_logits)


@functools.partial(jax.jit, static_argnames=("max_new_tokens", "cache_size", "top_k", "top_p", "pad_id", "windowed"))
def generate(
    model: ModelState,
    prompts: Array,
    prompt_lengths: Array,
    key: Array,
    *,
    max_new_tokens: int,
    cache_size: int | None = None,
    temperature: Array | float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Array | None = None,
    pad_id: int = 0,
    windowed: bool = True,
) -> DecodeOutput:
    """One program: an empty cache, prefill of right-padded prompts [B, T], then ``decode``.

    ``cache_size`` defaults to T + max_new_tokens; pass more to leave room for later turns.
    """
    B, T = prompts.shape
    config = model.merge().config
    cache = init_cache(config, B, cache_size or T + max_new_tokens)
    cache, logits = append(model, cache, prompts, prompt_lengths, windowed=windowed)
    return decode(
        model,
        cache,
        logits,
        key,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_tokens=stop_tokens,
        active=prompt_lengths > 0,
        pad_id=pad_id,
        windowed=windowed,
    )


def sampling_policy(graphdef, params) -> ModelState:
    """The policy for sampling: master weights cast once to the compute dtype (bf16 on GPU halves
    the bytes read per decode step), then gathered over the ``fsdp`` mesh axis (cast first, so the
    gather moves half the bytes): decoding reads every weight per token and wants them local."""
    dtype = jnp.dtype(nnx.merge(graphdef, params).config.dtype)
    return ModelState(graphdef, sharding.for_decoding(jax.tree.map(lambda p: p.astype(dtype), params)))
