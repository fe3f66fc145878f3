"""The StarPO / StarPO-S training iteration as one compiled program (ragen-reference.md §3.1).

The file reads as the iteration runs: what it carries (``TrainState``), the iteration itself
(``make_train_step``, ``jit_iteration``), its steps in the order they run, one pure function each
(each takes the static ``TrainSettings``, and the model's graphdef or the rollout plan where it
needs them, then arrays), then the helpers they share:

    step = learn ∘ collect
    1. collect                 rollout: fresh levels, the policy plays them → Trajectories
    learn: prepare_update (2–5), then the two updates (6, 7)
    2. filter_groups           StarPO-S keeps the groups whose rewards vary most
    3. old_logprobs, ref_logprobs, old_values: forward passes over the kept rows
    4. token_level_rewards     scores (or turn rewards) on tokens, − β·KL
    5. estimate_advantages     GAE, bi-level GAE or GRPO
    6. update_critic           ``ppo_update`` of ``critic_loss_fn``
    7. update_actor            ``ppo_update`` of ``actor_loss_fn`` (held for ``critic_warmup`` steps)

``ppo_update`` (6, 7): ``ppo_epochs`` passes over the mini-batches; each takes the mean gradient
of its micro-batches' losses (``accumulate_gradients``), then one optimiser step (``apply_update``).

``make_train_step(settings, graphdef, plan)`` binds the static part and returns
``TrainStep(collect, learn, step)``, pure functions to jit; ``step(state, tables, hyper, key) ->
(state, metrics)`` is ``learn ∘ collect``. ``Hyperparams`` are arrays, so ``jax.vmap`` of ``step``
over a stacked ``Hyperparams`` (and a stacked ``TrainState``) trains several configurations in one
program.
``jit_iteration`` is how the drivers run it: ``collect`` and ``learn`` jitted apart, and between
them, on the host, the smallest ``update_layout`` that holds the batch (vmapped over the settings
for a sweep). ``experiments.run`` may dispatch ``collect`` a step ahead, on a copy of the policy's
weights and on devices of its own, so that it runs during the update before
(``trainer.staleness=1``: ``starpo_jax.runtime.batches``).

Choices (each a departure from, or a decision about, the original; see docs/design.md):

- Trajectory scores are normalised over the whole rollout batch, then filtered (RAGEN's order).
- The batch is compacted to the kept groups before the update (static count
  ``TrainSettings.kept_groups``); a traced ``filter_ratio`` below that count (or ``top_p_var``,
  whose count is data dependent) leaves padding rows, which no statistic sees: they are out of
  every mask and every group statistic, a micro-batch of them adds no gradient and a mini-batch
  of them takes no optimiser step. So a sweep over ratios shares one program and each setting
  trains as if run alone.
- Log-probs are aligned with the token they score and computed from hidden states in chunks of
  positions under ``jax.checkpoint``, so the [B, L, V] logits never exist at once.
- Optimiser: AdamW with a traced learning rate (``scale_by_adam`` → decoupled weight decay →
  ``× -lr``), global-norm clipping first; a step whose gradient norm is not finite is skipped
  (parameters and moments unchanged) and counted in ``actor/skipped_steps`` /
  ``critic/skipped_steps``.
- The critic is its own copy of the backbone with a linear value head (trained; with LoRA the
  original froze it by accident, quirk 11).
- LoRA (``lora_rank > 0``, ``starpo_jax.models.lora``): the actor and the critic each train a set of
  adapters over one shared frozen base (``TrainState.base``); the reference is the base itself.
  Weights are merged before sampling and inside each loss, so decoding pays nothing for adapters.
- KL: ``use_kl_loss`` adds ``kl_loss_coef · KL`` to the actor loss; ``kl_in_reward`` subtracts
  ``kl_in_reward_coef · KL`` from the token rewards. Both really act (quirk 10), with every
  estimator: GRPO's outcome is the summed token reward, KL included, as in veRL.
- The critic's value loss is always ``seq-mean-token-mean``: RAGEN's critic takes the token mean
  of each micro-batch of one sequence, whatever ``loss_agg_mode`` the actor uses.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple, Protocol

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from starpo_jax.algo import advantages as adv
from starpo_jax.algo import filtering, losses, rewards
from starpo_jax.algo.masked import masked_mean
from starpo_jax.diagnostics.metrics import rollout_metrics
from starpo_jax.forward import (
    Critic,
    ForwardPass,
    Rows,
    UpdateLayout,
    first_prompt_split,
    full_layout,
    token_logprobs,
    token_values,
    update_forward,
    update_layout,
)
from starpo_jax.models import lora
from starpo_jax.models.decoder import ModelState
from starpo_jax.rollout.multi_turn import RolloutPlan, Trajectories, initial_states_from_key, make_rollout
from starpo_jax.rollout.sampling import sampling_policy
from starpo_jax.runtime.settings import (  # declared beside their config keys
    Hyperparams,
    TrainSettings,
    check_batch_split,
)

# ---- what the iteration carries ------------------------------------------------------------------


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    actor: nnx.State | lora.Adapters  # what the actor trains: its weights, or its LoRA adapters
    actor_opt: Any
    critic: Critic | None
    critic_opt: Any
    ref: nnx.State | None  # a frozen copy of the initial actor (full fine-tuning with a KL term)
    skipped_steps: jax.Array  # actor optimiser steps skipped for a non-finite gradient, so far
    critic_skipped_steps: jax.Array
    base: nnx.State | None = None  # with LoRA: the frozen initial weights under both sets of adapters


def init_train_state(settings: TrainSettings, model: ModelState, key) -> TrainState:
    """Actor, critic (same checkpoint + a fresh value head) and reference from one model.

    Full fine-tuning copies the weights for the critic and the reference; LoRA keeps one frozen
    base and gives the actor and the critic fresh adapters (the merged model starts as the base)."""
    config = model.merge().config
    head_key, actor_key, critic_key = jax.random.split(key, 3)
    actor: nnx.State | lora.Adapters
    critic_backbone: nnx.State | lora.Adapters | None
    if settings.lora_rank:
        base, ref = model.params, None
        actor = lora.init_adapters(config, settings.lora_rank, actor_key)
        critic_backbone = lora.init_adapters(config, settings.lora_rank, critic_key)
    else:
        base, actor = None, model.params
        ref = jax.tree.map(jnp.copy, actor) if settings.uses_ref else None
        critic_backbone = jax.tree.map(jnp.copy, actor) if settings.uses_critic else None
    actor_tx = optimizer(settings, "actor")
    critic = critic_opt = None
    if settings.uses_critic:
        assert critic_backbone is not None  # made above whenever the settings use a critic
        critic = Critic(
            backbone=critic_backbone,
            head_w=0.02 * jax.random.normal(head_key, (config.hidden_size,), jnp.float32),
            head_b=jnp.zeros((), jnp.float32),
        )
        critic_opt = optimizer(settings, "critic").init(critic)
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        actor=actor,
        actor_opt=actor_tx.init(actor),
        critic=critic,
        critic_opt=critic_opt,
        ref=ref,
        skipped_steps=jnp.zeros((), jnp.int32),
        critic_skipped_steps=jnp.zeros((), jnp.int32),
        base=base,
    )


def replicate(state: TrainState, n: int) -> tuple[TrainState, TrainState]:
    """``n`` copies of a train state for ``jax.vmap`` over hyperparameters, and the vmap axes to
    use for it (in and out). What trains is stacked on a new leading axis; a LoRA base is frozen,
    so all copies share one (axis None) instead of holding n."""
    trained = state.replace(base=None)
    stacked = jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), trained).replace(base=state.base)
    return stacked, jax.tree.map(lambda _: 0, trained)


# ---- the iteration -------------------------------------------------------------------------------
#
# ``make_train_step`` binds the static part of each step (the settings, the model's graphdef, the
# rollout plan); the drivers run it through ``jit_iteration``.


class TrainStep(NamedTuple):
    """The iteration bound to its settings, model and plan: pure functions to jit.

    ``step`` is the whole iteration; a driver that times the phases apart jits ``collect`` and
    ``learn`` (donating the state) instead."""

    collect: Callable  # (state, tables, key) -> Trajectories
    learn: Callable  # (state, traj, hyper, layout=None) -> (state, metrics); layout static
    step: Callable  # (state, tables, hyper, key) -> (state, metrics): learn ∘ collect, full layout


def make_train_step(settings: TrainSettings, graphdef, plan: RolloutPlan, responder=None) -> TrainStep:
    """The iteration for these settings, model structure and rollout plan (``responder``: what
    answers instead of the policy, for tests and benchmarks; see ``make_rollout``)."""
    check_batch_split(settings, plan.group_size)
    collect_fn = functools.partial(collect, settings, graphdef, plan, make_rollout(plan, responder))
    learn_fn = functools.partial(learn, settings, graphdef, plan)

    def step(state: TrainState, tables, hyper: Hyperparams, key):
        return learn_fn(state, collect_fn(state, tables, key), hyper)

    return TrainStep(collect_fn, learn_fn, step)


class JittedIteration(NamedTuple):
    """The iteration as the drivers run it (``experiments.run``, ``experiments.sweep``): ``collect``
    and ``learn`` jitted apart, and between them, on the host, the smallest ``update_layout`` that
    holds the rollout batch, so the update computes only what the batch holds (static: a few
    compiled widths per run). Calling it runs the three in turn."""

    collect: Callable  # jitted (state, tables, key) -> Trajectories
    learn: Callable  # jitted (state, traj, hyper, layout) -> (state, metrics); state donated, layout static
    layout: Callable  # (traj) -> UpdateLayout, on the host

    def __call__(self, state, tables, hyper, key):
        traj = self.collect(state, tables, key)
        return self.learn(state, traj, hyper, self.layout(traj))


def jit_iteration(step: TrainStep, settings: TrainSettings, plan: RolloutPlan, axes=None) -> JittedIteration:
    """``step``'s collect and learn jitted for a driver. With ``axes`` (``replicate``'s), both are
    vmapped over stacked states and hyperparameters, as ``jax.vmap(step.step, in_axes=(axes, None,
    0, None))``: every setting's rollout uses the same key, and one layout holds every setting's rows."""
    collect, learn = step.collect, step.learn
    if axes is not None:
        collect = jax.vmap(step.collect, in_axes=(axes, None, None))

        def learn(state, traj, hyper, layout):
            one = functools.partial(step.learn, layout=layout)
            return jax.vmap(one, in_axes=(axes, 0, 0), out_axes=(axes, 0))(state, traj, hyper)

    return JittedIteration(
        jax.jit(collect), jax.jit(learn, donate_argnums=0, static_argnums=3),
        lambda traj: update_layout(traj, plan, settings.micro_batch_size),
    )


# ---- its steps, in the order they run ------------------------------------------------------------
#
# Each is a pure function of static values and arrays: the settings, or the whole ``UpdateProgram``
# (settings, plan, and the forward pass: graphdef and layout) where a forward pass runs. The numbers
# are the module docstring's.


def collect(settings: TrainSettings, graphdef, plan: RolloutPlan, rollout, state: TrainState, tables, key) -> Trajectories:
    """1. Rollout: fresh levels, then the policy (weights in compute dtype) plays them."""
    level_key, rollout_key = jax.random.split(jax.random.fold_in(key, state.step))
    policy = sampling_policy(graphdef, policy_weights(settings, state))
    return rollout(policy, tables, initial_states_from_key(plan, level_key), rollout_key, settings.rollout_temperature)


def learn(settings: TrainSettings, graphdef, plan: RolloutPlan, state: TrainState, traj: Trajectories, hyper: Hyperparams,
          layout: UpdateLayout | None = None):
    """Steps 2–7 on a rollout batch: (new state, metrics). ``layout`` (static): which positions the
    forward passes compute (``update_layout``; default every position of every row)."""
    program = UpdateProgram(settings, plan, update_forward(settings, graphdef, plan, layout or full_layout(plan.max_len)))
    # Both read the whole rollout batch, rows the filter drops included. The horizon is
    # seq-mean-token-sum-norm's divisor: RAGEN's padded batch width, the longest sequence less one.
    metrics = rollout_metrics(traj, plan, "train")
    horizon = (traj.length.max() - 1).astype(jnp.float32)
    batch, prepared_metrics = prepare_update(program, state, traj, hyper)
    critic, critic_opt, critic_skipped, critic_metrics = update_critic(program, state, batch, hyper)
    actor, actor_opt, skipped, actor_metrics = update_actor(program, state, batch, hyper, horizon)
    new_state = state.replace(
        step=state.step + 1,
        actor=actor,
        actor_opt=actor_opt,
        critic=critic,
        critic_opt=critic_opt,
        skipped_steps=state.skipped_steps + skipped,
        critic_skipped_steps=state.critic_skipped_steps + critic_skipped,
    )
    return new_state, metrics | prepared_metrics | critic_metrics | actor_metrics


def prepare_update(program: UpdateProgram, state: TrainState, traj: Trajectories, hyper: Hyperparams):
    """Steps 2–5: filter, then everything the update needs: (UpdateBatch, metrics)."""
    settings = program.settings
    # RAGEN normalises the scores over the whole rollout batch (ctx_manager), then filters
    score = rewards.trajectory_score(
        traj.env_reward, traj.format_penalty_sum, traj.group_id, traj.tag_id,
        settings.reward_grouping, settings.reward_method,
    )
    kept, score, valid, metrics = filter_groups(settings, program.plan.group_size, traj, score, hyper.filter_ratio)
    mask = (kept.loss_mask & valid[:, None]).astype(jnp.float32)
    old_logp = old_logprobs(program, state, kept, mask)
    ref_logp = ref_logprobs(program, state, kept, mask)
    values = old_values(program, state, kept, mask)
    token_rewards, score, kl_metrics = token_level_rewards(settings, kept, score, mask, old_logp, ref_logp, hyper)
    advantages, returns = estimate_advantages(settings, kept, token_rewards, values, mask, valid, hyper)
    batch = UpdateBatch(kept.tokens, kept.length, first_prompt_split(kept), mask, old_logp, ref_logp, values, advantages, returns)
    return batch, metrics | kl_metrics | batch_metrics(settings, batch, score, token_rewards, valid)


def filter_groups(settings: TrainSettings, group_size: int, traj: Trajectories, score, filter_ratio):
    """2. StarPO-S filter: keep the groups whose raw env rewards (``filter.rank_by = "score"``: scores)
    vary most, compacted to ``kept_groups`` groups (static): (kept trajectories, their scores, valid
    [M] bool, metrics).

    Rows past the kept count repeat group 0 and are not ``valid``: no statistic may see them."""
    raw = traj.env_reward.reshape(-1, group_size)
    rank_by = score.reshape(-1, group_size) if settings.filter_rank_by == "score" else None
    keep, metrics = filtering.select_groups(raw, filter_ratio, settings.filter_type, rank_by=rank_by)
    (kept, score), valid = filtering.gather_kept_groups((traj, score), keep, settings.kept_groups, group_size)
    return kept, score, valid, metrics


def old_logprobs(program: UpdateProgram, state: TrainState, kept: Trajectories, mask):
    """3a. log π_old [M, L] of the policy tokens: recomputed by the policy that sampled them, or
    the sampler's own (``use_sampler_logprobs``). A constant of the update."""
    settings = program.settings
    if settings.use_sampler_logprobs:
        return jax.lax.stop_gradient(kept.sampler_logprobs)
    params = policy_weights(settings, state)
    logp, _ = _map_micro(functools.partial(token_logprobs, program.forward, params), _rows(kept, mask),
                         settings.micro_batch_size)
    return jax.lax.stop_gradient(logp)


def ref_logprobs(program: UpdateProgram, state: TrainState, kept: Trajectories, mask):
    """3b. log π_ref [M, L] under the frozen reference; zeros when no KL term reads them."""
    if not program.settings.uses_ref:
        return jnp.zeros(kept.tokens.shape, jnp.float32)
    logp, _ = _map_micro(functools.partial(token_logprobs, program.forward, reference_weights(state)),
                         _rows(kept, mask), program.settings.micro_batch_size)
    return logp


def old_values(program: UpdateProgram, state: TrainState, kept: Trajectories, mask):
    """3c. V_old [M, L] on the policy tokens (0 elsewhere); zeros when the estimator has no critic."""
    settings = program.settings
    if not settings.uses_critic:
        return jnp.zeros(kept.tokens.shape, jnp.float32)
    assert state.critic is not None  # init_state makes one whenever the settings use a critic
    critic = critic_weights(settings, state.critic, state.base)
    values = _map_micro(functools.partial(token_values, program.forward, critic), _rows(kept, mask),
                        settings.micro_batch_size)
    return values * mask


def token_level_rewards(settings: TrainSettings, kept: Trajectories, score, mask, old_logp, ref_logp, hyper: Hyperparams):
    """4. Rewards per token [M, L]: each trajectory's score on its last policy token, or raw turn
    rewards on each turn's last token (``use_turn_scores``: no normalisation, no format penalty,
    as in RAGEN), less β·KL with ``kl_in_reward``. Returns (token rewards, the score each
    trajectory counts as, metrics)."""
    metrics = {}
    if settings.use_turn_scores:
        token_rewards = rewards.turn_scores_to_token_rewards(
            kept.turn_reward, kept.turn_end - 1, kept.turn_played, kept.tokens.shape[1]
        )
        score = token_rewards.sum(axis=1)
    else:
        token_rewards = rewards.scores_to_token_rewards(score, mask)
    if settings.kl_in_reward:
        kl = losses.kl_penalty(old_logp, ref_logp, settings.kl_penalty)
        token_rewards, metrics = rewards.kl_in_reward(token_rewards, kl, mask, hyper.kl_in_reward_coef)
    return token_rewards, score, metrics


def estimate_advantages(settings: TrainSettings, kept: Trajectories, token_rewards, values, mask, valid, hyper: Hyperparams):
    """5. (advantages, returns) [M, L] by ``adv_estimator``: GAE, bi-level GAE, GRPO or GiGPO."""
    if settings.adv_estimator == "gae":
        return adv.gae(token_rewards, values, mask, hyper.gamma, hyper.lam)
    if settings.adv_estimator == "bilevel_gae":
        return adv.bilevel_gae(
            token_rewards, values, mask, kept.turn_end - 1, kept.turn_played,
            hyper.gamma, hyper.lam, hyper.high_level_gamma,
        )
    if settings.adv_estimator == "grpo":
        # veRL's outcome is the summed token reward (KL penalty included), grouped over real rows
        return adv.grpo_outcome(token_rewards.sum(axis=1), kept.group_id, mask, settings.grpo_norm_by_std, valid=valid)
    if settings.adv_estimator == "gigpo":
        # GRPO's episode advantage on the same outcome, plus ω × each turn's step advantage among the
        # turns of its group that start from the same env state (verl-agent's anchor states)
        return adv.gigpo(
            token_rewards.sum(axis=1), kept.turn_reward, kept.turn_state_key, kept.turn_start, kept.turn_end,
            kept.turn_played, kept.group_id, mask, hyper.gamma, hyper.gigpo_step_weight,
            norm_by_std=settings.gigpo_mode == "mean_std_norm", valid=valid,
        )
    raise ValueError(f"Unknown advantage estimator {settings.adv_estimator!r}: use gae, grpo, bilevel_gae or gigpo.")


def update_critic(program: UpdateProgram, state: TrainState, batch: UpdateBatch, hyper: Hyperparams):
    """6. The critic's update, ``ppo_update`` of ``critic_loss_fn``: (critic, critic_opt, skipped
    steps, metrics); unchanged without one."""
    settings = program.settings
    if not settings.uses_critic:
        return state.critic, state.critic_opt, jnp.zeros((), jnp.int32), {}
    tx = optimizer(settings, "critic")
    loss_fn = functools.partial(critic_loss_fn, program, state.base)
    (critic, critic_opt, skipped), metrics = ppo_update(
        settings, loss_fn, tx, state.critic, state.critic_opt, batch, hyper.critic_lr, hyper, "critic"
    )
    metrics["critic/skipped_steps"] = (state.critic_skipped_steps + skipped).astype(jnp.float32)
    return critic, critic_opt, skipped, metrics


def critic_loss_fn(program: UpdateProgram, base, critic: Critic, b: UpdateBatch, hyper: Hyperparams):
    """6. The clipped value loss of a micro-batch, a function of what the critic trains."""
    settings = program.settings
    values = token_values(program.forward, critic_weights(settings, critic, base), _batch_rows(b))
    return losses.value_loss(values, b.values, b.returns, b.mask, settings.cliprange_value, "seq-mean-token-mean")


def update_actor(program: UpdateProgram, state: TrainState, batch: UpdateBatch, hyper: Hyperparams, horizon):
    """7. The actor's update, ``ppo_update`` of ``actor_loss_fn``: (actor, actor_opt, skipped steps,
    metrics); unchanged for the first ``critic_warmup`` steps (RAGEN: the actor waits while the
    critic warms up)."""
    settings = program.settings
    tx = optimizer(settings, "actor")
    loss_fn = functools.partial(actor_loss_fn, program, state.base, horizon)
    (actor, actor_opt, skipped), metrics = ppo_update(
        settings, loss_fn, tx, state.actor, state.actor_opt, batch, hyper.actor_lr, hyper, "actor"
    )
    if settings.critic_warmup > 0:  # the actor's step kept or dropped whole: a pass over its weights
        train_actor = state.step >= settings.critic_warmup
        actor = jax.tree.map(lambda n, o: jnp.where(train_actor, n, o), actor, state.actor)
        actor_opt = jax.tree.map(lambda n, o: jnp.where(train_actor, n, o), actor_opt, state.actor_opt)
        skipped = jnp.where(train_actor, skipped, 0)
    metrics["actor/lr"] = hyper.actor_lr
    metrics["actor/skipped_steps"] = (state.skipped_steps + skipped).astype(jnp.float32)
    return actor, actor_opt, skipped, metrics


def actor_loss_fn(program: UpdateProgram, base, horizon, trained, b: UpdateBatch, hyper: Hyperparams):
    """7. The PPO actor loss of a micro-batch, a function of what the actor trains: (loss, metrics)."""
    settings = program.settings
    params = with_adapters(settings, base, trained)
    logp, entropy = token_logprobs(program.forward, params, _batch_rows(b))
    return losses.actor_loss(
        logp, entropy, b.old_logp, b.advantages, b.mask,
        clip_low=hyper.clip_ratio_low, clip_high=hyper.clip_ratio_high, clip_c=hyper.clip_ratio_c,
        entropy_coeff=hyper.entropy_coeff, agg_mode=settings.loss_agg_mode,
        ref_logp=b.ref_logp if settings.use_kl_loss else None, kl_coef=hyper.kl_loss_coef,
        kl_kind=settings.kl_loss_type, horizon=horizon,
    )


def ppo_update(settings: TrainSettings, loss_fn, tx, params, opt_state, batch: MaskedRows, lr, hyper: Hyperparams,
               prefix: str):
    """6, 7. ``ppo_epochs`` passes over the mini-batches, one optimiser step each: ((params, opt_state,
    skipped steps), metrics averaged over the mini-batches that hold a trained token)."""

    def one_minibatch(carry, micro_batches):
        params, opt_state, skipped = carry
        grads, metrics, live = accumulate_gradients(loss_fn, params, micro_batches, hyper)
        params, opt_state, grad_norm, skip = apply_update(tx, params, opt_state, grads, lr, live)
        metrics[f"{prefix}/grad_norm"] = grad_norm
        return (params, opt_state, skipped + skip), (metrics, live)

    def one_epoch(carry, _):
        return jax.lax.scan(one_minibatch, carry, _minibatches(batch, settings.ppo_mini_batch_size, settings.micro_batch_size))

    carry, (metrics, live) = jax.lax.scan(
        one_epoch, (params, opt_state, jnp.zeros((), jnp.int32)), None, settings.ppo_epochs
    )
    return carry, jax.tree.map(lambda m: masked_mean(m, live), metrics)


def accumulate_gradients(loss_fn, params, micro_batches, hyper: Hyperparams):
    """6, 7. Mean gradient and metrics over the micro-batches of one mini-batch (veRL: Σ loss / n_micro),
    and whether any counted: a micro-batch of padding rows only (no trained token) is left out."""

    def one(carry, b):
        grads, count = carry
        (_, metrics), g = jax.value_and_grad(loss_fn, has_aux=True)(params, b, hyper)
        live = jnp.any(b.mask > 0)
        grads = jax.tree.map(lambda a, x: a + jnp.where(live, x, 0.0), grads, g)
        return (grads, count + live), (metrics, live)

    zeros = jax.tree.map(jnp.zeros_like, params)
    (grads, count), (metrics, live) = jax.lax.scan(one, (zeros, jnp.zeros((), jnp.int32)), micro_batches)
    grads = jax.tree.map(lambda g: g / jnp.maximum(count, 1).astype(g.dtype), grads)
    return grads, jax.tree.map(lambda m: masked_mean(m, live), metrics), count > 0


# ---- helpers: weights and the optimiser ----------------------------------------------------------


def with_adapters(settings: TrainSettings, base: nnx.State | None, trained) -> nnx.State:
    """Full decoder weights from what trains: the weights themselves, or base + merged adapters."""
    return trained if base is None else lora.merge(base, trained, settings.lora_scale)


def policy_weights(settings: TrainSettings, state: TrainState) -> nnx.State:
    """The actor's full decoder weights (what samples, what gets exported)."""
    return with_adapters(settings, state.base, state.actor)


def reference_weights(state: TrainState) -> nnx.State:
    """The frozen reference policy: the initial weights (with LoRA, the base with adapters off)."""
    if state.base is not None:
        return state.base
    assert state.ref is not None  # init_state keeps a reference whenever the settings read one (uses_ref)
    return state.ref


def critic_weights(settings: TrainSettings, critic: Critic, base) -> Critic:
    """The critic with full backbone weights (base + merged adapters under LoRA)."""
    return critic.replace(backbone=with_adapters(settings, base, critic.backbone))


def optimizer(settings: TrainSettings, role: str) -> optax.GradientTransformation:
    """The actor's or the critic's (``role``) AdamW without the learning rate (applied by
    ``apply_update`` so it can be traced): the one place each optimiser is built."""
    grad_clip, betas, weight_decay = (getattr(settings, f"{role}_{name}") for name in ("grad_clip", "betas", "weight_decay"))
    return optax.chain(
        optax.clip_by_global_norm(grad_clip),
        optax.scale_by_adam(b1=betas[0], b2=betas[1]),
        optax.add_decayed_weights(weight_decay),
    )


def apply_update(tx, params, opt_state, grads, lr, live=True):
    """One optimiser step: (params, opt_state, grad_norm, skipped).

    A non-finite gradient leaves params and moments untouched and counts as skipped (veRL skips
    it too); ``live=False`` (a mini-batch of padding rows only) leaves them untouched uncounted."""
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(grad_norm)

    def step(params, opt_state):
        updates, new_opt = tx.update(grads, opt_state, params)
        return jax.tree.map(lambda p, u: p - lr * u.astype(p.dtype), params, updates), new_opt

    # A branch, not a select of new against old: a select is one more pass over every weight and
    # moment at every step (under vmap, as in a sweep, the branch becomes that select again)
    new_params, new_opt = jax.lax.cond(finite & live, step, lambda *state: state, params, opt_state)
    return new_params, new_opt, grad_norm, live & ~finite


# ---- helpers: the update batch -------------------------------------------------------------------


class UpdateProgram(NamedTuple):
    """What the update's steps share besides arrays, all static for the compiled program: the
    settings, the rollout plan, and the forward pass over the update rows (the model's structure
    and which positions it computes: ``forward.update_forward``)."""

    settings: TrainSettings
    plan: RolloutPlan
    forward: ForwardPass


class MaskedRows(Protocol):
    """What ``ppo_update`` splits into mini- and micro-batches (``UpdateBatch``): a pytree of rows
    whose ``mask`` marks the trained tokens (a micro-batch with none adds no gradient)."""

    @property
    def mask(self) -> jax.Array: ...


class UpdateBatch(flax.struct.PyTreeNode):
    tokens: jax.Array
    length: jax.Array
    split: jax.Array  # int32 [M]: ``first_prompt_split``
    mask: jax.Array  # float32 [M, L]: policy tokens of kept trajectories
    old_logp: jax.Array
    ref_logp: jax.Array
    values: jax.Array
    advantages: jax.Array
    returns: jax.Array


def batch_metrics(settings: TrainSettings, batch: UpdateBatch, score, token_rewards, valid) -> dict[str, jax.Array]:
    """RAGEN's critic/* and rollout/*_log_prob statistics of the update batch, over real rows only."""
    mask = batch.mask
    metrics = {
        "critic/score/mean": masked_mean(score, valid),
        "critic/rewards/mean": masked_mean(token_rewards.sum(axis=1), valid),
        "critic/advantages/mean": masked_mean(batch.advantages, mask),
        "critic/returns/mean": masked_mean(batch.returns, mask),
        "rollout/old_log_prob": masked_mean(batch.old_logp, mask),
    }
    if settings.uses_ref:
        metrics["rollout/ref_log_prob"] = masked_mean(batch.ref_logp, mask)
    if settings.uses_critic:
        metrics["critic/values/mean"] = masked_mean(batch.values, mask)
        metrics["critic/vf_explained_var"] = losses.explained_variance(batch.returns, batch.values, mask)
    return metrics


def _minibatches(batch, mini: int, micro: int):
    """[M, ...] -> [M / mini, mini / micro, micro, ...] without shuffling (veRL)."""
    return jax.tree.map(lambda x: x.reshape((-1, mini // micro, micro) + x.shape[1:]), batch)


def _map_micro(fn, batch, micro: int):
    """Run ``fn`` over micro-batches of ``batch`` (leading dim M) and stitch the outputs back."""
    M = jax.tree.leaves(batch)[0].shape[0]
    split = jax.tree.map(lambda x: x.reshape((M // micro, micro) + x.shape[1:]), batch)
    out = jax.lax.map(fn, split)
    return jax.tree.map(lambda x: x.reshape((M,) + x.shape[2:]), out)


# ---- helpers: forward passes over the update batch (starpo_jax.forward) -----------------------


def _rows(kept: Trajectories, mask) -> Rows:
    return Rows(kept.tokens, kept.length, first_prompt_split(kept), mask > 0)


def _batch_rows(b: UpdateBatch) -> Rows:
    return Rows(b.tokens, b.length, b.split, b.mask > 0)

