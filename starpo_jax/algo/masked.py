"""Masked statistics shared by rewards, filtering, advantages and losses.

A mask is 0/1 (bool or numeric) and broadcasts against the values. Positions outside the mask are
selected away with `jnp.where`, not multiplied by zero, so a NaN or inf there cannot leak in.
Empty masks give 0, never NaN: a group or batch with nothing in it contributes nothing.
"""

import jax.numpy as jnp
from jax import lax


def masked_sum(x, mask, axis=None, keepdims=False):
    """Sum of `x` over the positions where `mask` is set."""
    return jnp.sum(jnp.where(jnp.asarray(mask).astype(bool), x, 0), axis=axis, keepdims=keepdims)


def masked_count(x, mask, axis=None, keepdims=False):
    """How many positions `mask` selects, as a float of `x`'s dtype (after broadcasting)."""
    selected = jnp.broadcast_to(jnp.asarray(mask).astype(bool), jnp.broadcast_shapes(jnp.shape(x), jnp.shape(mask)))
    return jnp.sum(selected, axis=axis, keepdims=keepdims).astype(jnp.result_type(x, jnp.float32))


def masked_mean(x, mask, axis=None, keepdims=False):
    """Mean of `x` over the masked positions; 0 where the mask is empty."""
    count = masked_count(x, mask, axis, keepdims)
    return masked_sum(x, mask, axis, keepdims) / jnp.maximum(count, 1.0)


def a_member(x, mask, axis=None, keepdims=False):
    """One selected value of `x` (the largest), 0 where nothing is selected. Sums taken relative to
    it are exact for equal values: a float32 sum of eight −0.3s is not eight times −0.3, so a group
    whose members all scored the same had a mean one rounding away from their score, a std ~1e-8,
    and GRPO advantages of ±0.03 (that rounding over the 1e-6 of its denominator) instead of 0."""
    selected = jnp.where(jnp.asarray(mask).astype(bool), x, -jnp.inf)
    top = jnp.max(selected, axis=axis, keepdims=keepdims)
    return jnp.where(jnp.isfinite(top), top, 0)


def masked_var(x, mask, axis=None, keepdims=False, unbiased=True):
    """Variance over the masked positions, Bessel-corrected (n − 1) by default like torch and veRL.

    Fewer than two selected positions give 0 (torch would give NaN). Equal values give exactly 0
    (the sums are taken relative to one of them, `a_member`).
    """
    x = x - a_member(x, mask, axis, keepdims=True)
    mean = masked_mean(x, mask, axis, keepdims=True)
    squared_deviation = masked_sum(jnp.square(x - mean), mask, axis, keepdims)
    count = masked_count(x, mask, axis, keepdims)
    denominator = count - 1.0 if unbiased else count
    return squared_deviation / jnp.maximum(denominator, 1.0)


def masked_std(x, mask, axis=None, keepdims=False, unbiased=True):
    """Square root of `masked_var`."""
    return jnp.sqrt(masked_var(x, mask, axis, keepdims, unbiased))


def masked_whiten(x, mask, eps=1e-8):
    """veRL's `masked_whiten`: (x − mean) / sqrt(var + eps) with the masked, unbiased variance."""
    mean = masked_mean(x, mask)
    return (x - mean) * lax.rsqrt(masked_var(x, mask) + eps)


def same_group_stats(x, group_id, valid=None):
    """For every sample b: size, mean and unbiased std of the group that b belongs to.

    Groups are samples with equal `group_id` (any integers; no range needed). `valid` [B] (bool,
    optional) leaves samples out of every group's statistics (padding rows); their own outputs
    are those of the valid members of their group. Uses a [B, B] same-group matrix, which is tiny
    for rollout batches (B ≤ a few thousand) and keeps everything static-shaped. A singleton group
    has std 0, and a group of equal values has exactly its value as mean and std 0.
    """
    same = group_id[:, None] == group_id[None, :]
    if valid is not None:
        same = same & jnp.asarray(valid).astype(bool)[None, :]
    values = jnp.broadcast_to(x[None, :], same.shape)
    size = masked_count(values, same, axis=1)
    member = a_member(values, same, axis=1, keepdims=True)
    relative = values - member  # all zeros for a group that agrees: mean exactly its value, std 0
    return size, member[:, 0] + masked_mean(relative, same, axis=1), masked_std(relative, same, axis=1)
