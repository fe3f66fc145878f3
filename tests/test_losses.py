import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from starpo_jax.algo import losses


def reference_logprobs_and_entropy(logits, targets, temperature):
    z = logits / temperature
    log_probs = jax.nn.log_softmax(z, axis=-1)
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    return jnp.take_along_axis(log_probs, targets[..., None], axis=-1)[..., 0], entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_entropy_and_their_gradient_match_the_textbook_formulas(temperature):
    logits = 3 * jax.random.normal(jax.random.key(0), (2, 5, 11))
    targets = jax.random.randint(jax.random.key(1), (2, 5), 0, 11)
    weights = jax.random.normal(jax.random.key(2), (2, 2, 5))

    def objective(fn, logits):
        logp, entropy = fn(logits, targets, temperature)
        return jnp.sum(weights[0] * logp + weights[1] * entropy)

    for got, want in zip(
        losses.token_logprobs_and_entropy(logits, targets, temperature),
        reference_logprobs_and_entropy(logits, targets, temperature),
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(
        jax.grad(functools.partial(objective, losses.token_logprobs_and_entropy))(logits),
        jax.grad(functools.partial(objective, reference_logprobs_and_entropy))(logits),
        rtol=1e-4,
        atol=1e-6,
    )


def test_bfloat16_logits_give_float32_outputs_and_bfloat16_gradients():
    logits = jax.random.normal(jax.random.key(0), (3, 7)).astype(jnp.bfloat16)
    targets = jnp.array([0, 3, 6])
    logp, entropy = losses.token_logprobs_and_entropy(logits, targets)
    assert logp.dtype == entropy.dtype == jnp.float32
    assert jax.grad(lambda x: losses.token_logprobs_and_entropy(x, targets)[0].sum())(logits).dtype == jnp.bfloat16


# One token per case; clip_low 0.2, clip_high 0.28, clip_c 3.
ADVANTAGE = jnp.array([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
RATIO = jnp.array([0.5, 1.1, 1.25, 1.3, 0.75, 0.9, 2.0, 4.0])
# Where a clip (or the dual-clip) holds the loss constant: A > 0 above 1 + ε_high; A < 0 below
# 1 − ε_low; A < 0 above clip_c.
FROZEN = np.array([False, False, False, True, True, False, False, True])


def pg(logp, advantages=ADVANTAGE, clip_high=0.28, mask=None, agg_mode="token-mean"):
    mask = jnp.ones_like(logp) if mask is None else mask
    return losses.policy_loss(logp, jnp.zeros_like(logp), advantages, mask, 0.2, clip_high, 3.0, agg_mode)


def test_clip_higher_freezes_the_gradient_exactly_outside_the_trust_region():
    logp = jnp.log(RATIO)
    grad = jax.grad(lambda lp: pg(lp)[0])(logp)
    expected = np.where(FROZEN, 0.0, -ADVANTAGE * RATIO / RATIO.size)
    np.testing.assert_allclose(grad, expected, rtol=1e-5)
    # a symmetric clip (ε_high = 0.2) would also freeze the A > 0 token at ratio 1.25
    symmetric = jax.grad(lambda lp: pg(lp, clip_high=0.2)[0])(logp)
    np.testing.assert_array_equal(np.flatnonzero(np.asarray(symmetric) == 0), [2, 3, 4, 7])


def test_policy_loss_values_and_veRL_metrics():
    loss, metrics = pg(jnp.log(RATIO))
    per_token = np.array([-0.5, -1.1, -1.25, -1.28, 0.8, 0.9, 2.0, 3.0])
    np.testing.assert_allclose(loss, per_token.mean(), rtol=1e-5)
    np.testing.assert_allclose(metrics["actor/pg_loss"], loss)
    # L2 > L1 for ratio 1.3 (A > 0) and 0.75 (A < 0); the dual-clip caps ratio 4
    np.testing.assert_allclose(metrics["actor/pg_clipfrac"], 2 / 8)
    np.testing.assert_allclose(metrics["actor/pg_clipfrac_lower"], 1 / 8)
    np.testing.assert_allclose(metrics["actor/ppo_kl"], -np.log(RATIO).mean(), rtol=1e-5)


def test_dual_clip_caps_negative_advantage_losses_at_minus_a_times_c():
    loss, _ = pg(jnp.log(jnp.array([10.0])), advantages=jnp.array([-2.0]))
    np.testing.assert_allclose(loss, 6.0, rtol=1e-6)
    loss, _ = pg(jnp.log(jnp.array([10.0])), advantages=jnp.array([2.0]))
    np.testing.assert_allclose(loss, -2.0 * 1.28, rtol=1e-6)


X = jnp.array([[1.0, 2.0, 3.0, 0.0, 7.0], [4.0, 7.0, 7.0, 7.0, 7.0], [9.0, 9.0, 9.0, 9.0, 9.0]])
RAGGED = jnp.array([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]])


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 4) / 4),
        ("seq-mean-token-mean", (2 + 4) / 2),
        ("seq-mean-token-sum", (6 + 4) / 2),
        ("seq-mean-token-sum-norm", (6 + 4) / 5),
    ],
)
def test_aggregation_modes_on_a_ragged_mask(mode, expected):
    np.testing.assert_allclose(losses.aggregate(X, RAGGED, mode), expected, rtol=1e-6)
    # an empty row counts as removed
    np.testing.assert_allclose(losses.aggregate(X[:2], RAGGED[:2], mode), expected, rtol=1e-6)


def test_token_sum_norm_divides_by_the_horizon_given():
    # veRL divides by its padded batch's width; train.py passes RAGEN's (traced)
    np.testing.assert_allclose(losses.aggregate(X, RAGGED, "seq-mean-token-sum-norm", jnp.float32(4.0)), 10 / 4)
    np.testing.assert_allclose(losses.aggregate(X, RAGGED, "seq-mean-token-mean", jnp.float32(4.0)), 3.0)


def test_unknown_names_raise_clear_errors():
    with pytest.raises(ValueError, match="aggregation mode 'mean'"):
        losses.aggregate(X, RAGGED, "mean")
    with pytest.raises(ValueError, match="KL estimator 'full'"):
        losses.kl_penalty(X, X, "full")


@pytest.mark.parametrize("agg_mode", losses.AGG_MODES)
def test_masked_positions_never_reach_the_actor_or_critic_loss(agg_mode):
    key = jax.random.split(jax.random.key(0), 6)
    logits = jax.random.normal(key[0], (2, 5, 9))
    targets = jax.random.randint(key[1], (2, 5), 0, 9)
    old_logp, ref_logp = jax.random.normal(key[2], (2, 2, 5)) * 0.1 - 2.0
    advantages = jax.random.normal(key[3], (2, 5))
    mask = jnp.array([[0, 1, 1, 0, 1], [1, 1, 0, 0, 0]])
    outside = ~np.asarray(mask, bool)

    def actor(logits):
        logp, entropy = losses.token_logprobs_and_entropy(logits, targets)
        return losses.actor_loss(
            logp, entropy, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28,
            entropy_coeff=0.01, agg_mode=agg_mode, ref_logp=ref_logp, kl_coef=0.1, kl_kind="low_var_kl",
        )[0]

    grad = jax.grad(actor)(logits)
    assert np.all(np.asarray(grad)[outside] == 0) and np.any(np.asarray(grad)[~outside] != 0)
    scrambled = logits + jnp.where(outside[..., None], 50.0 * jax.random.normal(key[4], logits.shape), 0.0)
    np.testing.assert_allclose(actor(scrambled), actor(logits), rtol=1e-6)

    returns, old_values = jax.random.normal(key[5], (2, 2, 5))
    critic = lambda values: losses.value_loss(values, old_values, returns, mask, 0.5, agg_mode)[0]  # noqa: E731
    values = old_values + 0.3
    value_grad = jax.grad(critic)(values)
    assert np.all(np.asarray(value_grad)[outside] == 0) and np.any(np.asarray(value_grad)[~outside] != 0)
    np.testing.assert_allclose(critic(jnp.where(outside, 100.0, values)), critic(values), rtol=1e-6)


def test_kl_estimators():
    logp, ref = jnp.array([-1.0, -2.0, -1.0]), jnp.array([-1.5, -1.0, 5.0])
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, "kl"), [0.5, -1.0, -6.0])
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, "abs"), [0.5, 1.0, 6.0])
    np.testing.assert_allclose(losses.kl_penalty(logp, ref, "mse"), [0.125, 0.5, 18.0])
    # e^(ref−logp) − (ref−logp) − 1, clamped to 10
    np.testing.assert_allclose(
        losses.kl_penalty(logp, ref, "low_var_kl"), [np.exp(-0.5) - 0.5, np.exp(1.0) - 2.0, 10.0], rtol=1e-6
    )


def test_value_clipping():
    values, old, returns = jnp.array([1.0, 2.0, 0.0]), jnp.array([0.5, 2.0, 0.2]), jnp.array([2.0, 1.0, 0.0])
    loss, metrics = losses.value_loss(values, old, returns, jnp.ones(3), 0.2)
    # token 0: V moved 0.5 from V_old, clipped to 0.7, whose error 1.69 beats the unclipped 1
    np.testing.assert_allclose(loss, 0.5 * (1.69 + 1.0 + 0.0) / 3, rtol=1e-5)
    np.testing.assert_allclose(metrics["critic/vf_clipfrac"], 1 / 3)
    np.testing.assert_allclose(metrics["critic/vpred_mean"], 1.0)
    grad = jax.grad(lambda v: losses.value_loss(v, old, returns, jnp.ones(3), 0.2)[0])(values)
    np.testing.assert_allclose(grad, [0.0, (2.0 - 1.0) / 3, 0.0], atol=1e-7)


def test_explained_variance_is_verls_with_its_epsilon():
    returns, mask = jnp.array([1.0, 2.0, 4.0, 100.0]), jnp.array([1, 1, 1, 0])
    assert np.isclose(losses.explained_variance(returns, returns, mask), 1.0)
    assert np.isclose(losses.explained_variance(returns, jnp.zeros(4), mask), 1 - (7 / 3) / (7 / 3 + 1e-5))
    # residuals 1, −1, 0 (unbiased var 1) against returns 1, 2, 4 (unbiased var 7/3)
    residual = jnp.array([1.0, -1.0, 0.0, 5.0])
    assert np.isclose(losses.explained_variance(returns, returns - residual, mask), 1 - 1 / (7 / 3 + 1e-5), rtol=1e-6)
    # constant returns: veRL's 1e-5 keeps it finite (1 − Var(values) / 1e-5)
    values = jnp.array([0.0, 0.01, 0.02, 7.0])
    np.testing.assert_allclose(losses.explained_variance(jnp.ones(4), values, mask), 1 - 1e-4 / 1e-5, rtol=1e-4)


def test_clip_ratios_are_traced_and_vmap_as_a_sweep():
    logp = jnp.log(RATIO)

    @jax.jit
    def loss_and_grad(clip_high):
        return jax.value_and_grad(lambda lp: pg(lp, clip_high=clip_high)[0])(logp)

    clip_highs = jnp.array([0.2, 0.28])
    losses_swept, grads_swept = jax.vmap(loss_and_grad)(clip_highs)
    for i, clip_high in enumerate([0.2, 0.28]):
        # eager vs vmapped-jitted: per-token exp and a mean of 8 terms, a few float32 ulps apart at
        # most (rtol 1e-6 is ~8 ulps); the clipped token's gradient is an exact 0 in both.
        loss, grad = jax.value_and_grad(lambda lp: pg(lp, clip_high=clip_high)[0])(logp)
        np.testing.assert_allclose(losses_swept[i], loss, rtol=1e-6)
        np.testing.assert_allclose(grads_swept[i], grad, rtol=1e-6)
    assert grads_swept[0, 2] == 0 and grads_swept[1, 2] != 0


def test_actor_loss_adds_entropy_bonus_and_kl_loss():
    logp, old, ref = jnp.log(RATIO), jnp.zeros(8), jnp.log(RATIO) - 0.1
    entropy, mask = jnp.linspace(0.5, 1.5, 8), jnp.ones(8)
    pg_loss, _ = pg(logp)
    loss, metrics = losses.actor_loss(
        logp, entropy, old, ADVANTAGE, mask, clip_low=0.2, clip_high=0.28, entropy_coeff=0.01, ref_logp=ref, kl_coef=0.5
    )
    np.testing.assert_allclose(metrics["actor/entropy_loss"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(metrics["actor/kl_loss"], 0.1, rtol=1e-5)
    np.testing.assert_allclose(loss, pg_loss - 0.01 * 1.0 + 0.5 * 0.1, rtol=1e-5)
    no_kl, no_kl_metrics = losses.actor_loss(logp, entropy, old, ADVANTAGE, mask, clip_low=0.2, clip_high=0.28)
    np.testing.assert_allclose(no_kl, pg_loss, rtol=1e-6)
    assert "actor/kl_loss" not in no_kl_metrics
