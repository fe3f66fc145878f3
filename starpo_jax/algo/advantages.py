"""Advantage estimators (ragen-reference.md §3.3): GAE, GRPO outcome advantage, bi-level GAE, and
GiGPO (Feng et al. 2025, verl-agent's ``gigpo/core_gigpo.py``).

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
- GiGPO's episode advantage is `grpo_outcome` (one score per trajectory in its group's statistics;
  verl-agent's default weighs each trajectory by its number of turns, one row per turn). Its step
  groups are found by sorting, not with verl-agent's dicts, so they cost O(N log N) in the turns.
"""

import jax
import jax.numpy as jnp
from jax import lax

from starpo_jax.algo.masked import masked_whiten, same_group_stats

ESTIMATORS = ("gae", "grpo", "bilevel_gae", "gigpo")  # `algorithm.adv_estimator`; train.py switches on it
CRITIC_ESTIMATORS = ("gae", "bilevel_gae")  # the estimators that need a value function (a critic)
# `algorithm.gigpo_mode` (verl-agent's algorithm.gigpo.mode): subtract the group mean, or also divide by its std
GIGPO_MODES = ("mean_norm", "mean_std_norm")


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


def turn_returns(turn_reward, turn_played, gamma):
    """R[b, t] = Σ_k γ^k r[b, t + k] over the played turns from t on: [B, T] (0 for unplayed turns).

    verl-agent's ``compute_step_discounted_returns`` (the paper's Eq. 5): each turn's discounted
    return over its trajectory's remaining turns. An unplayed turn is skipped (no discount)."""
    played = jnp.asarray(turn_played).astype(bool)
    rewards = jnp.where(played, turn_reward, 0.0)

    def step(next_return, xs):
        reward, plays = xs
        ret = jnp.where(plays, reward + gamma * next_return, next_return)
        return ret, ret

    zeros = jnp.zeros(rewards.shape[0], rewards.dtype)
    _, returns = lax.scan(step, zeros, (rewards.T, played.T), reverse=True)
    return jnp.where(played, returns.T, 0.0)


def same_key_stats(x, group_id, key, live):
    """For every item of the flat arrays: size, mean and unbiased std of the live items that share
    both its ``group_id`` and its ``key`` (its own included, if live). Static shapes: the items are
    sorted by (live, group, key), runs of equal keys are segments, and the segment statistics are
    taken relative to one member (as ``masked.same_group_stats``: a segment of equal values has
    exactly that value as its mean and std 0). A dead item's statistics are those of the dead
    items with its group and key: callers ignore them."""
    n = x.shape[0]
    live = jnp.asarray(live).astype(bool)
    order = jnp.lexsort((key, group_id, ~live))  # the last key sorts first
    s_live, s_group, s_key, s_x = live[order], group_id[order], key[order], x[order]
    changes = (s_live[1:] != s_live[:-1]) | (s_group[1:] != s_group[:-1]) | (s_key[1:] != s_key[:-1])
    segment = jnp.cumsum(jnp.concatenate([jnp.zeros((1,), jnp.int32), changes.astype(jnp.int32)]))

    def per_item(total):
        return total[segment]

    def segment_sum(v):
        return jax.ops.segment_sum(v, segment, num_segments=n, indices_are_sorted=True)

    member = per_item(jax.ops.segment_max(s_x, segment, num_segments=n, indices_are_sorted=True))
    relative = s_x - member
    size = per_item(segment_sum(jnp.ones_like(s_x)))
    mean = per_item(segment_sum(relative)) / size
    var = per_item(segment_sum(jnp.square(relative - mean))) / jnp.maximum(size - 1.0, 1.0)
    inverse = jnp.zeros((n,), jnp.int32).at[order].set(jnp.arange(n, dtype=jnp.int32))
    return size[inverse], (member + mean)[inverse], jnp.sqrt(var)[inverse]


def gigpo(score, turn_reward, turn_state_key, turn_start, turn_end, turn_played, group_id, mask, gamma,
          step_weight, norm_by_std=False, eps=1e-6, valid=None):
    """GiGPO's advantage (verl-agent's ``compute_gigpo_outcome_advantage``): (advantages, returns) [B, L].

    Rows of one ``group_id`` start from the same level; turn t of row b starts from the env state
    whose key is ``turn_state_key[b, t]`` (``TextEnv.state_key``) and spans the tokens
    ``[turn_start[b, t], turn_end[b, t])``.

    - Episode advantage A^E_b: GRPO's, ``grpo_outcome(score, group_id, mask, norm_by_std, eps,
      valid)`` (score[B]: the trajectory's summed token reward).
    - Step groups: the played turns of one group whose states have equal keys (verl-agent's anchor
      states; several turns of one row may share a step group).
    - Step return R_{b,t} = Σ_k γ^k r_{b,t+k} over the row's turn rewards ``turn_reward`` from t on
      (``turn_returns``); step advantage A^S_{b,t} = R_{b,t} − mean of its step group
      (``norm_by_std``: divided by the step group's unbiased std + eps). A step group of one turn
      gets A^S = 0 (verl-agent: its own return is its mean, its std 1).
    - Every policy token (``mask``) of turn t: A = A^E_b + ``step_weight`` · A^S_{b,t}; tokens of no
      turn get A^E_b, tokens outside the mask 0. Returns = advantages (verl-agent).

    ``norm_by_std`` (static) is verl-agent's ``mode``: False for its default "mean_norm", True for
    "mean_std_norm"; it applies to both levels. ``gamma`` and ``step_weight`` (ω, verl-agent's
    ``step_advantage_w``) may be traced. valid[B] (optional): only these rows enter any group or
    step group statistic, so padding rows of a compacted batch change nothing.
    """
    B, T = turn_reward.shape
    played = jnp.asarray(turn_played).astype(bool)
    if valid is not None:
        played = played & jnp.asarray(valid).astype(bool)[:, None]
    episode, _ = grpo_outcome(score, group_id, mask, norm_by_std, eps, valid)

    returns = turn_returns(turn_reward, played, gamma)
    groups = jnp.broadcast_to(jnp.asarray(group_id)[:, None], (B, T)).reshape(-1)
    keys = jnp.asarray(turn_state_key).astype(jnp.uint32).reshape(-1)
    size, mean, std = same_key_stats(returns.reshape(-1), groups, keys, played.reshape(-1))
    step = returns.reshape(-1) - mean  # exactly 0 for a step group of one turn
    if norm_by_std:
        step = step / (jnp.where(size <= 1, 1.0, std) + eps)
    step = jnp.where(played, step.reshape(B, T), 0.0)

    position = jnp.arange(jnp.shape(mask)[1])
    in_turn = played[:, :, None] & (position >= turn_start[:, :, None]) & (position < turn_end[:, :, None])
    token_step = jnp.sum(jnp.where(in_turn, step[:, :, None], 0.0), axis=1)  # turns do not overlap
    advantages = jnp.where(jnp.asarray(mask).astype(bool), episode + step_weight * token_step, 0.0)
    return advantages, advantages
