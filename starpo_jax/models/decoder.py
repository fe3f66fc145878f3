"""One decoder for Qwen2 / Qwen2.5 and Llama-family checkpoints (e.g. SmolLM2), in Flax NNX.

Block: x += o_proj(attention(rope(q), rope(k), v)) on RMSNorm(x); x += down(silu(gate(h)) * up(h)) on
RMSNorm(x). GQA, RoPE with θ from the config, q/k/v biases for Qwen2, tied or untied embeddings.

Layout choices:
- Every layer weight is stacked along a leading ``layers`` axis and the forward is one ``lax.scan``,
  so compile time does not grow with depth (decoding excepted, below).
- Weights are stored ``[in..., out...]`` (``x @ W``), heads kept as their own axis: q_proj is
  ``[embed, heads, kv]``. Logical axis names (``nnx.Param`` metadata ``out_sharding``): ``layers``,
  ``vocab``, ``embed``, ``heads`` (query heads), ``kv_heads`` (key/value heads, kept apart from
  ``heads`` because 2 kv heads rarely divide a tensor-parallel axis), ``kv`` (the per-head feature
  axis, MaxText's name), ``mlp``. Activations carry the same names through
  ``with_logical_constraint``, a no-op until a rules table is set.
- The KV cache holds one buffer per layer, each ``[batch, kv_heads, max_len, head_dim]``: each
  head's keys are contiguous, so the decode-time score and value products are plain batched matrix
  products (docs/benchmarks.md, "Decode attention on CPU", has what the ``[.., max_len, kv_heads, ..]``
  layout cost).
- Rows of a cache are ragged: each has its own length. ``extend`` writes each row's new tokens at
  that row's offset, continues its positions from there, and attends to the cached prefix
  (``slot < length``) plus the new block (causal); only the real tokens of the block are written.
  Nothing is recomputed for the prefix, which is what lets a multi-turn rollout append the next
  observation to a live cache.
- A block takes its weight products from a ``Products`` function: ``weight_products`` (XLA's), or
  for a decode step on a CPU ``kernel_products`` (``cpu_kernels.row_products``, which waits less
  on the weights' reads with a decode step's few rows).
- Every product of ``weight_products`` is ``weight_product``, whose backward computes the weight's
  gradient as x^T @ g: jax's own transpose takes g^T @ x, for which XLA:CPU first copies g into a
  transposed layout, slowly where g is the MLP's wide [rows, 1536].
- A gradient through ``hidden_states`` recomputes each block's forward in the backward pass
  (``ModelConfig.remat``, default "layer"): the scan then keeps one [rows, T, embed] input per layer
  instead of every layer's intermediates, whose float32 attention scores grow with T².
- Attention is masked dense attention with the softmax in float32. For full sequences on GPU in
  bf16/fp16 it is ``jax.nn.dot_product_attention(implementation="cudnn")`` (flash attention); the
  cached path keeps dense attention over the whole cache row (max_len slots, masked), whose cost is
  reading the cache anyway. On CPU a decode step's scores are computed keys @ queries^T, which
  XLA:CPU's matrix library runs at the speed of reading the keys, where queries @ keys^T runs
  several times slower once the keys are large (``_keys_lead_the_product``). Where the CPU kernel
  of ``cpu_kernels`` is available, it takes every block ``extend`` appends instead (a decode
  step, a prompt chunk) and reads only the held slots. Without it, a block of prompt tokens on CPU
  attends a few rows at a time once its scores outgrow glibc's mmap threshold (``rows_per_pass``):
  the matrix library's fresh buffer for them is then reused from the heap instead of mapped and
  faulted in per layer. The update and the decode step keep every row in one pass.

The decode step does not scan. The scan hands each block its weights and its slice of a stacked
cache through dynamic slices, which XLA materialises at every decoded token: a copy of every weight
and of the whole live cache per step, a large share of a decode step's bytes
(``python -m experiments.bench.step --cost-only`` counts them, docs/benchmarks.md). ``extend`` (the
decode step) instead takes the blocks' weights split once per call (``DecoderLayers.per_layer``) and
a cache that is one buffer per layer for its whole life (``KVCache``), with the blocks unrolled: each
writes its tokens' keys and values into its own buffer, then attends to that buffer, so XLA reads
and updates it in place. (A read the write does not wait for makes XLA copy the buffer first.)
Holding the cache stacked between calls and splitting it per layer around each decode call copied
the whole cache twice per turn, at a few GB/s on the CPU (docs/benchmarks.md). The price is a second
copy of the weights while a call runs, and compile time that grows with depth. A block of prompt
tokens (``sampling.append``: prefill and each turn's append) runs the same unrolled blocks: through
the layer scan its program compiled ~2x faster, but stacking the cache for the scan, slicing each
layer out and splitting it back cost more at every call than the compile once attention ran in row
passes (docs/benchmarks.md, "Attention a few rows at a time"). The training passes keep the scan.
XLA's attention reads every
slot of the cache it is given; ``sampling.decode`` and ``sampling.append`` therefore run in a window
of the cache (``KVCache.head``) just large enough for the live rows.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Literal, Mapping, NamedTuple, Sequence, cast

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx, struct
from flax.linen import with_logical_constraint
from jax.ad_checkpoint import checkpoint_name

from starpo_jax.models import cpu_kernels
from starpo_jax.models.config import ModelConfig

Array = jax.Array

# A finite "minus infinity": a fully masked row then softmaxes to a uniform row instead of NaN.
_MASKED = -1e30
_INIT_STD = 0.02  # transformers' initializer_range for both families


# ----------------------------------------------------------------------------------------------
# Weights: one table drives initialisation, sharding names and the Hugging Face mapping.
# ----------------------------------------------------------------------------------------------


class _Weight(NamedTuple):
    hf_name: str
    shape: tuple[int, ...]  # ours, without the leading layer axis
    axes: tuple[str, ...]  # logical axis names, same rank as `shape`
    hf_shape: tuple[int, ...]
    linear: bool  # a torch.nn.Linear weight: HF stores [out, in], we store [in..., out...]
    init: str  # "normal" | "ones" | "zeros"


def _top_weights(c: ModelConfig) -> dict[str, _Weight]:
    V, D = c.vocab_size, c.hidden_size
    weights = {
        "embed": _Weight("model.embed_tokens.weight", (V, D), ("vocab", "embed"), (V, D), False, "normal"),
        "final_norm": _Weight("model.norm.weight", (D,), ("embed",), (D,), False, "ones"),
    }
    if not c.tie_word_embeddings:
        weights["lm_head"] = _Weight("lm_head.weight", (D, V), ("embed", "vocab"), (V, D), True, "normal")
    return weights


def _layer_weights(c: ModelConfig) -> dict[str, _Weight]:
    D, H, K, Dh, F = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size
    weights = {
        "input_norm": _Weight("input_layernorm.weight", (D,), ("embed",), (D,), False, "ones"),
        "q_proj": _Weight("self_attn.q_proj.weight", (D, H, Dh), ("embed", "heads", "kv"), (H * Dh, D), True, "normal"),
        "k_proj": _Weight("self_attn.k_proj.weight", (D, K, Dh), ("embed", "kv_heads", "kv"), (K * Dh, D), True, "normal"),
        "v_proj": _Weight("self_attn.v_proj.weight", (D, K, Dh), ("embed", "kv_heads", "kv"), (K * Dh, D), True, "normal"),
        "o_proj": _Weight("self_attn.o_proj.weight", (H, Dh, D), ("heads", "kv", "embed"), (D, H * Dh), True, "normal"),
        "post_attn_norm": _Weight("post_attention_layernorm.weight", (D,), ("embed",), (D,), False, "ones"),
        "gate_proj": _Weight("mlp.gate_proj.weight", (D, F), ("embed", "mlp"), (F, D), True, "normal"),
        "up_proj": _Weight("mlp.up_proj.weight", (D, F), ("embed", "mlp"), (F, D), True, "normal"),
        "down_proj": _Weight("mlp.down_proj.weight", (F, D), ("mlp", "embed"), (D, F), True, "normal"),
    }
    if c.qkv_bias:
        weights["q_bias"] = _Weight("self_attn.q_proj.bias", (H, Dh), ("heads", "kv"), (H * Dh,), False, "zeros")
        weights["k_bias"] = _Weight("self_attn.k_proj.bias", (K, Dh), ("kv_heads", "kv"), (K * Dh,), False, "zeros")
        weights["v_bias"] = _Weight("self_attn.v_proj.bias", (K, Dh), ("kv_heads", "kv"), (K * Dh,), False, "zeros")
    return weights


def linear_layer_weights(c: ModelConfig) -> dict[str, tuple[int, int, str]]:
    """The blocks' linear weights (what LoRA adapts): name -> (in features, out features, HF name)."""
    return {name: (w.hf_shape[1], w.hf_shape[0], w.hf_name) for name, w in _layer_weights(c).items() if w.linear}


def _new_param(w: _Weight, key: Array, dtype, num_layers: int | None = None) -> nnx.Param:
    lead = () if num_layers is None else (num_layers,)
    shape = lead + w.shape
    if w.init == "normal":
        value = _INIT_STD * jax.random.normal(key, shape, jnp.float32)
    else:
        value = (jnp.ones if w.init == "ones" else jnp.zeros)(shape, jnp.float32)
    axes = (("layers",) if lead else ()) + w.axes
    # eager_sharding=False: the names are metadata until a mesh and a rules table shard the state.
    return nnx.Param(value.astype(dtype), out_sharding=axes, eager_sharding=False)


# ----------------------------------------------------------------------------------------------
# KV cache
# ----------------------------------------------------------------------------------------------


class KVCache(struct.PyTreeNode):
    """Keys and values of every layer for a batch of ragged rows; slot s of a row holds position s.

    One buffer per layer, not one stacked ``[layers, ...]`` array: each block reads and writes its
    own buffer in place (``Decoder.extend``). Slicing a layer out of a stacked cache made XLA copy
    that layer's whole cache at every decoded token, and converting between the two layouts around
    each call copied the whole cache twice (module docstring)."""

    k: tuple[Array, ...]  # per layer [batch, kv_heads, max_len, head_dim]
    v: tuple[Array, ...]  # per layer [batch, kv_heads, max_len, head_dim]
    lengths: Array  # [batch] int32: slots [0, length) are valid
    # Rows of one prefix group hold the same keys and values in their first min(prefix_length) slots:
    # copies of one prompt's (``copies``). The CPU kernel reads them once for the group's rows.
    prefix_group: Array  # [batch] int32
    prefix_length: Array  # [batch] int32

    @classmethod
    def init(cls, config: ModelConfig, batch_size: int, max_len: int) -> "KVCache":
        shape = (batch_size, config.num_kv_heads, max_len, config.head_dim)
        zeros = [jnp.zeros(shape, cache_dtype(config)) for _ in range(2 * config.num_layers)]
        return cls(k=tuple(zeros[0::2]), v=tuple(zeros[1::2]), lengths=jnp.zeros((batch_size,), jnp.int32),
                   prefix_group=jnp.arange(batch_size, dtype=jnp.int32),
                   prefix_length=jnp.zeros((batch_size,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.k[0].shape[2]

    def head(self, size: int) -> "KVCache":
        """The first ``size`` slots of every row, as a smaller cache (a copy)."""
        return self.replace(k=tuple(k[:, :, :size] for k in self.k), v=tuple(v[:, :, :size] for v in self.v))

    def with_head(self, head: "KVCache") -> "KVCache":
        """This cache with its first slots taken from ``head`` (the inverse of ``head``)."""
        size = head.max_len
        return head.replace(k=tuple(k.at[:, :, :size].set(h) for k, h in zip(self.k, head.k)),
                            v=tuple(v.at[:, :, :size].set(h) for v, h in zip(self.v, head.v)))

    def rows(self, index: Array) -> "KVCache":
        """The cache of rows ``index`` [N] (a gather: rows may repeat), their prefix groups kept."""
        return jax.tree.map(lambda x: x[index], self)

    def copies(self, index: Array) -> "KVCache":
        """Rows ``index`` [N] of this cache, the copies of one row a prefix group of its held slots
        (every row's first prompt prefilled once, then copied to the rows that read it)."""
        return self.rows(index).replace(prefix_group=index.astype(jnp.int32), prefix_length=self.lengths[index])


def cache_dtype(config: ModelConfig, backend: str | None = None) -> jnp.dtype:
    """The KV cache's dtype on ``backend`` (default: JAX's current one): the compute dtype, except
    float32 on CPU. XLA:CPU computes a bfloat16 scatter in float32, so each write of a decode step
    (``_write_rows``) would convert its layer's whole cache to float32 and back (docs/benchmarks.md,
    "A decode step's attention runs on one core; a bfloat16 KV cache on CPU"). The keys and values
    hold the compute dtype's values either way: the cast to float32 widens them exactly."""
    return jnp.dtype(jnp.float32 if (backend or jax.default_backend()) == "cpu" else config.dtype)


def _appended(lengths: Array, T: int, max_len: int) -> tuple[Array, Array]:
    """The positions [B, T] of T tokens appended to cache rows of ``lengths``, and which of the
    cache's ``max_len`` slots already hold a token of each row, as an attention mask [B, 1, S]."""
    positions = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
    cached = (jnp.arange(max_len) < lengths[:, None])[:, None, :]
    return positions, cached


def _write_slots(positions: Array, num_new: Array, max_len: int) -> Array:
    """Each new token's slot [batch, T]: its position if real, else ``max_len`` (out of range, dropped)."""
    real = jnp.arange(positions.shape[1])[None, :] < num_new[:, None]
    return jnp.where(real, positions, max_len)


def _write_rows(cache: Array, new: Array, slots: Array) -> Array:
    """Row b's new keys or values ([layers,] batch, T, kv_heads, head_dim) written at ``slots[b]`` of
    its row of ``cache`` ([layers,] batch, kv_heads, max_len, head_dim); out-of-range slots dropped.

    One scatter over every row, with the batch a *batching* dimension of the scatter (row b's
    update goes to row b), not a scattered index: XLA's SPMD partitioner then keeps each row's
    write on the device that holds the row. Indexing by (row, slot) pairs instead made it send
    every row's new keys and values to every device (two all-gathers per decoded token on a
    data- or fsdp-split batch; docs/scaling.md). ``jax.vmap`` over rows builds the same scatter but
    moves the batch axis first, copying the whole cache twice per step.
    """
    lead = cache.ndim - 4  # a leading layers axis, or none
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(lead)) + (lead + 2, lead + 3),  # new's layers, kv_heads, head_dim
        inserted_window_dims=(lead + 2,),  # one slot per update
        scatter_dims_to_operand_dims=(lead + 2,),
        operand_batching_dims=(lead,),
        scatter_indices_batching_dims=(0,),
    )
    return jax.lax.scatter(cache, slots[..., None], new.astype(cache.dtype), dims,
                           mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


# ----------------------------------------------------------------------------------------------
# Pure building blocks
# ----------------------------------------------------------------------------------------------


def _constrain(x: Array, axes: tuple[str | None, ...]) -> Array:
    return with_logical_constraint(x, axes)


def rms_norm(x: Array, weight: Array, eps: float) -> Array:
    """RMSNorm as in transformers: normalise in float32, cast back, then scale."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight.astype(x.dtype) * normed.astype(x.dtype)


Rotation = tuple[Array, Array]  # cos, sin [B, T, 1, d/2] (float32) of each position's angles


def rotation(positions: Array, head_dim: int, theta: float) -> Rotation:
    """The rotary angles' cos and sin at integer positions [B, T], in HF's rotate-half layout: feature
    i and i + d/2 form the pair rotated by angle position * theta^(-2i/d). Computed once per pass and
    shared by the layers (``rotation_from_table`` says why ``Decoder.extend`` reads them from a table)."""
    half = head_dim // 2
    inv_freq = 1.0 / theta ** (jnp.arange(0, 2 * half, 2, dtype=jnp.float32) / (2 * half))
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, half]
    return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def rotation_from_table(positions: Array, table_len: int, head_dim: int, theta: float) -> Rotation:
    """``rotation`` at positions [B, T] in 0 .. table_len - 1, read from the table of all of them. In
    unrolled blocks XLA fuses ``rotation``'s cos and sin into every layer's rope and recomputes them
    per element of q and k; a table it computes once per call (docs/benchmarks.md, "The rotary
    angles computed once per call")."""
    cos, sin = rotation(jnp.arange(table_len)[None], head_dim, theta)
    return cos[0][positions], sin[0][positions]


def rope(x: Array, rotated: Rotation) -> Array:
    """Rotary embedding of x [B, T, heads, d] by ``rotated``'s angles (``rotation``)."""
    cos, sin = (t.astype(x.dtype) for t in rotated)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


KeyBlock = tuple[Array, Array, Array]  # k, v [B, kv_heads, S, d] and allowed [B|1, T|1, S] (bool)


def _joint_attention(block_scores: list[Array], block_values: list[Array]) -> Array:
    """softmax(scores) @ values over the blocks' concatenation (scores [B, kv, q, S_i], values
    [B, kv, S_i, d]) without concatenating the scores or the values (a copy of the cache per layer
    of a decode step). Normalised after the products, as flash attention does: the products read the
    exponentials, and one division of the [B, kv, q, d] result replaces a pass that writes the
    probabilities (two passes over the scores fewer; other rounding than ``jax.nn.softmax``'s order)."""
    top = functools.reduce(jnp.maximum, [jnp.max(s, axis=-1, keepdims=True) for s in block_scores])
    unnormalised = [jnp.exp(s - jax.lax.stop_gradient(top)) for s in block_scores]
    total = sum(jnp.sum(u, axis=-1, keepdims=True) for u in unnormalised)
    out = sum(jnp.einsum("bkqs,bksd->bkqd", u.astype(v.dtype), v, preferred_element_type=jnp.float32)
              for u, v in zip(unnormalised, block_values))
    return cast(Array, out / total)  # sum's start 0 is int to a type checker; here the blocks are never empty


#: Up to this many queries per (row, kv head), a CPU computes the scores keys-first (below).
KEYS_LEAD_MAX_QUERIES = 48


def _keys_lead_the_product(queries: int) -> bool:
    """Whether the scores are computed as keys @ queries^T ([S, q], then transposed) rather than
    queries @ keys^T ([q, S]): the same sums, other rounding. XLA:CPU hands both to YNNPACK, whose
    product with a few rows against a long [S, d] operand runs far below the speed of reading its
    keys once a decode step's keys are large, enough to dominate a multi-turn rollout on CPU; with
    many queries (prefill, training) queries-first is the faster (docs/benchmarks.md, "Decode
    attention on CPU", has the figures). Other backends keep queries-first."""
    return jax.default_backend() == "cpu" and queries <= KEYS_LEAD_MAX_QUERIES


#: On CPU, attention whose float32 scores would take more bytes than this runs a few rows at a time.
CPU_SCORES_BYTES_PER_PASS = 16 << 20


def rows_per_pass(rows: int, kv_heads: int, queries: int, keys: int) -> int:
    """How many of ``rows`` rows one pass of ``attend`` takes: all of them, except on CPU when their
    float32 scores ([rows, kv_heads, queries, keys]) exceed ``CPU_SCORES_BYTES_PER_PASS``; then the
    most rows, a divisor of ``rows``, whose scores fit. XLA:CPU hands the softmax and its products
    to YNNPACK, which allocates the exponentials afresh per call: above glibc's 32 MiB mmap
    threshold every such buffer is mapped, faulted in page by page and unmapped again, per layer of
    every prompt append (docs/benchmarks.md, "Attention a few rows at a time"). Below it the heap
    keeps and reuses them. Other backends take every row at once."""
    if jax.default_backend() != "cpu":
        return rows
    fitting = max(1, CPU_SCORES_BYTES_PER_PASS // (kv_heads * queries * keys * 4))
    return max(r for r in range(1, min(rows, fitting) + 1) if rows % r == 0)


def attend(q: Array, blocks: Sequence[KeyBlock], in_row_passes: bool = False) -> Array:
    """Grouped-query softmax attention of q [B, T, heads, d] over key blocks, normalised jointly.

    Splitting keys into blocks lets the cached path attend to "the cache" and "the new tokens"
    without concatenating (copying) the cache. The T query steps and the heads sharing a kv head
    are folded into one axis, so each (row, kv head) is one plain matrix product with its keys.
    Scores and softmax are float32.

    ``in_row_passes``: rows are independent, so large scores may be computed a few rows per pass
    (``rows_per_pass``), in a loop over the row groups: the same sums. The rollout's prompt blocks
    take it; the update does not, whose backward through the loop costs more than it saves
    (docs/benchmarks.md, "Attention a few rows at a time").
    """
    if not in_row_passes:
        return _attend_rows(q, blocks)
    B, T, H, _ = q.shape
    kv_heads = blocks[0][0].shape[1]
    splits = batch_splits()
    splits = splits if B % splits == 0 else 1  # an uneven split is not the mesh's layout
    share = B // splits  # the rows on one device
    rows = rows_per_pass(share, kv_heads, T * H // kv_heads, sum(k.shape[2] for k, _, _ in blocks))
    if rows == share:
        return _attend_rows(q, blocks)
    passes = share // rows
    # Pass p takes rows [p·rows, (p+1)·rows) of every device's share, so a batch split over devices
    # stays split (a pass of contiguous rows would gather them onto one device).
    def in_passes(x: Array) -> Array:
        by_pass = jnp.moveaxis(x.reshape(splits, passes, rows, *x.shape[1:]), 1, 0)
        return by_pass.reshape(passes, splits * rows, *x.shape[1:])

    blocks = [(k, v, jnp.broadcast_to(allowed, (B, *allowed.shape[1:]))) for k, v, allowed in blocks]
    out = jax.lax.map(lambda args: _attend_rows(*args), (in_passes(q), jax.tree.map(in_passes, blocks)))
    return jnp.moveaxis(out.reshape(passes, splits, rows, *q.shape[1:]), 0, 1).reshape(q.shape)


def batch_splits() -> int:
    """How many ways the current mesh splits the rows of a batch (the logical axis "batch" under the
    current rules, ``sharding.RULES``): 1 without a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    axes = dict(nn.get_logical_axis_rules()).get("batch")
    if mesh.empty or axes is None:
        return 1
    return math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))


def _attend_rows(q: Array, blocks: Sequence[KeyBlock]) -> Array:
    """``attend`` of every row of q in one pass."""
    B, T, H, D = q.shape
    kv_heads = blocks[0][0].shape[1]
    G = H // kv_heads
    qg = q.reshape(B, T, kv_heads, G, D).transpose(0, 2, 1, 3, 4).reshape(B, kv_heads, T * G, D)
    keys_lead = _keys_lead_the_product(T * G)

    def scores(k: Array, allowed: Array) -> Array:
        if keys_lead:
            s = jnp.einsum("bksd,bkqd->bksq", k, qg, preferred_element_type=jnp.float32)
            # The barrier keeps XLA from folding the transpose back into the product; the transpose
            # itself fuses into the masking pass below, which reads the scores anyway.
            s = jnp.swapaxes(jax.lax.optimization_barrier(s), 2, 3) * D**-0.5
        else:
            s = jnp.einsum("bkqd,bksd->bkqs", qg, k, preferred_element_type=jnp.float32) * D**-0.5
        allowed = jnp.broadcast_to(allowed[:, :, None, :], (allowed.shape[0], T, G, allowed.shape[-1]))
        return jnp.where(allowed.reshape(allowed.shape[0], 1, T * G, -1), s, _MASKED)

    block_scores = [scores(k, allowed) for k, _, allowed in blocks]
    if len(blocks) == 1:  # one sequence (prefill, training): jax's softmax, then the product
        v = blocks[0][1]
        p = jax.nn.softmax(block_scores[0], axis=-1)
        out = jnp.einsum("bkqs,bksd->bkqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    else:  # a cache and new tokens (decode, append)
        out = _joint_attention(block_scores, [v for _, v, _ in blocks])
    return out.astype(q.dtype).reshape(B, kv_heads, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, H, D)


def _cudnn_applies(q: Array) -> bool:
    return jax.default_backend() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16) and q.shape[-1] in (64, 128)


def self_attention(q: Array, k: Array, v: Array, allowed: Array) -> Array:
    """Attention within one full sequence: q [B, T, H, d], k/v [B, T, kv_heads, d], allowed [B, T, T]."""
    if _cudnn_applies(q):
        return fused_attention(q, k, v, allowed, implementation="cudnn")
    return attend(q, [(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), allowed)])


def fused_attention(q: Array, k: Array, v: Array, allowed: Array, implementation: Literal["xla", "cudnn"]) -> Array:
    """``jax.nn.dot_product_attention`` with our mask; "cudnn" is flash attention on NVIDIA GPUs.

    cuDNN's masked backward pass takes only even lengths (jax raises "Unsupported sequence length"
    under ``jax.grad``), so an odd T gets one padding position at the end: causal masking hides it
    from every real query, it sees only itself (a finite softmax row), and its output is dropped."""
    T = q.shape[1]
    if T % 2:
        pad = lambda x: jnp.pad(x, ((0, 0), (0, 1), (0, 0), (0, 0)))  # noqa: E731
        allowed = jnp.pad(allowed, ((0, 0), (0, 1), (0, 1))).at[:, T, T].set(True)
        return fused_attention(pad(q), pad(k), pad(v), allowed, implementation)[:, :T]
    return jax.nn.dot_product_attention(q, k, v, mask=allowed[:, None], is_causal=True, implementation=implementation)


def sequence_mask(segment_ids: Array) -> Array:
    """allowed[b, t, s]: causal, same segment, not padding (segment 0). Every token also sees itself,
    so padding rows stay finite and never feed NaN into later layers."""
    T = segment_ids.shape[1]
    causal = jnp.tril(jnp.ones((T, T), bool))
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
    return (causal & same) | jnp.eye(T, dtype=bool)


#: The name ``checkpoint_name`` gives every weight product's output (what ``model.remat=dots`` keeps).
WEIGHT_PRODUCT = "weight_product"


def weight_product(x: Array, w: Array) -> Array:
    """x [B, T, in...] @ w [in..., out...] -> [B, T, out...] in x's dtype: every weight product of
    a block. Its backward (``_weight_product_bwd``) is written out so that the weight's gradient is
    x^T @ g, the activations first."""
    return checkpoint_name(_weight_product(x, w.astype(x.dtype)), WEIGHT_PRODUCT)


def _contracting(x: Array) -> tuple[int, ...]:
    return tuple(range(2, x.ndim))  # x's feature axes: all but batch and time


@jax.custom_vjp
def _weight_product(x: Array, w: Array) -> Array:
    return jax.lax.dot_general(x, w, ((_contracting(x), tuple(range(x.ndim - 2))), ((), ())))


def _weight_product_fwd(x: Array, w: Array) -> tuple[Array, tuple[Array, Array]]:
    return _weight_product(x, w), (x, w)


def _weight_product_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    """The same two products as jax's own transpose, but the weight's gradient with the activations
    as the left operand. jax computes it as g^T @ x, transposed: XLA:CPU then first copies g, the
    wider of the two in the MLP ([rows, 1536] against [rows, 576]), into [1536, rows], a strided
    pass fused with silu's derivative that ran at ~0.5 GB/s, ~12 % of the FrozenLake update's time
    (docs/benchmarks.md, "The weight gradient's orientation")."""
    x, w = residuals
    n_in = x.ndim - 2
    dx = jax.lax.dot_general(g, w, ((_contracting(g), tuple(range(n_in, w.ndim))), ((), ())))
    dw = jax.lax.dot_general(x, g, (((0, 1), (0, 1)), ((), ())))
    return dx, dw


_weight_product.defvjp(_weight_product_fwd, _weight_product_bwd)


@jax.custom_vjp
def swiglu(gate: Array, up: Array) -> Array:
    """silu(gate) * up, the MLP's activation. Its backward (``_swiglu_bwd``) keeps only gate and up
    and recomputes the sigmoid from gate: differentiated as written, a layer scan keeps three more
    [rows, T, mlp] arrays per layer (the sigmoid, its derivative and silu) until the backward pass
    reaches the layer."""
    return jax.nn.silu(gate) * up


def _swiglu_fwd(gate: Array, up: Array) -> tuple[Array, tuple[Array, Array]]:
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals: tuple[Array, Array], g: Array) -> tuple[Array, Array]:
    """jax's own derivative of silu(gate) * up, in its order: d silu = g * up, then silu's
    d gate = d silu * s + (d silu * gate) * s (1 - s)."""
    gate, up = residuals
    s = jax.nn.sigmoid(gate)
    d_silu = g * up
    return d_silu * s + (d_silu * gate) * (s * (1 - s)), g * (gate * s)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


#: (x [B, T, in...], weights (w [in..., out_i...], ...)) -> (x @ w_i, ...): a block's products of one input.
Products = Callable[[Array, Sequence[Array]], tuple[Array, ...]]


def weight_products(x: Array, weights: Sequence[Array]) -> tuple[Array, ...]:
    """``weight_product`` of x with each of ``weights``: XLA's products, differentiable."""
    return tuple(weight_product(x, w) for w in weights)


def kernel_products(x: Array, weights: Sequence[Array]) -> tuple[Array, ...]:
    """The same products by ``cpu_kernels.row_products`` in one call (float32, not differentiable):
    a decode step's few rows on a CPU, where it reads the weights from memory faster than XLA's
    matrix library (``extend`` says when)."""
    B, T, n_in = x.shape[0], x.shape[1], x.ndim - 2
    flat = [w.reshape(math.prod(w.shape[:n_in]), -1) for w in weights]
    ys = cpu_kernels.row_products(x.reshape(B * T, -1), flat)
    return tuple(y.reshape(B, T, *w.shape[n_in:]).astype(x.dtype) for y, w in zip(ys, weights))


def _biased(y: Array, bias: Array | None) -> Array:
    return y if bias is None else y + bias.astype(y.dtype)


def _rounded(x: Array) -> Array:
    """x rounded to its dtype, as a scan over the layers stores each block's output: XLA may keep
    a bfloat16 intermediate in float32 (excess precision) unless told to round it. float32 as is."""
    info = jnp.finfo(x.dtype)
    if info.bits >= 32:
        return x
    return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)


def _attend_after(q: Array, k: Array, v: Array, k_prefix: Array, v_prefix: Array, visible: Array,
                  in_row_passes: bool = False) -> Array:
    """Attention of a block of T new tokens (q [B, T, H, d], k/v [B, T, kv_heads, d]) to a prefix of
    keys/values [B, kv_heads, S, d] whose slots are ``visible`` [B, 1, S], and causally to each other
    (``attend`` says what ``in_row_passes`` does)."""
    causal = jnp.tril(jnp.ones((q.shape[1],) * 2, bool))[None]  # [1, T, T]
    new = (k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), causal)
    return attend(q, [(k_prefix, v_prefix, visible), new], in_row_passes)


Attention = Callable[[Array, Array, Array], Array]  # (q [B,T,H,d], k, v [B,T,kv_heads,d]) -> [B,T,H,d]


def decoder_block(c: ModelConfig, p: Mapping[str, Array], x: Array, rotated: Rotation, attention: Attention):
    """One pre-norm block on x [B, T, D]; returns the new x and this block's (k, v) [B, T, kv_heads, d]."""
    q, k, v = block_qkv(c, p, x, rotated)
    return block_output(c, p, x, attention(q, k, v)), (k, v)


def block_qkv(c: ModelConfig, p: Mapping[str, Array], x: Array, rotated: Rotation,
              products: Products = weight_products) -> tuple[Array, Array, Array]:
    """A block's first half: queries [B, T, heads, d] and keys, values [B, T, kv_heads, d] of x [B, T, D],
    q and k rotated by ``rotated`` (``rotation`` of x's positions)."""
    h = rms_norm(x, p["input_norm"], c.rms_norm_eps)
    q, k, v = products(h, (p["q_proj"], p["k_proj"], p["v_proj"]))
    q, k, v = _biased(q, p.get("q_bias")), _biased(k, p.get("k_bias")), _biased(v, p.get("v_bias"))
    return _constrain(rope(q, rotated), ("batch", None, "heads", "kv")), rope(k, rotated), v


def block_output(c: ModelConfig, p: Mapping[str, Array], x: Array, attended: Array,
                 products: Products = weight_products) -> Array:
    """A block's second half: x [B, T, D] plus the projected attention output [B, T, heads, d], then the MLP."""
    (out,) = products(attended, (p["o_proj"],))
    x = x + out
    h = rms_norm(x, p["post_attn_norm"], c.rms_norm_eps)
    gate, up = products(h, (p["gate_proj"], p["up_proj"]))
    mlp = _constrain(swiglu(gate, up), ("batch", None, "mlp"))
    (down,) = products(mlp, (p["down_proj"],))
    x = x + down
    return _constrain(x, ("batch", None, "embed"))


# What the backward pass of a full-sequence pass keeps of each block (``ModelConfig.remat``); the
# rest is recomputed from the block's input, which the layer scan keeps anyway. Without it, the
# scan keeps every layer's intermediates, float32 attention scores and probabilities
# [rows, heads, T, T] included, until the backward pass reaches that layer.
REMAT_POLICIES = {
    "layer": jax.checkpoint_policies.nothing_saveable,  # one block's intermediates at a time
    # The weight products' outputs too (``weight_product``): recomputes attention and elementwise
    # work only, keeps [rows, T, features] per layer.
    "dots": jax.checkpoint_policies.save_only_these_names(WEIGHT_PRODUCT),
}


# ----------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------


class DecoderLayers(nnx.Module):
    """All blocks' weights, each stacked along a leading ``layers`` axis."""

    # Set in __init__ from ``_layer_weights``; those every config has are declared here for the type
    # checker (the q/k/v biases exist only with ``qkv_bias``).
    input_norm: nnx.Param
    q_proj: nnx.Param
    k_proj: nnx.Param
    v_proj: nnx.Param
    o_proj: nnx.Param
    post_attn_norm: nnx.Param
    gate_proj: nnx.Param
    up_proj: nnx.Param
    down_proj: nnx.Param

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        dtype = jnp.dtype(config.param_dtype)
        for name, w in _layer_weights(config).items():
            setattr(self, name, _new_param(w, rngs.params(), dtype, config.num_layers))
        self.names = tuple(_layer_weights(config))

    def arrays(self) -> dict[str, Array]:
        return {name: getattr(self, name)[...] for name in self.names}

    def per_layer(self) -> tuple[dict[str, Array], ...]:
        """Each block's weights as arrays of their own (one copy of the weights): the decode loop
        takes them split once per call, where the layer scan slices (copies) them at every token."""
        stacked = self.arrays()
        num_layers = stacked["input_norm"].shape[0]
        return tuple({name: w[i] for name, w in stacked.items()} for i in range(num_layers))


class Decoder(nnx.Module):
    """Decoder-only LM. ``__call__`` / ``hidden_states`` for training; ``extend`` (prefill, appends
    and the decode step) for the KV-cached sampler."""

    # The weights outside the blocks, set in __init__ from ``_top_weights`` (lm_head only without
    # tied embeddings); declared here for the type checker.
    embed: nnx.Param
    final_norm: nnx.Param
    lm_head: nnx.Param

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        dtype = jnp.dtype(config.param_dtype)
        for name, w in _top_weights(config).items():
            setattr(self, name, _new_param(w, rngs.params(), dtype))
        self.layers = DecoderLayers(config, rngs=rngs)

    def _embed(self, tokens: Array) -> Array:
        x = jnp.take(self.embed[...], tokens, axis=0).astype(jnp.dtype(self.config.dtype))
        return _constrain(x, ("batch", None, "embed"))

    def _scan_blocks(self, x: Array, positions: Array, attention, per_layer=None,
                     remat: str = "none") -> tuple[Array, tuple[Array, Array]]:
        """All blocks in one lax.scan over the stacked weights. ``attention(q, k, v, layer_input)``
        computes a block's attention, where ``layer_input`` is this layer's slice of ``per_layer``
        (its KV cache), scanned alongside the weights. ``remat`` (``REMAT_POLICIES``) is what a
        backward pass keeps of each block. Returns final-normed x and each layer's k, v."""
        c = self.config
        rotated = rotation(positions, c.head_dim, c.rope_theta)

        def body(x, xs):
            params, layer_input = xs
            return decoder_block(c, params, x, rotated, lambda q, k, v: attention(q, k, v, layer_input))

        if remat != "none":
            # prevent_cse=False: inside a scan the recomputation cannot be merged with the forward
            # (jax.checkpoint's documentation), so the barriers that would stop it are not needed.
            body = jax.checkpoint(body, policy=REMAT_POLICIES[remat], prevent_cse=False)
        x, kv = jax.lax.scan(body, x, (self.layers.arrays(), per_layer))
        return rms_norm(x, self.final_norm[...], c.rms_norm_eps), kv

    def hidden_states(self, tokens: Array, positions: Array, segment_ids: Array | None = None) -> Array:
        """Final-normed hidden states [B, T, D] of full sequences.

        tokens, positions: [B, T] int. segment_ids: [B, T] int, 0 marks padding and tokens attend
        (causally, by index) only to earlier tokens of their own segment; a 0/1 attention mask is the
        one-segment case. None means every token is real. Under ``jax.grad`` the layers are
        rematerialised as ``config.remat`` says (``REMAT_POLICIES``); the values are the same.
        """
        if segment_ids is None:
            segment_ids = jnp.ones(tokens.shape, jnp.int32)
        allowed = sequence_mask(segment_ids.astype(jnp.int32))
        attention = lambda q, k, v, _: self_attention(q, k, v, allowed)  # noqa: E731
        x, _ = self._scan_blocks(self._embed(tokens), positions, attention, remat=self.config.remat)
        return x

    def logits(self, hidden: Array) -> Array:
        """float32 logits [..., V] of hidden states [..., D]."""
        h = hidden.astype(jnp.dtype(self.config.dtype))
        if self.config.tie_word_embeddings:
            out = jnp.einsum("...d,vd->...v", h, self.embed[...].astype(h.dtype), preferred_element_type=jnp.float32)
        else:
            out = jnp.einsum("...d,dv->...v", h, self.lm_head[...].astype(h.dtype), preferred_element_type=jnp.float32)
        return _constrain(out, ("batch",) + (None,) * (out.ndim - 2) + ("vocab",))

    def __call__(self, tokens: Array, positions: Array, segment_ids: Array | None = None) -> Array:
        """float32 logits [B, T, V] of full sequences (see ``hidden_states``)."""
        return self.logits(self.hidden_states(tokens, positions, segment_ids))

    def prefix_keys_values(self, tokens: Array, length: Array) -> tuple[Array, Array]:
        """Each layer's keys and values of full sequences tokens [B, P] whose first ``length[b]``
        tokens are real, in the cache's layout [layers, B, kv_heads, P, d]: a prefix that
        ``hidden_states_after`` continues (rematerialised under ``jax.grad`` as ``hidden_states``)."""
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        segments = (positions < length[:, None]).astype(jnp.int32)
        allowed = sequence_mask(segments)
        attention = lambda q, k, v, _: self_attention(q, k, v, allowed)  # noqa: E731
        _, (k, v) = self._scan_blocks(self._embed(tokens), positions, attention, remat=self.config.remat)
        return k.transpose(0, 1, 3, 2, 4), v.transpose(0, 1, 3, 2, 4)

    def hidden_states_after(self, tokens: Array, positions: Array, prefix_k: Array, prefix_v: Array,
                            prefix_length: Array) -> Array:
        """Final-normed hidden states [B, T, D] of tokens [B, T] at ``positions`` that follow each
        row's prefix (``prefix_keys_values``; its first ``prefix_length[b]`` slots are real): the
        same values as ``hidden_states`` of the whole sequences at those positions, without
        recomputing the prefix. Rematerialised under ``jax.grad`` as ``hidden_states``."""
        visible = (jnp.arange(prefix_k.shape[3]) < prefix_length[:, None])[:, None, :]  # [B, 1, S]

        def attention(q, k, v, layer_prefix: tuple[Array, Array]):
            return _attend_after(q, k, v, *layer_prefix, visible)

        x, _ = self._scan_blocks(self._embed(tokens), positions, attention, (prefix_k, prefix_v),
                                 remat=self.config.remat)
        return x

    def hidden_states_sharing_prefix(self, prefix: Array, prefix_length: Array, owner: Array, tokens: Array,
                                     positions: Array) -> Array:
        """Final-normed hidden states [B, T, D] of tokens [B, T] at ``positions`` that follow a shared
        prefix: ``prefix`` [G, P] (its first ``prefix_length[g]`` tokens real) is row b's prefix for
        ``owner[b]`` = g (a constant where the caller knows it: then nothing in the program depends on
        which rows share a prefix, so a row-sharded batch needs no collective to find out). Row b
        reads its prefix's keys and values as a product with its one-hot row of ``owner``, whose
        backward sums a prefix's gradients over its rows in one product too (as fast on a CPU as
        repeating a prefix to its rows and reducing their gradients, or faster: docs/benchmarks.md,
        "A static owner's one-hot product").

        The same values as ``hidden_states`` of the whole rows, with each prefix computed once, in
        the same pass over the layers as the rows: the G prefixes' positions are spread over the B
        rows alongside their own, so a layer's weight products run once on all of them (not once
        for the prefixes and again for the rows: half the per-layer passes, products of more rows),
        and the batch axis stays the rows' (a mesh splits it as it splits the rows).
        Rematerialised under ``jax.grad`` as ``hidden_states``."""
        (G, P), B = prefix.shape, tokens.shape[0]
        S = -(-G * P // B)  # prefix positions carried per row; the last row's tail is padding

        def in_rows(x):  # [G, P, ...] -> [B, S, ...]
            flat = x.reshape(G * P, *x.shape[2:])
            return jnp.pad(flat, [(0, B * S - G * P)] + [(0, 0)] * (x.ndim - 2)).reshape(B, S, *x.shape[2:])

        def in_prefixes(x):  # and back
            return x.reshape(B * S, *x.shape[2:])[: G * P].reshape(G, P, *x.shape[2:])

        prefix_positions = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), prefix.shape)
        allowed = sequence_mask((prefix_positions < prefix_length[:, None]).astype(jnp.int32))
        visible = (jnp.arange(P) < prefix_length[owner][:, None])[:, None, :]  # [B, 1, P]
        choose = jax.nn.one_hot(owner, G)  # [B, G]

        def attention(q, k, v, _):
            qp, kp, vp = (in_prefixes(a[:, :S]) for a in (q, k, v))
            prefix_out = self_attention(qp, kp, vp, allowed)
            kp, vp = (jnp.einsum("bg,gskd->bksd", choose.astype(a.dtype), a) for a in (kp, vp))  # [B, kv_heads, P, d]
            rows_out = _attend_after(q[:, S:], k[:, S:], v[:, S:], kp, vp, visible)
            return jnp.concatenate([in_rows(prefix_out), rows_out], axis=1)

        x = self._embed(jnp.concatenate([in_rows(prefix), tokens], axis=1))
        x, _ = self._scan_blocks(x, jnp.concatenate([in_rows(prefix_positions), positions], axis=1), attention,
                                 remat=self.config.remat)
        return x[:, S:]

    def extend(self, tokens: Array, num_new: Array, cache: KVCache,
               weights: Sequence[Mapping[str, Array]] | None = None,
               in_row_passes: bool = False) -> tuple[Array, KVCache]:
        """Append a block of tokens [B, T] (the decode step: T = 1) to each row of the cache, the blocks
        unrolled; row b's real tokens are the first ``num_new[b]`` (right padding). Returns the block's
        final-normed hidden states [B, T, D] and the cache with the block written at each row's offset
        and lengths advanced by ``num_new``. Padding, and anything past ``max_len``, is dropped, so a row
        with nothing new is left exactly as it was (writing past ``max_len`` cannot raise inside jit:
        ``decode`` stops a row whose cache is full).

        ``weights``: the blocks' weights split per layer (``DecoderLayers.per_layer``, a copy of the
        weights): a caller that extends in a loop (the decode loop) splits them once outside it; None
        splits them here. The blocks are unrolled, so each reads its own weights and cache buffer in
        place. Each writes its new keys and values into its buffer first and then attends to the
        written buffer (the new slots stay masked: the new block is attended to apart). Reading after
        the write orders the two, so XLA updates the buffer in place; a read that the write does not
        wait for makes it copy the buffer first. On a CPU the block attends with the kernel of
        ``cpu_kernels`` where it is available (XLA:CPU runs a decode step's attention on one core,
        and both read every slot), which reads only each row's held slots and skips padding tokens,
        and a block of 16 to 256 rows in float32 (a decode step) takes its weight products from the
        kernel too (``block_products``). ``in_row_passes``: as ``attend`` says, for XLA's attention
        (a block of prompt tokens takes it, ``sampling.append``; the decode step's scores are small)."""
        c = self.config
        weights = self.layers.per_layer() if weights is None else weights
        num_new = num_new.astype(jnp.int32)
        positions, cached = _appended(cache.lengths, tokens.shape[1], cache.max_len)
        slots = _write_slots(positions, num_new, cache.max_len)
        x, ks, vs = self._embed(tokens), [], []
        # A position is a held slot plus an index into the block: below max_len + T.
        rotated = rotation_from_table(positions, cache.max_len + tokens.shape[1], c.head_dim, c.rope_theta)
        on_cpu_kernel = cpu_kernels.available()
        products = block_products(x, weights)
        for p, k_cache, v_cache in zip(weights, cache.k, cache.v):
            q, k, v = block_qkv(c, p, x, rotated, products)
            ks.append(_write_rows(k_cache, k, slots))
            vs.append(_write_rows(v_cache, v, slots))
            if on_cpu_kernel:
                attended = cpu_kernels.cached_attention(q, k, v, ks[-1], vs[-1], cache.lengths, num_new,
                                                          cache.prefix_group, cache.prefix_length)
            else:
                attended = _attend_after(q, k, v, ks[-1], vs[-1], cached, in_row_passes)
            x = _rounded(block_output(c, p, x, attended, products))
        x = rms_norm(x, self.final_norm[...], c.rms_norm_eps)
        return x, cache.replace(k=tuple(ks), v=tuple(vs), lengths=cache.lengths + num_new)


#: The rows (a block's tokens of every row) whose weight products ``extend`` hands to
#: ``cpu_kernels.row_products``, fewest and most: a decode step's. A prompt's block has its hundreds
#: of rows or more, where XLA's matrix library reads each weight once for many rows and runs near the
#: CPU's peak; below 16 rows reading the weights is all the time, which XLA streams as fast.
KERNEL_PRODUCT_ROWS = (16, 256)


def block_products(x: Array, weights: Sequence[Mapping[str, Array]]) -> Products:
    """The products ``extend`` computes a block of x [B, T, D] with: the kernel's for few rows,
    float32 throughout, on a CPU where the kernel is available (a decode step); else XLA's."""
    linear = [w for w in weights[0].values() if w.ndim > 1] if weights else []
    fewest, most = KERNEL_PRODUCT_ROWS
    takes_kernel = (fewest <= x.shape[0] * x.shape[1] <= most and x.dtype == jnp.float32
                    and all(w.dtype == jnp.float32 for w in linear) and cpu_kernels.available(cpu_kernels.PRODUCT))
    return kernel_products if takes_kernel else weight_products


class ModelState(struct.PyTreeNode):
    """A Decoder split by ``nnx.split`` into its static graph and its weights.

    Jitted functions take this pytree: the weights are traced leaves and the graph is static
    structure, which keeps the HLO small and avoids retracing the module.
    """

    graphdef: nnx.GraphDef = struct.field(pytree_node=False)
    params: nnx.State

    @classmethod
    def split(cls, model: Decoder) -> "ModelState":
        graphdef, params = nnx.split(model)
        return cls(graphdef=graphdef, params=params)

    def merge(self) -> Decoder:
        return nnx.merge(self.graphdef, self.params)
