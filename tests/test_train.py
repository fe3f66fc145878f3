"""The compiled training iteration: it runs, it learns, and it learns for the right reason.

The learning test trains a tiny random decoder on a Bandit whose risky arm always pays (1.0 vs
0.1). To keep the test short the responder samples only the arm's name (a two-way choice between
the first tokens of the two names, from the policy's own logits) and completes the answer; the
update then sees the whole response under the full vocabulary. RL must raise the probability of
naming the rewarded arm; with the advantage sign flipped, or the loss mask moved off the response,
it does not.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs_jax
from helpers import tiny_llama_for
from starpo_jax.rollout.multi_turn import RolloutPlan, TagPlan, build_tables, stop_tokens_for
from starpo_jax.rollout.sampling import DecodeOutput, append
from starpo_jax.train import Hyperparams, TrainSettings, init_train_state, jit_iteration, make_train_step, replicate

ARMS = ("Phoenix", "Dragon")


@dataclasses.dataclass(frozen=True, eq=False)
class ArmResponder:
    """Samples which arm to name from the policy's logits for the names' first tokens."""

    responses: np.ndarray  # int32[2, R]: "Phoenix</answer><|im_end|>", "Dragon..." token ids
    lengths: np.ndarray  # int32[2]
    max_len: int

    def init(self, model, batch_size):
        from starpo_jax.rollout.sampling import init_cache

        return init_cache(model.merge().config, batch_size, self.max_len)

    def respond(self, model, cache, prompt_ids, num_new, key, temperature, active, turn):
        cache, logits = append(model, cache, prompt_ids, num_new)
        first = jnp.asarray(self.responses[:, 0])
        choice = jax.random.categorical(key, logits[:, first] / temperature)
        tokens = jnp.asarray(self.responses)[choice]
        logprobs = jnp.zeros(tokens.shape, jnp.float32)
        return DecodeOutput(tokens, logprobs, jnp.where(active, jnp.asarray(self.lengths)[choice], 0), cache, logits)


def _setup(tokenizer, settings_overrides=None):
    env = envs_jax.make("Bandit", hi_arm_hiscore_prob=1.0)
    plan = RolloutPlan(
        tags=(TagPlan("Bandit", env, 4, 1),), group_size=8, max_turn=1, max_actions_per_turn=1,
        response_length=8, max_len=320, enable_think=False,
    )
    tables = build_tables(tokenizer, plan)
    plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(tokenizer, tables))
    stop = tables.tags[0].prompts.stop_token_id
    ids = [tokenizer.encode(f"{arm}</answer>", add_special_tokens=False) + [stop] for arm in ARMS]
    width = max(map(len, ids))
    responses = np.array([i + [0] * (width - len(i)) for i in ids], np.int32)
    responder = ArmResponder(responses, np.array([len(i) for i in ids], np.int32), plan.max_len)
    model = tiny_llama_for(tokenizer)
    settings = TrainSettings(**{
        "adv_estimator": "grpo", "reward_method": "mean_std", "kept_groups": 4, "ppo_mini_batch_size": 32,
        "micro_batch_size": 8, "logprob_chunk": 64, **(settings_overrides or {}),
    })
    hyper = Hyperparams.create(actor_lr=3e-3, critic_lr=1e-3, entropy_coeff=0.0, filter_ratio=1.0)  # the rest: defaults
    return plan, tables, responder, model, settings, hyper


# Compiled with LLVM's optimisations, which the suite's flags turn off for compile time (helpers.py):
# a learning test runs its iteration 12 times, and each takes less than half as long (measured: 1.8 ->
# 0.7 s an iteration, for ~2 s more compiling).
MANY_STEPS = {"xla_backend_optimization_level": 1}


def _iteration(step, settings, plan):
    """The iteration as the drivers run it (``jit_iteration``: the rollout, the smallest update layout
    that holds its batch, the update), compiled with ``MANY_STEPS`` and donating nothing. The update
    then computes only the batch's positions, not all ``max_len`` of every row as ``step`` does
    (measured: 1.4 -> 0.7 s a step)."""
    return jit_iteration(step, settings, plan)._replace(
        collect=jax.jit(step.collect, compiler_options=MANY_STEPS),
        learn=jax.jit(step.learn, static_argnums=3, compiler_options=MANY_STEPS))


def _train(plan, tables, responder, model, settings, hyper, *, steps: int):
    step = _iteration(make_train_step(settings, model.graphdef, plan, responder), settings, plan)
    state = init_train_state(settings, model, jax.random.PRNGKey(0))
    history = []
    for _ in range(steps):
        state, metrics = step(state, tables, hyper, jax.random.PRNGKey(1))
        history.append(float(metrics["train/Bandit/success"]))
    return state, history


@pytest.fixture(scope="module")
def bandit(smollm2_tokenizer):
    return _setup(smollm2_tokenizer)


def test_rl_raises_success(bandit):
    state, history = _train(*bandit, steps=12)
    early, late = np.mean(history[:3]), np.mean(history[-3:])
    assert late >= 0.9 and late > early + 0.2, history


def test_flipped_advantage_does_not_learn(bandit, monkeypatch):
    import starpo_jax.algo.advantages as adv

    original = adv.grpo_outcome
    monkeypatch.setattr(adv, "grpo_outcome", lambda *a, **k: jax.tree.map(lambda x: -x, original(*a, **k)))
    _, history = _train(*bandit, steps=12)
    assert np.mean(history[-3:]) < 0.5, history


# The LoRA learning test's adapters (the sweep test's LoRA case uses them too).
LORA = {"lora_rank": 4, "lora_alpha": 8.0}


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_vmap_sweeps_hyperparameters_in_one_program(bandit, lora_rank):
    """Two learning rates trained side by side under vmap, as ``experiments.sweep`` iterates
    (``jit_iteration`` over ``replicate``'s states), equal two separate runs (with LoRA the settings
    share one frozen base). The separate runs' iteration is the learning tests' program (their
    settings and compiler options), which the persistent compilation cache then compiles once."""
    plan, tables, responder, model, settings, hyper = bandit
    settings = dataclasses.replace(settings, **(LORA if lora_rank else {"lora_rank": 0}))
    step = make_train_step(settings, model.graphdef, plan, responder)
    state = init_train_state(settings, model, jax.random.PRNGKey(0))
    lrs = jnp.asarray([0.0, 3e-3])
    hypers = jax.tree.map(lambda x: jnp.stack([x, x]), hyper).replace(actor_lr=lrs)
    states, axes = replicate(jax.tree.map(jnp.copy, state), 2)  # a copy: the sweep's update donates it
    key = jax.random.PRNGKey(3)
    states, metrics = jit_iteration(step, settings, plan, axes)(states, tables, hypers, key)
    assert metrics["actor/lr"].tolist() == pytest.approx(lrs.tolist())
    single = _iteration(step, settings, plan)
    for i in range(2):
        alone, m = single(state, tables, jax.tree.map(lambda x: x[i], hypers), key)
        # The loss is a mean of O(1) terms summed in another order: ~100 float32 ulps relative (rtol),
        # and absolute where the mean cancels to ~0 (atol).
        np.testing.assert_allclose(metrics["actor/pg_loss"][i], m["actor/pg_loss"], rtol=1e-5, atol=1e-6)
        swept = jax.tree.map(lambda x: x[i], states.actor)
        assert_same_adamw_step(swept, alone.actor, state.actor, float(lrs[i]))
    frozen = jax.tree.map(lambda x: x[0], states.actor)
    moved = jax.tree.map(lambda x: x[1], states.actor)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(frozen), jax.tree.leaves(state.actor)))
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(moved), jax.tree.leaves(state.actor)))
    if lora_rank:  # one unbatched base, untouched
        assert _leaves_equal(states.base, state.base)


def assert_same_adamw_step(after, reference, before, lr):
    """``after`` and ``reference`` took the same single AdamW step from ``before`` in two differently
    compiled programs (vmapped and alone), so they are equal up to what float32 rounding can change.

    Fused differently, the programs sum each gradient g in another order, so g differs by rounding.
    AdamW's first step moves a weight by lr * (g / (|g| + eps) + wd * w). Where |g| >> eps the
    quotient is ~±1 and rounding-exact, but where g is itself within rounding of zero the quotient
    can take any value in (-1, 1): such a weight may differ by up to 2 lr, never more (measured on
    2-core CPUs: 1 weight in 6.4M by 7e-4 lr, the rest below 1e-6 lr). So: every weight within
    2 lr, and only a vanishing share (< 0.1 %) of the weights the step moved by more than a
    thousandth of a step may differ by that much; a wrong, swapped or missing setting changes ~all.
    """
    a, b, w0 = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(t)]) for t in (after, reference, before))
    diff = np.abs(a - b)
    assert diff.max() <= 2 * lr, f"a weight differs by {diff.max():.3g}, more than one Adam step can explain"
    small = 1e-3 * lr
    moved, off = np.count_nonzero(np.abs(b - w0) > small), np.count_nonzero(diff > small)
    assert off <= 1e-3 * moved, f"{off} of {moved} updated weights differ by more than {small:.3g}"


def _leaves_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_lora_rl_raises_success_and_leaves_the_base_frozen(smollm2_tokenizer):
    plan, tables, responder, model, settings, hyper = _setup(smollm2_tokenizer, LORA)
    state, history = _train(plan, tables, responder, model, settings, hyper.replace(actor_lr=jnp.float32(1e-2)), steps=12)
    early, late = np.mean(history[:3]), np.mean(history[-3:])
    # Adapters learn more slowly than full fine-tuning here (~0.85 after 12 steps, ~0.9 after 20).
    assert late >= 0.8 and late > early + 0.2, history
    assert _leaves_equal(state.base, model.params)
    assert set(state.actor) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


@pytest.mark.parametrize("estimator", ["gae", "bilevel_gae"])
def test_lora_step_trains_critic_adapters_and_value_head(smollm2_tokenizer, estimator):
    """With LoRA the critic learns its adapters and its value head (RAGEN froze the head, quirk 11),
    and the reference is the base: before any update the policy equals it, so KL starts at 0."""
    plan, tables, responder, model, settings, hyper = _setup(
        smollm2_tokenizer, {"lora_rank": 4, "adv_estimator": estimator, "use_kl_loss": True}
    )
    step = jax.jit(make_train_step(settings, model.graphdef, plan, responder).step)
    state = init_train_state(settings, model, jax.random.PRNGKey(0))
    assert state.ref is None and state.base is not None
    new, metrics = step(state, tables, hyper.replace(kl_loss_coef=jnp.float32(0.1)), jax.random.PRNGKey(1))
    assert float(metrics["rollout/ref_log_prob"]) == pytest.approx(float(metrics["rollout/old_log_prob"]), abs=1e-6)
    assert float(metrics["actor/kl_loss"]) == pytest.approx(0.0, abs=1e-6)  # first mini-batch sees the base
    assert all(np.isfinite(float(v)) for v in metrics.values())
    assert _leaves_equal(new.base, state.base)
    assert new.critic is not None and state.critic is not None
    assert not np.array_equal(new.critic.head_w, state.critic.head_w)
    assert not _leaves_equal(new.critic.backbone, state.critic.backbone)
    assert not _leaves_equal(new.actor, state.actor)
