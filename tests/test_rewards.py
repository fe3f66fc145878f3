import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo_jax.algo import rewards


def ragen_normalize(x, group_keys, method):
    """Plain port of RAGEN's `_normalize_score_tensor` (torch semantics, unbiased std)."""
    x = np.asarray(x, np.float64)
    groups: dict[object, list[int]] = {}
    for i, key in enumerate(group_keys):
        groups.setdefault(key, []).append(i)
    if len(groups) == len(x):
        return x
    out = x.copy()
    for index in groups.values():
        values = x[index]
        std = values.std(ddof=1) if len(values) > 1 else np.nan  # torch: NaN for one sample
        if method == "identity":
            out[index] = values
        elif method == "mean":
            out[index] = values - values.mean()
        else:
            normalised = (values - values.mean()) / (std + 1e-6) if std > 1e-6 else np.zeros_like(values)
            out[index] = np.clip(normalised, -1, 3) if method == "asym_clip" else normalised
    return out


# groups: {1, 3, 0}, {0, 0, 0} (std 0), {2, 6, 0}, {0, 0, 9} and the singleton {4}; two env tags
X = np.array([1, 3, 0, 0, 2, 6, 0, 0, 0, 0, 0, 9, 4], np.float32)
GROUP_ID = np.array([0, 0, 1, 1, 2, 2, 3, 3, 0, 1, 2, 3, 4])
TAG_ID = np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1])


@pytest.mark.parametrize("grouping,method", itertools.product(rewards.GROUPINGS, rewards.METHODS))
def test_normalize_scores_matches_ragen_for_every_grouping_and_method(grouping, method):
    keys = {"state": GROUP_ID, "inductive": TAG_ID, "batch": np.zeros_like(GROUP_ID)}[grouping]
    got = rewards.normalize_scores(jnp.asarray(X), jnp.asarray(GROUP_ID), jnp.asarray(TAG_ID), grouping, method)
    np.testing.assert_allclose(got, ragen_normalize(X, keys, method), rtol=1e-5, atol=1e-6)


def test_mean_std_uses_the_unbiased_std_and_zeroes_constant_groups():
    x = jnp.array([1.0, 3.0, 5.0, 5.0])
    got = rewards.normalize_scores(x, jnp.array([0, 0, 1, 1]), method="mean_std")
    # group {1, 3}: mean 2, unbiased std √2 (the biased std 1 would give ±1)
    np.testing.assert_allclose(got, [-1 / np.sqrt(2), 1 / np.sqrt(2), 0.0, 0.0], rtol=1e-5)


def test_asym_clip_clips_to_minus_one_and_three():
    # one 1 among fifteen 0s: mean 1/16, unbiased std 1/4, so the 1 maps to 3.75 → 3
    x = jnp.array([0.0] * 15 + [1.0])
    got = rewards.normalize_scores(x, jnp.zeros(16, jnp.int32), grouping="batch", method="asym_clip")
    np.testing.assert_allclose(got, [-0.25] * 15 + [3.0], rtol=1e-5)
    got = rewards.normalize_scores(1.0 - x, jnp.zeros(16, jnp.int32), grouping="batch", method="asym_clip")
    np.testing.assert_allclose(got, [0.25] * 15 + [-1.0], rtol=1e-5)


@pytest.mark.parametrize("method", rewards.METHODS)
def test_group_size_one_is_a_no_op(method):
    x = jnp.array([0.5, -0.1, 2.0])
    np.testing.assert_array_equal(rewards.normalize_scores(x, jnp.arange(3), method=method), x)


def test_format_penalty_is_added_before_normalisation():
    env_reward, penalty, group = jnp.array([1.0, 1.0]), jnp.array([0.0, -0.1]), jnp.array([7, 7])
    got = rewards.trajectory_score(env_reward, penalty, group, method="mean_std")
    np.testing.assert_allclose(got, [1 / np.sqrt(2), -1 / np.sqrt(2)], rtol=1e-4)
    np.testing.assert_allclose(rewards.trajectory_score(env_reward, penalty, group), [1.0, 0.9])


def test_bad_grouping_or_method_is_named():
    with pytest.raises(ValueError, match="grouping 'seed'"):
        rewards.normalize_scores(jnp.zeros(2), jnp.zeros(2, int), grouping="seed")
    with pytest.raises(ValueError, match="method 'zscore'"):
        rewards.normalize_scores(jnp.zeros(2), jnp.zeros(2, int), method="zscore")
    with pytest.raises(ValueError, match="tag_id"):
        rewards.normalize_scores(jnp.zeros(2), jnp.zeros(2, int), grouping="inductive", method="mean")


def test_score_lands_on_the_last_policy_token():
    mask = jnp.array([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 0, 0]])
    got = rewards.scores_to_token_rewards(jnp.array([2.0, -1.0, 5.0]), mask)
    expected = np.zeros((3, 6), np.float32)
    expected[0, 4], expected[1, 1] = 2.0, -1.0  # an empty row gets nothing
    np.testing.assert_array_equal(got, expected)


def test_turn_scores_land_on_each_turn_end():
    turn_reward = jnp.array([[0.0, 1.0, 7.0], [0.5, 0.0, 0.0]])
    turn_end = jnp.array([[2, 5, 0], [1, 0, 0]])
    turn_valid = jnp.array([[True, True, False], [True, False, False]])
    got = rewards.turn_scores_to_token_rewards(turn_reward, turn_end, turn_valid, seq_len=7)
    expected = np.zeros((2, 7), np.float32)
    expected[0, 5], expected[1, 1] = 1.0, 0.5  # the invalid turn's 7.0 goes nowhere
    np.testing.assert_array_equal(got, expected)
    penalised = rewards.turn_scores_to_token_rewards(
        turn_reward, turn_end, turn_valid, seq_len=7, format_penalty_sum=jnp.array([-0.2, -0.1])
    )
    expected[0, 5], expected[1, 1] = 0.8, 0.4
    np.testing.assert_allclose(penalised, expected, rtol=1e-6)


def test_kl_in_reward_penalises_policy_tokens_only_with_a_traced_beta():
    token_rewards = jnp.array([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    kl = jnp.array([[0.5, 0.1, 0.2, 9.0], [9.0, 0.4, 9.0, 9.0]])
    mask = jnp.array([[1, 1, 1, 0], [0, 1, 0, 0]])
    got, metrics = jax.jit(rewards.kl_in_reward)(token_rewards, kl, mask, jnp.float32(0.1))
    np.testing.assert_allclose(got, [[-0.05, -0.01, 0.98, 0.0], [0.0, 1.96, 0.0, 0.0]], rtol=1e-6)
    # veRL: per-sequence token mean of the KL, averaged over sequences
    np.testing.assert_allclose(metrics["actor/reward_kl_penalty"], (0.8 / 3 + 0.4) / 2, rtol=1e-6)
    np.testing.assert_allclose(metrics["actor/reward_kl_penalty_coeff"], 0.1)
