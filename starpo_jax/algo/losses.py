"""Actor and critic losses with veRL semantics (ragen-reference.md §3.4, §3.5, §3.7).

Arrays are [B, T] with a 0/1 `mask` of policy tokens; log-probs are aligned with the token they
score. Coefficients and clip ratios may be traced scalars (so `vmap` can sweep them); `agg_mode`
and `kind` are static strings. Nothing outside the mask reaches a loss or its gradient.

Decisions (docs/design.md's quirks table):
- Quirk 9: RAGEN's default "token-mean" runs on micro-batches of one sequence with 32-step gradient
  accumulation, which per mini-batch is exactly "seq-mean-token-mean". Choose that mode to match
  RAGEN's effective behaviour; "token-mean" over a whole mini-batch weights long trajectories more.
- Filtered trajectories are rows with an all-zero mask. "token-mean" ignores them, and the
  "seq-mean-*" modes average over the sequences that have at least one policy token (veRL averages
  over every row, which is the same when no row is empty), so a zeroed row behaves as a removed
  one. "seq-mean-token-sum-norm" divides the total by `horizon`: veRL divides by the padded
  batch's width, which `train.py` passes (RAGEN's: the rollout batch's longest sequence minus one).
- Quirk 7 (nothing to decide here): with one optimizer step per rollout the ratio is 1 and no clip
  acts; the clip terms matter once a rollout feeds several mini-batches.
"""

from functools import partial

import jax
import jax.numpy as jnp

from starpo_jax.algo.masked import masked_count, masked_mean, masked_sum, masked_var

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_KINDS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
LOG_RATIO_LIMIT = 20.0  # veRL clamps log π/π_old to ±20 before exp


def token_logprobs_and_entropy(logits, targets, temperature=1.0):
    """Log-prob of each target token and the entropy of each position, from full-vocab logits.

    logits [..., V] (any float dtype, finite), targets [...] int, temperature a Python float (the
    sampling temperature is static). Both outputs are float32; with z = logits / temperature,
    logp = z[target] − logsumexp(z) and entropy = logsumexp(z) − Σ softmax(z)·z.

    Memory: the vocabulary axis is only ever reduced; no [..., V] log-softmax is formed. A custom
    VJP writes the gradient (onehot − p)·ḡ_logp − p·(z − E_p[z])·ḡ_entropy straight into one array
    of the logits' dtype: on CPU this halves the backward's float32 temporaries compared with
    autodiff (2 copies of [..., V] instead of 4); the forward keeps at most one float32 copy.
    For very long sequences, call it on chunks of positions.
    """
    return _logprobs_and_entropy(logits, targets, temperature)


def _vocab_reductions(logits, temperature):
    z = logits.astype(jnp.float32) / temperature
    log_normaliser = jax.nn.logsumexp(z, axis=-1)
    expected_z = jnp.sum(jnp.exp(z - log_normaliser[..., None]) * z, axis=-1)
    return z, log_normaliser, expected_z


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _logprobs_and_entropy(logits, targets, temperature):
    return _logprobs_and_entropy_fwd(logits, targets, temperature)[0]


def _logprobs_and_entropy_fwd(logits, targets, temperature):
    z, log_normaliser, expected_z = _vocab_reductions(logits, temperature)
    target_z = jnp.take_along_axis(z, targets[..., None], axis=-1)[..., 0]
    outputs = (target_z - log_normaliser, log_normaliser - expected_z)
    return outputs, (logits, targets, log_normaliser, expected_z)


def _logprobs_and_entropy_bwd(temperature, residuals, cotangents):
    logits, targets, log_normaliser, expected_z = residuals
    logp_bar, entropy_bar = cotangents
    z = logits.astype(jnp.float32) / temperature
    probs = jnp.exp(z - log_normaliser[..., None])
    is_target = targets[..., None] == jnp.arange(logits.shape[-1])
    z_bar = logp_bar[..., None] * (is_target - probs) - entropy_bar[..., None] * probs * (z - expected_z[..., None])
    return (z_bar / temperature).astype(logits.dtype), None


_logprobs_and_entropy.defvjp(_logprobs_and_entropy_fwd, _logprobs_and_entropy_bwd)


def aggregate(x, mask, mode="token-mean", horizon=None):
    """Reduce a [B, T] loss matrix to a scalar (veRL `agg_loss`).

    token-mean: Σ x·m / Σ m. seq-mean-token-mean: mean over sequences of each one's token mean.
    seq-mean-token-sum: mean over sequences of each one's token sum. seq-mean-token-sum-norm:
    Σ x·m / horizon (may be traced; default T, the width of x). Sequence means skip rows with an
    empty mask (see module docstring).
    """
    if mode not in AGG_MODES:
        raise ValueError(f"Unknown loss aggregation mode {mode!r}: use one of {AGG_MODES}.")
    if mode == "token-mean":
        return masked_mean(x, mask)
    sequence_sum = masked_sum(x, mask, axis=-1)
    if mode == "seq-mean-token-sum-norm":
        return sequence_sum.sum() / (x.shape[-1] if horizon is None else horizon)
    tokens = masked_count(x, mask, axis=-1)
    per_sequence = sequence_sum / jnp.maximum(tokens, 1.0) if mode == "seq-mean-token-mean" else sequence_sum
    return masked_mean(per_sequence, tokens > 0)


def policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, clip_c=3.0, agg_mode="token-mean", horizon=None):
    """PPO clipped loss with decoupled clip (clip-higher) and dual-clip, exactly as veRL.

    ρ = exp(clamp(logp − old_logp, ±20)); L1 = −A·ρ; L2 = −A·clip(ρ, 1 − clip_low, 1 + clip_high);
    L = max(L1, L2), and for A < 0 additionally min(L, −A·clip_c) (dual-clip; clip_c must be > 1).
    Metrics: actor/pg_loss; actor/pg_clipfrac, the fraction of tokens with L2 > L1 (the ordinary
    clip acting, either side); actor/pg_clipfrac_lower, the fraction where the dual-clip caps a
    negative-advantage loss; actor/ppo_kl, the mean of old_logp − logp. `horizon`: see `aggregate`.

    The ±20 clamp of the log-ratio is later veRL's; RAGEN's pinned veRL has none (it would
    overflow to inf past 20, where the clamp keeps the loss finite).
    """
    log_ratio = jnp.clip(logp - old_logp, -LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clip_loss = jnp.maximum(unclipped, clipped)
    dual_clip_cap = -advantages * clip_c
    negative = advantages < 0
    losses = jnp.where(negative, jnp.minimum(clip_loss, dual_clip_cap), clip_loss)
    loss = aggregate(losses, mask, agg_mode, horizon)
    metrics = {
        "actor/pg_loss": loss,
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        "actor/pg_clipfrac_lower": masked_mean((negative & (clip_loss > dual_clip_cap)).astype(jnp.float32), mask),
        "actor/ppo_kl": masked_mean(-log_ratio, mask),
    }
    return loss, metrics


def kl_penalty(logp, ref_logp, kind="kl"):
    """Per-token KL estimate between the policy and the reference (veRL `kl_penalty`).

    kl / k1: logp − ref_logp. abs: |logp − ref_logp|. mse / k2: ½(logp − ref_logp)².
    low_var_kl / k3: e^(ref−logp) − (ref − logp) − 1 with the exponent clamped to ±20 and the
    result to ±10 (Schulman's unbiased, low-variance estimator).
    """
    if kind not in KL_KINDS:
        raise ValueError(f"Unknown KL estimator {kind!r}: use one of {KL_KINDS}.")
    difference = logp - ref_logp
    if kind in ("kl", "k1"):
        return difference
    if kind == "abs":
        return jnp.abs(difference)
    if kind in ("mse", "k2"):
        return 0.5 * jnp.square(difference)
    log_ratio = jnp.clip(-difference, -20.0, 20.0)
    return jnp.clip(jnp.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


def actor_loss(
    logp, entropy, old_logp, advantages, mask, *, clip_low, clip_high, clip_c=3.0, entropy_coeff=0.0,
    agg_mode="token-mean", ref_logp=None, kl_coef=0.0, kl_kind="kl", horizon=None,
):
    """The full actor objective: pg_loss − entropy_coeff·agg(entropy) [+ kl_coef·agg(kl)].

    The KL-loss term (veRL `use_kl_loss`) is present when `ref_logp` is given. Returns (loss,
    metrics) with actor/entropy_loss (the aggregated entropy) and, with a KL term, actor/kl_loss
    and actor/kl_coef. `horizon`: see `aggregate`.
    """
    loss, metrics = policy_loss(logp, old_logp, advantages, mask, clip_low, clip_high, clip_c, agg_mode, horizon)
    metrics["actor/entropy_loss"] = aggregate(entropy, mask, agg_mode, horizon)
    loss = loss - entropy_coeff * metrics["actor/entropy_loss"]
    if ref_logp is not None:
        metrics["actor/kl_loss"] = aggregate(kl_penalty(logp, ref_logp, kl_kind), mask, agg_mode, horizon)
        metrics["actor/kl_coef"] = jnp.asarray(kl_coef)
        loss = loss + kl_coef * metrics["actor/kl_loss"]
    return loss, metrics


def value_loss(values, old_values, returns, mask, clip, agg_mode="token-mean"):
    """Clipped value loss (veRL `compute_value_loss`): ½·agg(max((V − R)², (clip(V, V_old ± clip) − R)²)).

    Metrics: critic/vf_loss, critic/vf_clipfrac (fraction where the clipped error is larger),
    critic/vpred_mean.
    """
    clipped_values = jnp.clip(values, old_values - clip, old_values + clip)
    unclipped_error = jnp.square(values - returns)
    clipped_error = jnp.square(clipped_values - returns)
    loss = 0.5 * aggregate(jnp.maximum(unclipped_error, clipped_error), mask, agg_mode)
    metrics = {
        "critic/vf_loss": loss,
        "critic/vf_clipfrac": masked_mean((clipped_error > unclipped_error).astype(jnp.float32), mask),
        "critic/vpred_mean": masked_mean(values, mask),
    }
    return loss, metrics


def explained_variance(returns, values, mask):
    """veRL's 1 − Var(returns − values) / (Var(returns) + 1e-5), unbiased variances over the mask.

    veRL takes every non-padding token of the sequence (prompt and observations too, where RAGEN's
    values are 0); pass the policy-token mask to judge the critic where it is trained.
    """
    return 1.0 - masked_var(returns - values, mask) / (masked_var(returns, mask) + 1e-5)
