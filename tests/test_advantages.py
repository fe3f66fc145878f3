import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo_jax.algo import advantages

# Two turns separated by observation tokens: policy tokens 2, 3 and 5, 6; the rest is prompt,
# observation or padding, whose values (9) must not matter.
MASK = jnp.array([[0, 0, 1, 1, 0, 1, 1, 0]])
VALUES = jnp.array([[9.0, 9.0, 0.1, 0.2, 9.0, 0.3, 0.4, 9.0]])


def test_gamma_lambda_one_gives_r_minus_v_on_every_policy_token():
    rewards = jnp.zeros((1, 8)).at[0, 6].set(1.5)
    adv, ret = advantages.gae(rewards, VALUES, MASK, 1.0, 1.0, whiten=False)
    policy = np.asarray(MASK, bool)
    np.testing.assert_allclose(adv[policy], 1.5 - VALUES[policy], rtol=1e-6)
    np.testing.assert_allclose(ret[policy], 1.5, rtol=1e-6)
    assert not np.any(adv[~policy]) and not np.any(ret[~policy])


def test_observation_tokens_do_not_change_gae():
    gamma, lam = 0.9, 0.8
    compact_rewards = jnp.array([[0.0, 0.3, 0.0, 1.0]])
    compact_values = VALUES[:, np.array([2, 3, 5, 6])]
    adv, ret = advantages.gae(compact_rewards, compact_values, jnp.ones((1, 4)), gamma, lam, whiten=False)
    # by hand, back to front: A3 = r3 − V3, A_t = r_t + γV_{t+1} − V_t + γλA_{t+1}
    a3 = 1.0 - 0.4
    a2 = 0.0 + gamma * 0.4 - 0.3 + gamma * lam * a3
    a1 = 0.3 + gamma * 0.3 - 0.2 + gamma * lam * a2
    a0 = 0.0 + gamma * 0.2 - 0.1 + gamma * lam * a1
    np.testing.assert_allclose(adv[0], [a0, a1, a2, a3], rtol=1e-5)
    np.testing.assert_allclose(ret, adv + compact_values, rtol=1e-6)
    # the same tokens with prompt / observation / padding tokens around them
    spread_rewards = jnp.zeros((1, 8)).at[0, 3].set(0.3).at[0, 6].set(1.0)
    spread_adv, spread_ret = advantages.gae(spread_rewards, VALUES, MASK, gamma, lam, whiten=False)
    np.testing.assert_allclose(spread_adv[0, np.array([2, 3, 5, 6])], adv[0], rtol=1e-6)
    np.testing.assert_allclose(spread_ret[0, np.array([2, 3, 5, 6])], ret[0], rtol=1e-6)


def test_whitening_uses_the_bessel_corrected_masked_variance():
    rewards = jnp.zeros((2, 8)).at[0, 6].set(1.0).at[1, 2].set(-1.0)
    mask = jnp.concatenate([MASK, jnp.array([[1, 1, 1, 0, 0, 0, 0, 0]])])
    values = jnp.concatenate([VALUES, jnp.array([[0.5, -0.2, 0.0, 9, 9, 9, 9, 9]])])
    raw, _ = advantages.gae(rewards, values, mask, 1.0, 1.0, whiten=False)
    white, _ = advantages.gae(rewards, values, mask, 1.0, 1.0)
    policy = np.asarray(mask, bool)
    expected = (raw[policy] - raw[policy].mean()) / np.sqrt(raw[policy].var(ddof=1) + 1e-8)
    np.testing.assert_allclose(white[policy], expected, rtol=1e-5)
    assert not np.any(white[~policy])


def test_bilevel_gae_on_two_turns_by_hand():
    gamma, lam, high_gamma = 0.9, 0.8, 0.5
    # row 0: turn 1 (tokens 2-3) earns 0, turn 2 (tokens 5-6) earns 1; RAGEN would not see turn 1.
    # row 1: a single turn (tokens 0-2) earning 0.5, and an unused turn slot.
    rewards = jnp.zeros((2, 8)).at[0, 6].set(1.0).at[1, 2].set(0.5)
    values = jnp.concatenate([VALUES, jnp.array([[0.1, 0.2, 0.3, 9, 9, 9, 9, 9]])])
    mask = jnp.concatenate([MASK, jnp.array([[1, 1, 1, 0, 0, 0, 0, 0]])])
    turn_end = jnp.array([[3, 6], [2, 0]])
    turn_valid = jnp.array([[True, True], [True, False]])
    adv, ret = advantages.bilevel_gae(rewards, values, mask, turn_end, turn_valid, gamma, lam, high_gamma, whiten=False)

    # turn level (γ_H): A2 = 1 − V6, A1 = 0 + γ_H·V6 − V3 + γ_H·λ·A2; turn-end rewards become A + V
    turn2 = 1.0 - 0.4
    turn1 = 0.0 + high_gamma * 0.4 - 0.2 + high_gamma * lam * turn2
    # token level (γ), restarting at each turn end
    a6 = 1.0 - 0.4
    a5 = gamma * 0.4 - 0.3 + gamma * lam * a6
    a3 = (turn1 + 0.2) - 0.2
    a2 = gamma * 0.2 - 0.1 + gamma * lam * a3
    np.testing.assert_allclose(adv[0], [0, 0, a2, a3, 0, a5, a6, 0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ret[0], [0, 0, a2 + 0.1, a3 + 0.2, 0, a5 + 0.3, a6 + 0.4, 0], rtol=1e-5)

    b2 = 0.5 - 0.3
    b1 = gamma * 0.3 - 0.2 + gamma * lam * b2
    b0 = gamma * 0.2 - 0.1 + gamma * lam * b1
    np.testing.assert_allclose(adv[1], [b0, b1, b2, 0, 0, 0, 0, 0], rtol=1e-5)


def test_grpo_normalises_within_groups():
    score = jnp.array([0.0, 0.0, 0.0, 1.0, 2.0, 3.0, 5.0])
    group_id = jnp.array([4, 4, 4, 9, 9, 9, 2])
    mask = jnp.array([[1, 1, 0]] * 7)
    adv, ret = advantages.grpo_outcome(score, group_id, mask)
    # zero-std group → 0; {1, 2, 3}: mean 2, unbiased std 1; singleton: mean 0, std 1 (veRL)
    per_sample = np.array([0, 0, 0, -1, 0, 1, 5]) / (1 + 1e-6)
    np.testing.assert_allclose(adv, per_sample[:, None] * np.array([1, 1, 0]), rtol=1e-6)
    np.testing.assert_array_equal(ret, adv)
    centred, _ = advantages.grpo_outcome(score, group_id, mask, norm_by_std=False)
    np.testing.assert_allclose(centred[:, 0], [0, 0, 0, -1, 0, 1, 5])
    # RAGEN's effective GRPO (quirk 8): every sample its own group → the advantage is the score
    singletons, _ = advantages.grpo_outcome(score, jnp.arange(7), mask)
    np.testing.assert_allclose(singletons[:, 0], score / (1 + 1e-6), rtol=1e-6)


@pytest.mark.parametrize("value", [-0.3, -0.1, 0.1, 0.7])
@pytest.mark.parametrize("groups", [2, 3, 8])
def test_a_group_whose_scores_agree_has_no_advantage(value, groups):
    """Equal scores give advantage exactly 0 and std exactly 0, as veRL's torch statistics do. Summed
    in float32, eight −0.3s are not 8 × −0.3: before, 2 such groups of 8 got advantages of −0.029
    (one rounding over the 1e-6 in the denominator), pushing down every response they sampled."""
    from starpo_jax.algo.masked import masked_std, same_group_stats

    score = jnp.full((groups * 8,), value, jnp.float32)
    group_id = jnp.repeat(jnp.arange(groups), 8)
    adv, _ = advantages.grpo_outcome(score, group_id, jnp.ones((groups * 8, 3)))
    assert not np.asarray(adv).any()
    _, mean, std = same_group_stats(score, group_id)
    assert (np.asarray(mean) == np.float32(value)).all() and not np.asarray(std).any()
    assert masked_std(score, jnp.ones_like(score)) == 0.0


@pytest.mark.parametrize("estimator", ["gae", "bilevel"])
def test_traced_hyperparameters_jit_and_vmap(estimator):
    rewards = jnp.zeros((1, 8)).at[0, 3].set(0.2).at[0, 6].set(1.0)
    turn_end, turn_valid = jnp.array([[3, 6]]), jnp.array([[True, True]])

    def run(gamma, lam):
        if estimator == "gae":
            return advantages.gae(rewards, VALUES, MASK, gamma, lam)[0]
        return advantages.bilevel_gae(rewards, VALUES, MASK, turn_end, turn_valid, gamma, lam, 0.95)[0]

    gammas = jnp.array([1.0, 0.9])
    swept = jax.jit(jax.vmap(run, in_axes=(0, None)))(gammas, jnp.float32(0.95))
    for i, gamma in enumerate([1.0, 0.9]):
        np.testing.assert_allclose(swept[i], run(gamma, 0.95), rtol=1e-5, atol=1e-6)
    assert not np.allclose(swept[0], swept[1])
