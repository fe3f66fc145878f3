"""Trajectory scores → token-level rewards (ragen-reference.md §2.6, §3.1 step 4, §3.7).

Default path (`use_turn_scores=False`): score = Σ env rewards + format penalty, normalised within
groups (`trajectory_score`), then placed on the trajectory's last policy token
(`scores_to_token_rewards`). Turn path: each turn's env reward on that turn's last response token
(`turn_scores_to_token_rewards`). Optionally `kl_in_reward` subtracts β·KL on every policy token.

Departures from / decisions on RAGEN quirks (docs/design.md's quirks table):
- Quirk 5 (replicated): the format penalty is added *before* normalisation. In turn-score mode
  RAGEN applies neither normalisation nor the penalty; `turn_scores_to_token_rewards` replicates
  that by default, and `format_penalty_sum=` adds the trajectory's penalties on its last turn instead.
- Quirk 3 (departure): rewards sit on the last *policy* token (of the trajectory, or of each turn),
  because we train exactly the sampled tokens; RAGEN puts them on the "\\n" after `<|im_end|>`,
  which its off-by-one mask happens to train.
- Quirk 10 (fixed): KL-in-reward exists (`kl_in_reward`), so vanilla StarPO's KL coefficient can
  act; RAGEN never enables it, which makes its "No KL" ablation a no-op.
- A singleton group has std 0 (torch: NaN); both lead to the same all-zero result in RAGEN's
  `mean_std`, so behaviour matches.
"""

import jax.numpy as jnp

from starpo_jax.algo.losses import aggregate
from starpo_jax.algo.masked import same_group_stats

GROUPINGS = ("state", "batch", "inductive")
METHODS = ("identity", "mean", "mean_std", "asym_clip")
STD_FLOOR = 1e-6  # RAGEN: groups with std ≤ 1e-6 normalise to zeros; also the divisor's epsilon


def normalize_scores(x, group_id, tag_id=None, grouping="state", method="identity"):
    """Group-normalise per-trajectory scores x[B] as RAGEN's ctx_manager does.

    grouping: "state" groups by `group_id` (same seed), "inductive" by `tag_id` (env tag), "batch"
    puts everything in one group. method: identity | mean (x − mean) | mean_std ((x − mean) /
    (std + 1e-6), zeros where the unbiased std ≤ 1e-6) | asym_clip (mean_std clipped to [−1, 3]).
    Nothing happens unless some group has more than one member (RAGEN: "fewer groups than samples").
    """
    if grouping not in GROUPINGS:
        raise ValueError(f"Unknown reward grouping {grouping!r}: use one of {GROUPINGS}.")
    if method not in METHODS:
        raise ValueError(f"Unknown reward normalisation method {method!r}: use one of {METHODS}.")
    if grouping == "inductive" and tag_id is None:
        raise ValueError("Reward grouping 'inductive' groups by env tag: pass tag_id.")
    if method == "identity":
        return x
    key = {"state": group_id, "inductive": tag_id, "batch": jnp.zeros_like(group_id)}[grouping]
    size, mean, std = same_group_stats(x, key)
    normalised = x - mean
    if method in ("mean_std", "asym_clip"):
        normalised = jnp.where(std > STD_FLOOR, normalised / (std + STD_FLOOR), 0.0)
    if method == "asym_clip":
        normalised = jnp.clip(normalised, -1.0, 3.0)
    return jnp.where(jnp.any(size > 1), normalised, x)


def trajectory_score(env_reward, format_penalty_sum, group_id, tag_id=None, grouping="state", method="identity"):
    """RAGEN's `rm_scores` scalar: (Σ env rewards + the format penalties paid), then group-normalised."""
    return normalize_scores(env_reward + format_penalty_sum, group_id, tag_id, grouping, method)


def last_true_one_hot(mask):
    """One-hot [..., N] of the last set position along the last axis; all zeros if none is set."""
    mask = jnp.asarray(mask).astype(bool)
    n = mask.shape[-1]
    last = n - 1 - jnp.argmax(mask[..., ::-1], axis=-1)
    return (jnp.arange(n) == last[..., None]) & mask.any(axis=-1, keepdims=True)


def scores_to_token_rewards(score, loss_mask):
    """Token rewards [B, T]: score[b] on the last policy token of trajectory b, 0 elsewhere."""
    return jnp.where(last_true_one_hot(loss_mask), score[:, None], 0.0).astype(score.dtype)


def turn_scores_to_token_rewards(turn_reward, turn_end, turn_valid, seq_len, format_penalty_sum=None):
    """Token rewards [B, T] with turn_reward[b, k] on token turn_end[b, k] for each valid turn.

    RAGEN's `use_turn_scores`: raw env rewards, no normalisation and no format penalty. Pass
    `format_penalty_sum[B]` to add each trajectory's penalties on its last valid turn instead.
    """
    reward = turn_reward
    if format_penalty_sum is not None:
        reward = reward + jnp.where(last_true_one_hot(turn_valid), format_penalty_sum[:, None], 0.0)
    rows = jnp.arange(turn_end.shape[0])[:, None]
    end_index = jnp.where(turn_valid, turn_end, seq_len)  # invalid turns: out of bounds, dropped
    token_rewards = jnp.zeros((turn_end.shape[0], seq_len), reward.dtype)
    return token_rewards.at[rows, end_index].add(reward, mode="drop")


def kl_in_reward(token_rewards, kl, mask, beta):
    """veRL's `apply_kl_penalty`: r_t − β·kl_t on policy tokens, plus its two metrics.

    `kl` is per token (e.g. `losses.kl_penalty(old_logp, ref_logp, "kl")`); `beta` may be traced.
    """
    kl = jnp.where(jnp.asarray(mask).astype(bool), kl, 0.0)
    metrics = {
        "actor/reward_kl_penalty": aggregate(kl, mask, "seq-mean-token-mean"),
        "actor/reward_kl_penalty_coeff": jnp.asarray(beta),
    }
    return token_rewards - beta * kl, metrics
