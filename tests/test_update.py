"""How ``train.py`` puts the update maths together, on a rollout batch made up by hand.

Each module's maths is checked against the original elsewhere (test_advantages, test_rewards,
test_losses, test_filtering); these tests check the composition: what reaches each statistic, in
which order, and which steps are taken. The batch is 4 groups × 8 trajectories of random tokens
(no playing) and the model a tiny random decoder; compiling ``learn`` is most of each test's time.
"""

import dataclasses
import functools

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import envs_jax
from starpo_jax import forward
from starpo_jax.algo import advantages, rewards
from starpo_jax.forward import (
    FINE_WIDTH,
    ForwardPass,
    Rows,
    first_prompt_split,
    full_layout,
    policy_tokens_per_row,
    shared_prompts,
    size_bucket,
    token_logprobs,
    token_values,
    update_forward,
    update_layout,
)
from starpo_jax.models import Decoder, ModelState, preset
from starpo_jax.rollout.multi_turn import RolloutPlan, TagPlan, Trajectories
from starpo_jax.train import (
    Hyperparams,
    TrainSettings,
    UpdateBatch,
    UpdateProgram,
    accumulate_gradients,
    actor_loss_fn,
    batch_metrics,
    critic_loss_fn,
    estimate_advantages,
    filter_groups,
    init_train_state,
    make_train_step,
    old_logprobs,
    old_values,
    ppo_update,
    prepare_update,
    ref_logprobs,
    token_level_rewards,
)

G, N, L = 4, 8, 48
PLAN = RolloutPlan(
    tags=(TagPlan("Bandit", envs_jax.make("Bandit"), G, 1),), group_size=N, max_turn=1,
    max_actions_per_turn=1, response_length=8, max_len=L, enable_think=False,
)
# In-group reward stds 0.48, 0, 0.35, 0.38: the filter keeps group 0 first, then group 3.
REWARD = np.array([
    [0.0, 1.0, 0.3, 1.0, 0.9, 0.0, 0.1, 1.0],
    [0.5] * 8,
    [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
    [1.0, 0.0, 1.0, 0.6, 1.0, 1.0, 0.4, 1.0],
], np.float32).reshape(-1)
PROMPT = 20  # tokens before each row's one response
HYPER = Hyperparams.create(actor_lr=1e-3, critic_lr=1e-3, entropy_coeff=0.0, filter_ratio=1.0)  # the rest: defaults


def rollout_batch(env_reward=REWARD, seed=0) -> Trajectories:
    """A rollout batch in env order: a prompt, one response of 3–8 sampled tokens (the loss mask),
    two closing tokens; random ids; the given env rewards and a −0.1 format penalty on every 5th row."""
    B = G * N
    rng = np.random.default_rng(seed)
    end = PROMPT + rng.integers(3, 9, B)
    position = np.arange(L)
    loss_mask = (position >= PROMPT) & (position < end[:, None])
    zeros = lambda dtype, *shape: jnp.zeros((B, *shape), dtype)  # noqa: E731
    return Trajectories(
        tokens=jnp.asarray(np.where(position < end[:, None] + 2, rng.integers(1, 256, (B, L)), 0), jnp.int32),
        loss_mask=jnp.asarray(loss_mask),
        sampler_logprobs=jnp.asarray(np.where(loss_mask, -rng.uniform(1, 6, (B, L)), 0.0), jnp.float32),
        length=jnp.asarray(end + 2, jnp.int32),
        turn_start=jnp.full((B, 1), PROMPT, jnp.int32),
        turn_end=jnp.asarray(end[:, None], jnp.int32),
        turn_played=jnp.ones((B, 1), bool),
        turn_reward=jnp.asarray(env_reward)[:, None],
        turn_penalised=zeros(bool, 1),
        env_reward=jnp.asarray(env_reward),
        format_penalty_sum=jnp.asarray(np.where(np.arange(B) % 5 == 0, -0.1, 0.0), jnp.float32),
        success=zeros(bool),
        num_actions=zeros(jnp.int32),
        num_turns=jnp.ones(B, jnp.int32),
        action_is_effective=zeros(jnp.float32),
        action_is_valid=zeros(jnp.float32),
        response_tokens=jnp.asarray(end - PROMPT, jnp.int32),
        think_tokens=zeros(jnp.int32),
        context_exhausted=zeros(bool),
        group_id=jnp.arange(B, dtype=jnp.int32) // N,
        tag_id=zeros(jnp.int32),
        action_name_ids=jnp.zeros((B, 2), jnp.int32),
    )


@pytest.fixture(scope="module")
def model():
    return ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0)))


def program(model, **overrides):
    """(jitted prepare, jitted learn, initial state) for GRPO on mean_std state-normalised scores."""
    settings = TrainSettings(**{
        "adv_estimator": "grpo", "reward_method": "mean_std", "kept_groups": G, "ppo_mini_batch_size": G * N,
        "micro_batch_size": N, "logprob_chunk": 8, **overrides,
    })
    prepare = functools.partial(prepare_update, program_for(settings, model, full_layout(L)))
    learn = make_train_step(settings, model.graphdef, PLAN).learn
    return jax.jit(prepare), jax.jit(learn), init_train_state(settings, model, jax.random.PRNGKey(0))


def adam_steps(opt_state) -> int:
    return int(optax.tree_utils.tree_get(opt_state, "count"))


def trees_equal(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def test_padding_rows_move_no_statistic(model):
    """Ratio 0.25 keeps 1 of 4 groups. A program sized for 4 kept groups fills 3 with padding copies
    of group 0 (its first mini-batch is half padding, its second all padding); it must train exactly
    like a program sized for the 1 kept group: same advantages, metrics, steps and weights."""
    traj, hyper = rollout_batch(), HYPER.replace(filter_ratio=jnp.float32(0.25))
    runs = []
    for kept, mini in ((4, 16), (1, 8)):  # padded, exact
        prepare, learn, state = program(model, kept_groups=kept, ppo_mini_batch_size=mini, micro_batch_size=4)
        batch, _ = prepare(state, traj, hyper)
        runs.append((batch, *learn(state, traj, hyper)))
    (padded, padded_state, padded_metrics), (exact, exact_state, exact_metrics) = runs
    real = slice(0, N)
    assert float(padded.mask[N:].sum()) == 0 and float(padded.mask[real].sum()) > 0
    # Two differently compiled programs: equal up to float32 rounding in the reductions.
    np.testing.assert_allclose(padded.advantages[real], exact.advantages, rtol=1e-5, atol=1e-6)
    for name in ("actor/pg_loss", "actor/grad_norm", "actor/entropy_loss", "critic/advantages/mean", "critic/score/mean"):
        np.testing.assert_allclose(padded_metrics[name], exact_metrics[name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert adam_steps(padded_state.actor_opt) == adam_steps(exact_state.actor_opt) == 1
    # Adam's first step moves a weight by lr·g/(|g| + 1e-8): rounding in g changes that by far less
    # than 1e-6 unless |g| is itself near 1e-8, where it can change by up to lr. So almost every
    # weight must agree to 1e-6, and none by more than one step (lr = 1e-3). Different advantages
    # would move most weights differently.
    for a, b in zip(jax.tree.leaves(padded_state.actor), jax.tree.leaves(exact_state.actor), strict=True):
        assert np.mean(~np.isclose(a, b, rtol=1e-5, atol=1e-6)) < 1e-3
        assert np.abs(np.asarray(a) - np.asarray(b)).max() <= 1e-3


def test_scores_are_normalised_over_the_whole_rollout_then_filtered(model):
    """RAGEN normalises in its ctx_manager, before the filter: with batch grouping the kept scores
    are the whole batch's normalised scores. With GAE at γ = λ = 1 the return of every policy token
    is the trajectory's score."""
    traj = rollout_batch()
    prepare, _, state = program(
        model, adv_estimator="gae", reward_grouping="batch", kept_groups=1, ppo_mini_batch_size=N, micro_batch_size=N
    )
    batch, _ = prepare(state, traj, HYPER.replace(filter_ratio=jnp.float32(0.25)))
    whole = rewards.trajectory_score(traj.env_reward, traj.format_penalty_sum, traj.group_id, traj.tag_id, "batch", "mean_std")
    mask = np.asarray(batch.mask, bool)
    expected = np.broadcast_to(np.asarray(whole[:N])[:, None], mask.shape)  # group 0 is the one kept
    np.testing.assert_allclose(np.asarray(batch.returns)[mask], expected[mask], rtol=1e-5, atol=1e-6)


def test_grpo_with_kl_in_reward_changes_the_advantages_by_the_kl(model):
    """veRL's GRPO outcome is the summed token reward, so β·KL on every token moves it."""
    traj = rollout_batch()
    prepare, _, state = program(model, kl_in_reward=True)
    key = jax.random.PRNGKey(7)
    noise = lambda x: x + 0.2 * jax.random.normal(jax.random.fold_in(key, x.size), x.shape, x.dtype)  # noqa: E731
    state = state.replace(ref=jax.tree.map(noise, state.ref))  # a reference that differs from the policy
    without, _ = prepare(state, traj, HYPER)
    beta = 0.5
    with_kl, metrics = prepare(state, traj, HYPER.replace(kl_in_reward_coef=jnp.float32(beta)))
    mask = with_kl.mask
    kl = jnp.sum(jnp.where(mask > 0, with_kl.old_logp - with_kl.ref_logp, 0.0), axis=1)
    score = rewards.trajectory_score(traj.env_reward, traj.format_penalty_sum, traj.group_id, traj.tag_id, "state", "mean_std")
    expected, _ = advantages.grpo_outcome(score - beta * kl, traj.group_id, mask)
    np.testing.assert_allclose(with_kl.advantages, expected, rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(with_kl.advantages - without.advantages).max()) > 1e-2
    assert float(metrics["actor/reward_kl_penalty"]) != 0.0


def test_seq_mean_token_sum_norm_divides_by_the_rollouts_longest_sequence(model):
    """RAGEN divides by its padded batch's width: the longest sequence of the whole rollout minus
    one. Lengthening a trajectory the filter drops changes only that divisor."""
    _, learn, state = program(
        model, loss_agg_mode="seq-mean-token-sum-norm", kept_groups=2, ppo_mini_batch_size=2 * N
    )
    hyper = HYPER.replace(filter_ratio=jnp.float32(0.5))  # keeps groups 0 and 3
    short = rollout_batch()
    long = short.replace(length=short.length.at[N].set(L))  # a row of group 1, dropped
    (_, m_short), (_, m_long) = learn(state, short, hyper), learn(state, long, hyper)
    ratio = float(m_short["actor/entropy_loss"]) / float(m_long["actor/entropy_loss"])
    assert ratio == pytest.approx((L - 1) / (int(short.length.max()) - 1), rel=1e-6)


def test_a_non_finite_gradient_skips_the_step_and_is_counted(model):
    """A NaN reward (unnormalised) makes every whitened GAE advantage and its row's returns NaN: both
    optimisers skip the step, leave weights and moments as they were, and count it; a finite batch
    then trains."""
    _, learn, state = program(model, adv_estimator="gae", reward_method="identity")
    broken = rollout_batch(REWARD.copy() * np.where(np.arange(G * N) == 3, np.nan, 1.0).astype(np.float32))
    new, metrics = learn(state, broken, HYPER)
    assert float(metrics["actor/skipped_steps"]) == float(metrics["critic/skipped_steps"]) == 1.0
    assert int(new.skipped_steps) == int(new.critic_skipped_steps) == 1
    assert trees_equal(new.actor, state.actor) and trees_equal(new.actor_opt, state.actor_opt)
    assert trees_equal(new.critic, state.critic) and trees_equal(new.critic_opt, state.critic_opt)
    newer, metrics = learn(new, rollout_batch(), HYPER)
    assert float(metrics["actor/skipped_steps"]) == float(metrics["critic/skipped_steps"]) == 1.0
    assert not trees_equal(newer.actor, new.actor) and not trees_equal(newer.critic, new.critic)


def test_critic_warmup_trains_only_the_critic_for_its_steps(model):
    _, learn, state = program(model, adv_estimator="gae", critic_warmup=1)
    traj = rollout_batch()
    first, _ = learn(state, traj, HYPER)
    assert trees_equal(first.actor, state.actor) and trees_equal(first.actor_opt, state.actor_opt)
    assert not trees_equal(first.critic, state.critic)
    second, _ = learn(first, traj, HYPER)
    assert not trees_equal(second.actor, first.actor)


def test_sampler_logprobs_replace_the_recomputed_old_logprobs(model):
    traj = rollout_batch()
    prepare, learn, state = program(model, use_sampler_logprobs=True)
    batch, _ = prepare(state, traj, HYPER)
    np.testing.assert_array_equal(batch.old_logp, traj.sampler_logprobs)
    # the policy's own log-probs (≈ −5.5 for 256 tokens) are not the sampler's, so the ratio moves
    _, metrics = learn(state, traj, HYPER)
    assert abs(float(metrics["actor/ppo_kl"])) > 0.1


def test_ppo_epochs_pass_over_every_mini_batch_each_epoch(model):
    """2 epochs × 2 mini-batches = 4 optimiser steps (veRL: no shuffling, the same order each epoch)."""
    _, learn, state = program(model, ppo_epochs=2, ppo_mini_batch_size=2 * N)
    new, _ = learn(state, rollout_batch(), HYPER)
    assert adam_steps(new.actor_opt) == 4


# ---- each step alone ---------------------------------------------------------------------------


def settings_for(**overrides) -> TrainSettings:
    return TrainSettings(**{
        "adv_estimator": "grpo", "reward_method": "mean_std", "kept_groups": G, "ppo_mini_batch_size": G * N,
        "micro_batch_size": N, "logprob_chunk": 8, **overrides,
    })


def program_for(settings: TrainSettings, model: ModelState, layout) -> UpdateProgram:
    """The update's static context, as ``learn`` builds it, for these settings on ``PLAN``."""
    return UpdateProgram(settings, PLAN, update_forward(settings, model.graphdef, PLAN, layout))


def whole_rows(kept: Trajectories, mask) -> Rows:
    """The kept rows as a full layout computes them: every row from position 0."""
    return Rows(kept.tokens, kept.length, jnp.zeros(kept.length.shape, jnp.int32), mask > 0)


def kept_batch(**overrides):
    """(settings, kept trajectories, score, valid, mask) of the whole rollout batch (ratio 1)."""
    settings, traj = settings_for(**overrides), rollout_batch()
    score = rewards.trajectory_score(traj.env_reward, traj.format_penalty_sum, traj.group_id, traj.tag_id, "state", "mean_std")
    kept, score, valid, _ = filter_groups(settings, N, traj, score, jnp.float32(1.0))
    return settings, kept, score, valid, (kept.loss_mask & valid[:, None]).astype(jnp.float32)


def test_filter_groups_keeps_the_most_varied_groups_then_pads_with_invalid_rows():
    """Ratio 0.5 keeps 2 of 4 groups (0 and 3, the largest in-group stds), in group order; a
    program sized for 3 kept groups fills the third slot with group 0, marked invalid."""
    traj = rollout_batch()
    score = jnp.arange(G * N, dtype=jnp.float32)  # row ids, to see which rows were gathered
    kept, kept_score, valid, metrics = filter_groups(settings_for(kept_groups=3), N, traj, score, jnp.float32(0.5))
    rows = np.r_[0:N, 3 * N:4 * N, 0:N]
    np.testing.assert_array_equal(kept_score, rows)
    np.testing.assert_array_equal(kept.group_id, rows // N)
    np.testing.assert_array_equal(kept.tokens, np.asarray(traj.tokens)[rows])
    np.testing.assert_array_equal(valid, np.r_[np.ones(2 * N, bool), np.zeros(N, bool)])
    assert int(metrics["rollout/filter_kept_groups"]) == 2


def test_filter_ranks_by_the_score_when_asked_seeing_groups_that_differ_only_in_format():
    """Every env reward 0 (no group varies), one valid answer (penalty avoided) in group 2 alone:
    RAGEN's ranking by env reward ties and keeps groups 0 and 1 (the lowest indices); ranked by the
    identity score (env reward + penalties) group 2 is kept, beside group 0. The collapse metrics stay
    the env reward's either way."""
    traj = rollout_batch(env_reward=np.zeros(G * N, np.float32)).replace(
        format_penalty_sum=jnp.full((G * N,), -0.1).at[2 * N + 3].set(0.0))
    score = rewards.trajectory_score(traj.env_reward, traj.format_penalty_sum, traj.group_id, traj.tag_id,
                                     "state", "identity")
    for rank_by, groups in (("env_reward", [0, 1]), ("score", [0, 2])):  # ties: lowest index
        kept, _, valid, metrics = filter_groups(settings_for(kept_groups=2, filter_rank_by=rank_by), N, traj, score,
                                                jnp.float32(0.5))
        assert sorted(set(np.asarray(kept.group_id).tolist())) == groups, rank_by
        assert bool(valid.all()) and float(metrics["rollout/in_group_std"]) == 0.0


def test_forward_passes_are_the_models_on_policy_tokens_only(model):
    """Old log-probs are the policy's (micro-batch by micro-batch, rows back in order) on the loss
    mask and 0 elsewhere, or the sampler's; ref log-probs are the reference's, zeros without a KL
    term; values are the critic's on the mask, zeros without a critic."""
    settings, kept, _, _, mask = kept_batch(adv_estimator="gae", use_kl_loss=True, micro_batch_size=4)
    state = init_train_state(settings, model, jax.random.PRNGKey(0))
    full = full_layout(L)
    program = program_for(settings, model, full)
    old = old_logprobs(program, state, kept, mask)
    # every row from position 0, in one call
    ctx, rows = ForwardPass(model.graphdef, full, policy_tokens_per_row(PLAN), chunk=8), whole_rows(kept, mask)
    whole, _ = token_logprobs(ctx, state.actor, rows)
    # micro-batches of 4 rows against one call on 32: the same math, matmuls of another shape
    np.testing.assert_allclose(old, whole, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(old).min(where=mask > 0, initial=np.inf)) > 0 and not np.any(np.asarray(old)[mask == 0])
    # the reference starts as a copy of the policy: the same program on equal weights
    np.testing.assert_array_equal(ref_logprobs(program, state, kept, mask), old)
    moved = state.replace(ref=jax.tree.map(lambda x: x * 1.5, state.ref))
    assert not np.allclose(ref_logprobs(program, moved, kept, mask), old)

    values = old_values(program, state, kept, mask)
    assert state.critic is not None  # GAE has one
    critic = token_values(ctx, state.critic, rows)
    np.testing.assert_allclose(values, critic * mask, rtol=1e-5, atol=1e-6)
    assert np.count_nonzero(values) == np.count_nonzero(mask)

    sampler = settings_for(use_sampler_logprobs=True)
    sampling = program_for(sampler, model, full)
    np.testing.assert_array_equal(old_logprobs(sampling, state, kept, mask), kept.sampler_logprobs)
    assert not np.any(ref_logprobs(sampling, state, kept, mask))
    assert not np.any(old_values(sampling, state, kept, mask))


def shared_prompt_batch(seed=0, prompt_of_group=range(G)) -> Trajectories:
    """``rollout_batch`` as a rollout makes it: the rows of a group read the same first prompt,
    group g group ``prompt_of_group[g]``'s (by default each its own)."""
    traj = rollout_batch(seed=seed)
    prompt = np.repeat(np.asarray(traj.tokens)[::N, :PROMPT][list(prompt_of_group)], N, axis=0)
    return traj.replace(tokens=traj.tokens.at[:, :PROMPT].set(prompt))


def test_update_layout_holds_the_batch_in_few_widths():
    """The prefix holds every first prompt up to its last token, the width every row after it."""
    traj = shared_prompt_batch()
    split = np.asarray(first_prompt_split(traj))
    assert set(split) == {PROMPT - 1}
    layout = update_layout(traj, PLAN, micro_batch_size=N)
    assert layout.prefix == 24 and layout.width >= int((np.asarray(traj.length) - split).max())
    assert layout.width == 16  # rows hold at most 8 response + 2 closing tokens after the split
    assert layout.prompts == 1 and not layout.across_groups  # a micro-batch of 8 rows is one group
    assert update_layout(traj, PLAN, micro_batch_size=1) == (0, 32, 0, False)  # nothing shared: every row from 0


def test_a_micro_batch_computes_as_many_first_prompts_as_it_can_hold():
    """One per group a micro-batch touches, or the batch's distinct prompts where those are fewer
    (then found in the program: ``across_groups``)."""
    four, two = shared_prompt_batch(), shared_prompt_batch(prompt_of_group=(0, 0, 2, 0))
    assert [update_layout(four, PLAN, m).prompts for m in (4, 8, 16, 32)] == [1, 1, 2, 4]
    assert [update_layout(two, PLAN, m).prompts for m in (4, 8, 16, 32)] == [1, 1, 2, 2]
    assert [update_layout(two, PLAN, m).across_groups for m in (4, 8, 16, 32)] == [False, False, False, True]
    # groups of 4 in micro-batches of 8 rows (two groups each) or of 6 (one group and part of another)
    plan = dataclasses.replace(PLAN, group_size=4)
    assert [update_layout(four, plan, m).prompts for m in (6, 8)] == [3, 2]
    # a row that never played has no first prompt: an empty one, distinct from the rest
    idle = two.replace(turn_start=two.turn_start.at[5].set(0))
    assert update_layout(idle, PLAN, 32).prompts == 3


def test_across_processes_each_group_keeps_its_own_first_prompt(monkeypatch):
    """Searching the rows for shared prompts would put collectives into the row-sharded update."""
    two = shared_prompt_batch(prompt_of_group=(0, 0, 2, 0))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(forward.distributed, "to_host", lambda tree: tree)  # the batch is this process's whole
    layout = update_layout(two, PLAN, 32)
    assert (layout.prompts, layout.across_groups) == (4, False)


def test_size_buckets_pad_at_most_half_below_the_fine_width_and_an_eighth_above():
    """The update compiles one program per width: few coarse sizes where rows are short, eight per
    octave where the padding of long multi-turn rows would cost more than a compile."""
    sizes = sorted({size_bucket(n) for n in range(1, 4 * FINE_WIDTH + 1)})
    assert sizes[:9] == [16, 24, 32, 48, 64, 96, 128, 192, 256]
    assert sizes[9:13] == [288, 320, 352, 384] and sizes[-2:] == [960, 1024]
    for n in range(1, 4 * FINE_WIDTH + 1):
        size = size_bucket(n)
        assert size >= n and size_bucket(size) == size
        assert size - n < (size / 2 if size <= FINE_WIDTH else size / 8) or size == 16
    assert size_bucket(343) == 352 and size_bucket(343, limit=340) == 340


def test_a_layout_is_no_wider_than_the_plan_can_need():
    """One turn: nothing follows an answer, so a row holds at most its first prompt's last token and
    ``response_length`` answer tokens after the split. A batch whose longest answer fills the budget
    is computed exactly that wide (9 positions here, not the bucket's 16), never wider; a plan of
    several turns keeps the buckets."""
    traj = shared_prompt_batch()
    start = np.asarray(traj.turn_start)[:, 0]
    answers = np.arange(traj.length.shape[0]) % PLAN.response_length + 1  # 1..8 tokens, 8 = the budget
    full = traj.replace(length=jnp.asarray(start + answers, jnp.int32))
    assert update_layout(full, PLAN, N) == (24, 1 + PLAN.response_length, 1, False)
    assert update_layout(full, dataclasses.replace(PLAN, max_turn=2), N) == (24, 16, 1, False)
    # A context just wide enough for the first prompt and one full answer (as ``fit_to_tables``
    # leaves it): no row's split can pass max_len − response_length − 1, so the prefix is that too.
    tight = dataclasses.replace(PLAN, max_len=PROMPT + PLAN.response_length)
    assert update_layout(full, tight, N) == (PROMPT - 1, 1 + PLAN.response_length, 1, False)
    assert update_layout(full, PLAN, micro_batch_size=1).width == 32  # from position 0: the context's buckets


def test_update_layout_of_stacked_batches_holds_every_setting():
    """A sweep's rollout batch has a leading settings axis: each setting's rows keep their own
    splits, and one layout holds every row of every setting (the layout of all rows side by side)."""
    a = shared_prompt_batch()
    b = a.replace(turn_start=a.turn_start + 10)  # longer first prompts: splits at 29, not 19
    stacked = jax.tree.map(lambda x, y: jnp.stack([x, y]), a, b)
    np.testing.assert_array_equal(first_prompt_split(stacked), np.stack([first_prompt_split(a), first_prompt_split(b)]))
    rows = jax.tree.map(lambda x: x.reshape((-1,) + x.shape[2:]), stacked)
    for micro in (1, N):
        one, other = update_layout(a, PLAN, micro), update_layout(b, PLAN, micro)
        expected = (max(one.prefix, other.prefix), max(one.width, other.width), one.prompts, False)
        assert update_layout(stacked, PLAN, micro) == update_layout(rows, PLAN, micro) == expected
    assert update_layout(a, PLAN, N) == (24, 16, 1, False) and update_layout(stacked, PLAN, N) == (32, 16, 1, False)
    # the most distinct prompts of any one setting, not of all settings' rows together
    c = shared_prompt_batch(seed=1, prompt_of_group=(0, 0, 0, 1))
    assert update_layout(jax.tree.map(lambda x, y: jnp.stack([x, y]), c, c), PLAN, G * N).prompts == 2


def assert_same_adam_step(params, expected, lr: float) -> None:
    """Weights after one Adam step from the same start, their gradients equal up to float32
    rounding (see the caller)."""
    diff = np.concatenate([np.abs(np.asarray(a) - np.asarray(b)).ravel()
                           for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(expected))])
    assert diff.max() <= 2 * lr * (1 + 1e-3)
    assert np.mean(diff > 0.01 * lr) <= 3e-4, f"{np.sum(diff > 0.01 * lr)} of {diff.size} weights moved differently"


@pytest.mark.parametrize("estimator", ["gae", "grpo"])
def test_a_shared_first_prompt_gives_the_full_rows_results(model, estimator):
    """Computing each distinct first prompt of a micro-batch once (and only the rows' used width)
    gives the same log-probs, values and update as every position of every row: the same attention,
    in matmuls of other shapes (float32 rounding). Groups 0, 1 and 3 read the same prompt and group
    2 another. Micro-batches of 4 rows within groups of 8 (one prompt each); of 16, two groups (2
    prompts, group g's 8 rows reading the g-th); and one of 32: 2 prompts for the 4 groups, which
    rows read which found in the program."""
    traj = shared_prompt_batch(prompt_of_group=(0, 0, 2, 0))
    for micro in (4, 16, 32):
        settings = settings_for(adv_estimator=estimator, micro_batch_size=micro, ppo_mini_batch_size=max(16, micro))
        layout = update_layout(traj, PLAN, micro)
        assert (layout.prompts, layout.across_groups) == {4: (1, False), 16: (2, False), 32: (2, True)}[micro]
        state = init_train_state(settings, model, jax.random.PRNGKey(0))
        learn = jax.jit(make_train_step(settings, model.graphdef, PLAN).learn, static_argnums=3)
        full_state, full_metrics = learn(state, traj, HYPER, full_layout(L))
        new_state, metrics = learn(state, traj, HYPER, layout)
        for key in ("rollout/old_log_prob", "actor/pg_loss", "actor/entropy_loss", "actor/grad_norm"):
            np.testing.assert_allclose(metrics[key], full_metrics[key], rtol=2e-5, atol=1e-6, err_msg=key)
        # Adam's first step moves each weight by lr·g/(|g| + eps): ±lr wherever |g| ≫ eps, whatever
        # rounding does to g, and anything up to ±lr where |g| is as small as the rounding itself. So
        # no weight may differ by more than a sign flip (2·lr), and all but a few in 10⁴ agree to 1 %
        # of lr; a wrong gradient flips the step of many weights.
        assert_same_adam_step(new_state.actor, full_state.actor, lr=float(HYPER.actor_lr))
        if estimator == "gae":
            np.testing.assert_allclose(metrics["critic/values/mean"], full_metrics["critic/values/mean"], rtol=2e-5, atol=1e-6)
            np.testing.assert_allclose(metrics["critic/grad_norm"], full_metrics["critic/grad_norm"], rtol=2e-5)
    # only ``layout.prompts`` are computed: a micro-batch of three (rows 1 and 2 of group 0 changed)
    # gets other log-probs
    mixed = traj.replace(tokens=traj.tokens.at[1, 0].add(1).at[2, 0].add(2))
    _, wrong = learn(state, mixed, HYPER, layout)
    _, right = learn(state, mixed, HYPER, full_layout(L))
    assert not np.isclose(wrong["rollout/old_log_prob"], right["rollout/old_log_prob"], rtol=1e-6, atol=0)


def test_shared_prompts_finds_each_rows_prompt_among_the_distinct_ones():
    """Rows 0, 2 and 3 read one prompt (row 3's tokens past its split differ: not part of it), row 1
    another, row 4 a shorter one with the same first tokens: three prompts, leaders in row order,
    and a fourth slot (more than there are) filled with row 0."""
    prompts = jnp.asarray([[5, 6, 7, 0], [5, 6, 8, 0], [5, 6, 7, 0], [5, 6, 7, 9], [5, 6, 7, 0]])
    split = jnp.asarray([3, 3, 3, 3, 2])
    leaders, owner = shared_prompts(prompts, split, 4)
    assert leaders.tolist() == [0, 1, 4, 0] and owner.tolist() == [0, 1, 0, 0, 2]


def test_token_level_rewards_put_scores_or_turn_rewards_on_tokens_less_the_kl():
    settings, kept, score, _, mask = kept_batch()
    last = np.asarray(kept.turn_end)[:, 0] - 1  # each row's one response ends its policy tokens
    rows = np.arange(G * N)
    old, ref = -jnp.ones_like(mask), -2 * jnp.ones_like(mask)  # KL = old − ref = 1 per policy token
    tokens, same_score, metrics = token_level_rewards(settings, kept, score, mask, old, ref, HYPER)
    np.testing.assert_array_equal(np.asarray(tokens)[rows, last], score)
    assert np.count_nonzero(tokens) == np.count_nonzero(score) and same_score is score and not metrics

    turns, turn_score, _ = token_level_rewards(settings_for(use_turn_scores=True), kept, score, mask, old, ref, HYPER)
    np.testing.assert_array_equal(np.asarray(turns)[rows, last], kept.env_reward)  # raw: no normalisation, no penalty
    np.testing.assert_array_equal(turn_score, kept.env_reward)

    beta = 0.25
    kl_rewards, _, metrics = token_level_rewards(
        settings_for(kl_in_reward=True), kept, score, mask, old, ref, HYPER.replace(kl_in_reward_coef=jnp.float32(beta))
    )
    np.testing.assert_allclose(kl_rewards, tokens - beta * mask, rtol=1e-6)
    assert float(metrics["actor/reward_kl_penalty"]) == pytest.approx(1.0)


def test_estimate_advantages_runs_the_chosen_estimator():
    settings, kept, score, valid, mask = kept_batch()
    token_rewards = rewards.scores_to_token_rewards(score, mask)
    values = 0.1 * mask
    got = estimate_advantages(settings, kept, token_rewards, values, mask, valid, HYPER)
    want = advantages.grpo_outcome(score, kept.group_id, mask, True, valid=valid)
    np.testing.assert_array_equal(got[0], want[0])
    gae = estimate_advantages(settings_for(adv_estimator="gae"), kept, token_rewards, values, mask, valid, HYPER)
    np.testing.assert_array_equal(gae[1], advantages.gae(token_rewards, values, mask, HYPER.gamma, HYPER.lam)[1])
    assert not np.allclose(gae[0], got[0])
    with pytest.raises(ValueError, match="Unknown advantage estimator 'ppo'"):
        estimate_advantages(settings_for(adv_estimator="ppo"), kept, token_rewards, values, mask, valid, HYPER)


def test_batch_metrics_see_only_real_rows():
    settings, kept, score, _, mask = kept_batch()
    valid = jnp.arange(G * N) < N  # only group 0 is real
    mask = mask * valid[:, None]
    zeros = jnp.zeros_like(mask)
    batch = UpdateBatch(kept.tokens, kept.length, first_prompt_split(kept), mask, -mask, zeros, zeros, 2 * mask, 3 * mask)
    metrics = batch_metrics(settings, batch, score, rewards.scores_to_token_rewards(score, mask), valid)
    assert float(metrics["critic/score/mean"]) == pytest.approx(float(score[:N].mean()), abs=1e-6)
    assert (float(metrics["critic/advantages/mean"]), float(metrics["critic/returns/mean"])) == (2.0, 3.0)
    assert float(metrics["rollout/old_log_prob"]) == -1.0
    assert "rollout/ref_log_prob" not in metrics and "critic/values/mean" not in metrics  # GRPO, no KL
    with_both = batch_metrics(settings_for(adv_estimator="gae", use_kl_loss=True), batch, score, zeros, valid)
    assert {"rollout/ref_log_prob", "critic/values/mean", "critic/vf_explained_var"} <= set(with_both)


def test_losses_at_the_old_policy_and_values(model):
    """At the weights that computed the old log-probs the ratio is 1 (no KL, no clipping), so the
    actor's loss is minus the mean advantage; the critic's loss is ½(V − R)² where V = V_old."""
    settings, kept, _, _, mask = kept_batch(adv_estimator="gae")
    state = init_train_state(settings, model, jax.random.PRNGKey(0))
    program = program_for(settings, model, full_layout(L))
    old = old_logprobs(program, state, kept, mask)
    values = old_values(program, state, kept, mask)
    adv = jnp.where(mask > 0, jnp.arange(G * N, dtype=jnp.float32)[:, None] / (G * N) - 0.5, 0.0)
    b = UpdateBatch(kept.tokens, kept.length, first_prompt_split(kept), mask, old, jnp.zeros_like(old), values, adv, values + 0.5 * mask)
    horizon = jnp.float32(L - 1)
    loss, metrics = actor_loss_fn(program, None, horizon, state.actor, b, HYPER)
    per_row = (adv * mask).sum(axis=1) / mask.sum(axis=1)
    assert float(loss) == pytest.approx(-float(per_row.mean()), abs=1e-5)
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(0.0, abs=1e-5) and float(metrics["actor/pg_clipfrac"]) == 0.0
    assert state.critic is not None  # GAE has one
    loss, _ = critic_loss_fn(program, None, state.critic, b, HYPER)
    assert float(loss) == pytest.approx(0.5 * 0.5**2, rel=1e-4)


@flax.struct.dataclass
class Toy:
    mask: jax.Array  # [rows]
    x: jax.Array  # [rows]


def toy_loss(w, b: Toy, hyper):
    """½ Σ mask·(w − x)² per row, averaged over the rows: gradient mean(mask·(w − x))."""
    loss = 0.5 * jnp.mean(b.mask * (w - b.x) ** 2)
    return loss, {"toy/loss": loss}


def test_accumulate_gradients_averages_the_live_micro_batches():
    micro = Toy(mask=jnp.asarray([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0]]), x=jnp.asarray([[1.0, 3.0], [9.0, 9.0], [4.0, 0.0]]))
    grads, metrics, live = accumulate_gradients(toy_loss, jnp.float32(0.0), micro, HYPER)
    # live micro-batches 0 and 2: gradients −2 and −2 (mean over 2 rows of −mask·x), the dead one left out
    assert float(grads) == pytest.approx(-2.0) and bool(live)
    assert float(metrics["toy/loss"]) == pytest.approx((2.5 + 4.0) / 2)
    dead = jax.tree.map(lambda x: x[1:2], micro)
    grads, _, live = accumulate_gradients(toy_loss, jnp.float32(0.0), dead, HYPER)
    assert float(grads) == 0.0 and not bool(live)


def test_ppo_update_steps_once_per_mini_batch_per_epoch():
    """8 rows, mini-batches of 4 in micro-batches of 2, 2 epochs: 4 plain gradient steps (tx is the
    identity), in row order; a mini-batch of padding rows only takes none."""
    settings = settings_for(ppo_mini_batch_size=4, micro_batch_size=2, ppo_epochs=2)
    x = jnp.asarray([2.0, 2.0, 2.0, 2.0, 4.0, 4.0, 4.0, 4.0])
    lr = 0.5
    (w, _, skipped), metrics = ppo_update(settings, toy_loss, optax.identity(), jnp.float32(0.0), optax.EmptyState(),
                                          Toy(jnp.ones(8), x), lr, HYPER, "toy")
    expected = 0.0
    for _ in range(2):
        for target in (2.0, 4.0):
            expected -= lr * (expected - target)  # gradient of ½(w − x)²: w − x
    assert float(w) == pytest.approx(expected) and int(skipped) == 0
    assert set(metrics) == {"toy/loss", "toy/grad_norm"}
    half = Toy(jnp.asarray([1.0] * 4 + [0.0] * 4), x)
    (w, _, _), _ = ppo_update(settings, toy_loss, optax.identity(), jnp.float32(0.0), optax.EmptyState(), half, lr, HYPER, "toy")
    assert float(w) == pytest.approx(1.5)  # 0 → 1 → 1.5 toward 2; the padding mini-batch moves nothing


def test_make_train_step_rejects_an_update_batch_that_does_not_split():
    with pytest.raises(ValueError, match=r"32 trajectories\) must split into mini-batches of actor.ppo_mini_batch_size \(12\)"):
        make_train_step(settings_for(ppo_mini_batch_size=12), None, PLAN)
