"""Forward passes over the update batch, and which of its positions they compute.

The update reads log-probs (``token_logprobs``) and values (``token_values``) only at the policy
tokens of the kept rows. Both gather those positions' final hidden states (``hidden_predicting``)
and project only them, in chunks under ``jax.checkpoint`` (``_chunked``), so the [B, L, V] logits
never exist at once. Which positions are computed is an ``UpdateLayout``, picked on the host per
batch (``update_layout``): each row from its first prompt's end on, each distinct first prompt of a
micro-batch computed once (a group's rows start from the same level, and groups may share one).

Each takes one static ``ForwardPass`` (the model's graphdef, the layout, how many positions and
how to score them), then arrays: ``token_logprobs(ctx, params, rows)``.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from starpo_jax.algo import losses
from starpo_jax.models import lora
from starpo_jax.rollout.multi_turn import RolloutPlan, RolloutTables, Trajectories, first_rows_of_distinct_prompts
from starpo_jax.runtime import distributed
from starpo_jax.runtime.settings import TrainSettings
from starpo_jax.runtime.sharding import scatter_rows


class Critic(flax.struct.PyTreeNode):
    """The value model: a decoder (its weights, or LoRA adapters over the base) and a linear head on
    its last hidden state."""

    backbone: nnx.State | lora.Adapters  # its decoder weights, or its LoRA adapters over the base
    head_w: jax.Array  # [D]
    head_b: jax.Array  # []


class Rows(NamedTuple):
    """What a forward pass over the update batch reads of each row, and how much of it to compute."""

    tokens: jax.Array  # int32 [M, L]
    length: jax.Array  # int32 [M]
    split: jax.Array  # int32 [M]: ``first_prompt_split``
    needed: jax.Array  # bool [M, L]: the positions a loss reads (policy tokens of kept rows)


def policy_tokens_per_row(plan: RolloutPlan) -> int:
    """The most policy tokens a trajectory can hold: how many positions a loss computes."""
    return min(plan.max_len, plan.max_turn * plan.response_length)


class ForwardPass(NamedTuple):
    """What a forward pass over update rows reads besides arrays, all static (bound before ``jit``,
    or a static argument): the model's structure, which positions it computes and how it scores
    them. ``update_forward`` is the update's; the format warm-up builds its own."""

    graphdef: Any  # the decoder's nnx graphdef (the policy's, or the critic's backbone's)
    layout: UpdateLayout  # which positions of each row are computed
    max_tokens: int  # the most positions a loss reads per row (K, static): ``policy_tokens_per_row``
    chunk: int  # positions per vocabulary projection (``logprob_chunk``)
    temperature: float = 1.0  # the log-probs are of logits / temperature


def update_forward(settings: TrainSettings, graphdef, plan: RolloutPlan, layout: UpdateLayout) -> ForwardPass:
    """The forward pass of the update: the policy's sampling temperature, every policy token of a row."""
    return ForwardPass(graphdef, layout, policy_tokens_per_row(plan), settings.logprob_chunk,
                       settings.rollout_temperature)


def token_logprobs(ctx: ForwardPass, params, rows: Rows):
    """(logp, entropy) [B, L]: log p(token_t | tokens_<t) under the policy, and its entropy.

    Only positions where ``rows.needed`` (the loss mask, at most ``ctx.max_tokens`` per row) is
    set are computed: their hidden states are gathered first, so the vocabulary projection — the
    largest cost of a small model — is paid only where the loss looks. Other positions are 0."""
    model = nnx.merge(ctx.graphdef, params)
    index, real = policy_positions(rows.needed, ctx.max_tokens)
    safe = jnp.where(real, index, 0)
    h = hidden_predicting(ctx, model, rows, safe)
    t = jnp.take_along_axis(rows.tokens, safe, axis=1)
    logp, entropy = _chunked(lambda h, t: losses.token_logprobs_and_entropy(model.logits(h), t, ctx.temperature),
                             h, t, ctx.chunk)
    zeros = jnp.zeros(rows.tokens.shape, jnp.float32)
    return scatter_rows(zeros, index, logp), scatter_rows(zeros, index, entropy)


def token_values(ctx: ForwardPass, critic: Critic, rows: Rows):
    """V[B, L]: the critic's value of the state before token t (aligned like the log-probs), where
    ``rows.needed`` is set (0 elsewhere)."""
    model = nnx.merge(ctx.graphdef, critic.backbone)
    index, real = policy_positions(rows.needed, ctx.max_tokens)
    h = hidden_predicting(ctx, model, rows, jnp.where(real, index, 0))
    values = jnp.einsum("bkd,d->bk", h.astype(jnp.float32), critic.head_w) + critic.head_b
    return scatter_rows(jnp.zeros(rows.tokens.shape, jnp.float32), index, values)


def hidden_predicting(ctx: ForwardPass, model, rows: Rows, index):
    """Final hidden states [B, K, D] that predict ``rows.tokens[b, index[b, k]]`` (the state at
    position ``index - 1``; every index is past the row's split, or is padding whose result no one
    reads).

    Computes ``layout.width`` positions of each row from its split on. With ``layout.prefix``, each
    group's first prompt (the tokens before the split) is computed once, or with
    ``layout.across_groups`` each distinct one among the rows (``shared_prompts``), in the rows' own
    pass over the layers (``Decoder.hidden_states_sharing_prefix``), and the rows attend to theirs:
    exactly the same attention as over the whole rows."""
    layout, tokens, split = ctx.layout, rows.tokens, rows.split
    B, L = tokens.shape
    start = split if layout.prefix else jnp.zeros((B,), jnp.int32)
    positions = start[:, None] + jnp.arange(layout.width, dtype=jnp.int32)[None]
    row_tokens = jnp.take_along_axis(tokens, jnp.minimum(positions, L - 1), axis=1)
    if layout.prefix:
        if layout.across_groups:
            leaders, owner = shared_prompts(tokens[:, : layout.prefix], split, layout.prompts)
        else:  # one prompt per block of B / prompts consecutive rows (a group, or part of one): static
            leaders, owner = slice(None, None, B // layout.prompts), jnp.arange(B) // (B // layout.prompts)
        hidden = model.hidden_states_sharing_prefix(tokens[leaders, : layout.prefix], split[leaders], owner,
                                                    row_tokens, positions)
    else:
        hidden = model.hidden_states(row_tokens, positions, (positions < rows.length[:, None]).astype(jnp.int32))
    at = jnp.clip(index - 1 - start[:, None], 0, layout.width - 1)
    return jnp.take_along_axis(hidden, at[..., None], axis=1)


def _chunked(fn, hidden, targets, chunk: int):
    """``fn(hidden[:, c], targets[:, c])`` over chunks of positions, rematerialised in the backward
    pass, so only one chunk's [B, chunk, V] logits exist at a time."""
    B, K = targets.shape
    chunk = min(chunk, K)
    n = -(-K // chunk)
    pad = n * chunk - K
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, -1).swapaxes(0, 1)
    t = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), (h, t))
    return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(B, n * chunk)[:, :K], out)


def shared_prompts(prompts, split, count: int):
    """The distinct first prompts among rows ``prompts`` [B, P] (row b's prompt: its first
    ``split[b]`` tokens): (leaders int32 [count], the first row of each in order; owner int32 [B],
    which of them is row b's). ``count`` (static) must be at least how many there are
    (``update_layout`` counts them on the host); slots past the last are row 0's."""
    B, P = prompts.shape
    prompt = jnp.where(jnp.arange(P)[None] < split[:, None], prompts, -1)
    same = jnp.all(prompt[:, None] == prompt[None], axis=-1)  # [B, B]
    first = jnp.argmax(same, axis=1)  # the first row with row b's prompt
    leader = first == jnp.arange(B)
    leaders = jnp.nonzero(leader, size=count, fill_value=0)[0].astype(jnp.int32)
    return leaders, (jnp.cumsum(leader) - 1)[first].astype(jnp.int32)


def policy_positions(mask, max_tokens: int):
    """Indices [B, K] of each row's masked positions (K = max_tokens, static), and which are real."""
    index = jax.vmap(lambda m: jnp.nonzero(m, size=max_tokens, fill_value=m.shape[0])[0])(mask)
    return index, index < mask.shape[1]


# ---- helpers: which positions the forward passes compute -----------------------------------------


class UpdateLayout(NamedTuple):
    """Which positions of the update batch's rows the forward passes compute (static).

    Each row is computed from its ``split`` on, ``width`` positions. With ``prefix`` > 0 the tokens
    before the split, the row's first prompt, are computed once for all the rows of a micro-batch
    that share it (a group's rows start from the same level, so their first prompts are the same
    tokens; several groups may have the same one), ``prompts`` of them a micro-batch, and the rows
    continue from their keys and values. ``update_layout`` picks the smallest layout that holds a
    rollout batch; ``full_layout`` is every position of every row."""

    prefix: int  # positions of the shared first prompts (0: nothing shared, every split is 0)
    width: int  # positions per row from its split on
    prompts: int = 0  # first prompts computed per micro-batch, when ``prefix`` > 0
    # Fewer prompts than groups a micro-batch: which rows share one is found in the program
    # (``shared_prompts``); otherwise each group's (or each block of B / prompts rows') is its own.
    across_groups: bool = False


def full_layout(max_len: int) -> UpdateLayout:
    return UpdateLayout(prefix=0, width=max_len)


def most_prompts_per_micro_batch(micro_batch_size: int, group_size: int) -> int:
    """The most first prompts a micro-batch can hold by its groups: one per group it touches (the
    kept batch is whole groups in order, cut into micro-batches of consecutive rows)."""
    return micro_batch_size // math.gcd(micro_batch_size, group_size)


def first_prompt_split(traj: Trajectories):
    """int32[..., B]: where each row's computed part starts when its first prompt is shared: the
    first prompt's last token, whose hidden state predicts the first response token (0: never
    played). Leading axes (a sweep's settings) pass through."""
    return jnp.maximum(traj.turn_start[..., 0] - 1, 0).astype(jnp.int32)


FINE_WIDTH = 256  # from this width on, eight sizes per octave (``size_bucket``)


def size_bucket(n: int, limit: int | None = None) -> int:
    """The smallest of 16, 24, 32, 48, 64, 96, 128, 192, 256 (2^k and 3·2^(k-1)), then eight sizes
    per octave (288, 320, …, 512, 576, …) that holds ``n``, at most ``limit`` (the rows' own width).
    Each new size costs the run one compile of its update (seconds), padding costs every step: below
    ``FINE_WIDTH`` at most half of a width is padding, few widths a run; above, at most an eighth,
    where the padding of a long multi-turn row is worth more than a compile."""
    size = 16
    while size < n:
        if size >= FINE_WIDTH:
            size += 1 << (size.bit_length() - 4)  # an eighth of the octave it is in
        else:
            size = size * 3 // 2 if size & (size - 1) == 0 else size * 4 // 3
    return size if limit is None else min(size, limit)


def widest_layout(plan: RolloutPlan) -> UpdateLayout:
    """The most any batch of ``plan`` can need, shared first prompts: a row plays only if its first
    prompt leaves room for a full answer, so a split is at most ``max_len - response_length - 1``;
    after it, a one-turn row holds the first prompt's last token and its answer (nothing follows the
    last answer), a row of several turns up to the context's end."""
    width = 1 + plan.response_length if plan.max_turn == 1 else plan.max_len
    return UpdateLayout(prefix=plan.max_len - plan.response_length - 1, width=width)


def _holding(needed: int, max_len: int, widest: int) -> int:
    """``size_bucket(needed)``, or ``widest`` where that is smaller and still holds ``needed``."""
    size = size_bucket(needed, max_len)
    return min(size, widest) if needed <= widest else size


def first_prompt_width(split: np.ndarray, plan: RolloutPlan) -> int:
    """The static width that holds every row's first prompt (``split``: ``first_prompt_split`` on
    the host): the shared prefix of ``update_layout``, and the prompts' width wherever they are
    computed once per group (``diagnostics.template_collapse``)."""
    return _holding(int(split.max()), plan.max_len, widest_layout(plan).prefix)


def update_layout(traj: Trajectories, plan: RolloutPlan, micro_batch_size: int) -> UpdateLayout:
    """The smallest layout (sizes from ``size_bucket``) that holds every row of a rollout batch:
    picked on the host between rollout and update, so the update computes only what is there.
    With leading axes (a sweep's settings, ``[S, B]`` rows) it holds every row of every setting.

    A micro-batch's first prompts are computed once each, as many as the most it can hold: one per
    group it touches, or the distinct prompts of the whole batch where those are fewer (the Bandit's
    groups show two: its arms in either order; within one process). Where every row of a
    micro-batch may have its own, nothing is shared.

    A size is also allowed exactly at the most the plan can need (``widest_layout``): a one-turn
    batch where any answer runs to the budget (most, early in training) computes 17 positions per
    row for 16-token answers, not the next bucket's 24, and the shared part of 209-token first
    prompts is 208 positions, not the context's 225."""
    # every process picks the same layout
    length, split = map(np.asarray, distributed.to_host((traj.length, first_prompt_split(traj))))
    prompts = by_group = most_prompts_per_micro_batch(micro_batch_size, plan.group_size)
    # Searching the rows puts collectives into a row-sharded update, which XLA:CPU issued in different
    # orders on two processes (gloo aborts): across processes each group keeps its own prompt.
    if by_group > 1 and jax.process_count() == 1:  # only then can the batch's prompts be fewer
        tokens = np.asarray(distributed.to_host(traj.tokens))
        prompts = min(by_group, max(len(first_rows_of_distinct_prompts(ids, s)) for ids, s in
                                    zip(tokens.reshape(-1, *tokens.shape[-2:]), split.reshape(-1, split.shape[-1]))))
    if prompts == micro_batch_size:
        return UpdateLayout(prefix=0, width=size_bucket(int(length.max()), plan.max_len))
    return UpdateLayout(prefix=first_prompt_width(split, plan),
                        width=_holding(int((length - split).max()), plan.max_len, widest_layout(plan).width),
                        prompts=prompts, across_groups=prompts < by_group)


def largest_update_layout(plan: RolloutPlan, tables: RolloutTables, micro_batch_size: int) -> UpdateLayout:
    """The largest layout ``update_layout`` can pick for any batch of ``plan``, from the prompt
    tables' fixed widths: the one the memory planner compiles. A split is at most the widest first
    prompt's last token; after it a row holds that token, ``max_turn`` answers and the later prompts
    between them (nothing follows the last answer). Where a micro-batch's rows may each have their
    own first prompt, nothing is shared and a row is at most ``max_len`` wide (``full_layout``).

    Where prompts are shared this is less than ``full_layout`` for most configs (FrozenLake's preset:
    one 288-position prompt and 8 rows of 416 a micro-batch, against 8 rows of 640), and more where
    first prompts differ widely (a short one leaves its rows room to run long, a long one is a wide
    prefix): either way it bounds what the run computes."""
    prompts = most_prompts_per_micro_batch(micro_batch_size, plan.group_size)
    if prompts == micro_batch_size:
        return full_layout(plan.max_len)
    widest = widest_layout(plan)
    first = max(t.prompts.first_len for t in tables.tags)
    later = max(t.prompts.next_len for t in tables.tags)
    rest = 1 + plan.max_turn * plan.response_length + (plan.max_turn - 1) * later
    return UpdateLayout(prefix=_holding(min(first - 1, widest.prefix), plan.max_len, widest.prefix),
                        width=_holding(min(rest, widest.width), plan.max_len, widest.width), prompts=prompts)
