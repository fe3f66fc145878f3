"""Advantage estimators (ragen-reference.md §3.3): GAE, GRPO outcome advantage, bi-level GAE.

Token arrays are [B, T]; `mask` marks the policy (sampled) tokens; `values[b, t]` is the critic's
value of the state in which token t was sampled. gamma / lam / high_level_gamma may be traced.

Decisions and departures (docs/design.md's quirks table):
- GAE runs over policy tokens only. Observation tokens between turns are skipped entirely (like
  veRL's current multi-turn GAE and RAGEN's bi-level token level): the recursion jumps from a
  turn's last token to the next turn's first token, and values and rewards at non-policy tokens
  are ignored, so put rewards on policy tokens (`rewards.py` does). RAGEN v1 instead ran the
  recursion over every position with V = 0 and r = 0 off the mask; with its defaults γ = λ = 1 the
  two agree (every policy token gets A_t = R − V_t, return R), with γ < 1 ours discounts per
  generated token only. Outside the mask, advantages and returns are 0.
- GRPO groups by `group_id` for real (quirk 8: veRL saw singleton groups because RAGEN gave every
  sample a fresh uid, so its "GRPO" advantage was the raw score). Pass
  `group_id = jnp.arange(B)` to replicate that exactly.
- Bi-level GAE takes turn boundaries from explicit `turn_end` indices, not from "reward ≠ 0", so
  zero-reward turns are still turns (RAGEN: invisible). Turn-level rewards are the token rewards
  at the turn ends; any other token rewards (e.g. KL-in-reward) stay in the token-level pass
  (RAGEN would have treated each of them as a turn end).
"""

import jax.numpy as jnp
from jax import lax

from starpo_jax.algo.masked import masked_whiten, same_group_stats

ESTIMATORS = ("gae", "grpo", "bilevel_gae")  # `algorithm.adv_estimator`; train.py switches on it
CRITIC_ESTIMATORS = ("gae", "bilevel_gae")  # the estimators that need a value function (a critic)


def _masked_gae(rewards, values, mask, boundary, gamma, lam):
    """Reverse GAE over masked positions; `boundary[t]` stops bootstrapping past t."""
    mask = jnp.asarray(mask).astype(bool)

    def step(carry, xs):
        next_value, next_advantage = carry
        reward, value, valid, is_boundary = xs
        next_value = jnp.where(is_boundary, 0.0, next_value)
        next_advantage = jnp.where(is_boundary, 0.0, next_advantage)
        advantage = reward + gamma * next_value - value + gamma * lam * next_advantage
        carry = (jnp.where(valid, value, next_value), jnp.where(valid, advantage, next_advantage))
        return carry, jnp.where(valid, advantage, 0.0)

    zeros = jnp.zeros(rewards.shape[0], jnp.result_type(rewards, values))
    time_major = (rewards.T, values.T, mask.T, boundary.T)
    _, advantages = lax.scan(step, (zeros, zeros), time_major, reverse=True)
    advantages = advantages.T
    return advantages, jnp.where(mask, advantages + values, 0.0)


def _whitened(advantages, mask):
    return jnp.where(jnp.asarray(mask).astype(bool), masked_whiten(advantages, mask), 0.0)


def gae(rewards, values, mask, gamma, lam, whiten=True):
    """veRL's `compute_gae_advantage_return` over policy tokens: (advantages, returns) [B, T].

    δ_t = r_t + γ·V_next − V_t, A_t = δ_t + γλ·A_next, where "next" is the next policy token
    (V = A = 0 after the last). returns = A + V (before whitening). whiten (static): whiten A over
    the mask with the Bessel-corrected variance, as veRL does.
    """
    no_boundary = jnp.zeros(rewards.shape, bool)
    advantages, returns = _masked_gae(rewards, values, mask, no_boundary, gamma, lam)
    return (_whitened(advantages, mask) if whiten else advantages), returns


def bilevel_gae(rewards, values, mask, turn_end, turn_valid, gamma, lam, high_level_gamma, whiten=True):
    """RAGEN's bi-level GAE with explicit turn boundaries: (advantages, returns) [B, T].

    turn_end[B, K] is the index of each turn's last policy token, turn_valid[B, K] which turns exist.
    1. Turn level: GAE over the turns with γ_H = high_level_gamma and λ, on r_k = rewards at the turn
       ends and V_k = values there; the reward at each turn end is replaced by A_k + V_k.
    2. Token level: GAE over policy tokens with γ, λ on those rewards, restarting at every turn end
       (no bootstrap from the next turn: V_next = A_next = 0 there).
    Returns are A + V from the token level. whiten (static) as in `gae`.
    """
    turn_valid = jnp.asarray(turn_valid).astype(bool)
    read_index = jnp.where(turn_valid, turn_end, 0)
    turn_reward = jnp.take_along_axis(rewards, read_index, axis=1)
    turn_value = jnp.take_along_axis(values, read_index, axis=1)
    _, turn_return = _masked_gae(
        turn_reward, turn_value, turn_valid, jnp.zeros(turn_end.shape, bool), high_level_gamma, lam
    )
    rows = jnp.arange(rewards.shape[0])[:, None]
    end_index = jnp.where(turn_valid, turn_end, rewards.shape[1])  # invalid turns: out of bounds, dropped
    is_turn_end = jnp.zeros(rewards.shape, bool).at[rows, end_index].set(True, mode="drop")
    turn_level_rewards = rewards.at[rows, end_index].set(turn_return, mode="drop")
    advantages, returns = _masked_gae(turn_level_rewards, values, mask, is_turn_end, gamma, lam)
    return (_whitened(advantages, mask) if whiten else advantages), returns


def grpo_outcome(score, group_id, mask, norm_by_std=True, eps=1e-6, valid=None):
    """veRL's `compute_grpo_outcome_advantage`, grouped by group_id: (advantages, returns) [B, T].

    A_b = (score_b − mean_g) / (std_g + eps) (unbiased std; `norm_by_std=False` gives Dr. GRPO's
    score_b − mean_g), broadcast over the mask. A singleton group has mean 0 and std 1, so its
    advantage is its score (veRL). score[B] is the trajectory's summed token reward (veRL: KL
    penalty included). valid[B] (optional): only these rows enter the group statistics, so padding
    rows of a compacted batch change nothing.
    """
    size, mean, std = same_group_stats(score, group_id, valid)
    singleton = size <= 1
    mean = jnp.where(singleton, 0.0, mean)
    advantage = score - mean
    if norm_by_std:
        advantage = advantage / (jnp.where(singleton, 1.0, std) + eps)
    advantages = jnp.where(jnp.asarray(mask).astype(bool), advantage[:, None], 0.0)
    return advantages, advantages
