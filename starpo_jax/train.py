"""The StarPO / StarPO-S training iteration as one compiled program (spec §3.1).

    rollout → filter (StarPO-S) → old / ref log-probs, values → scores → advantages → update

``make_train_step(settings, graphdef, plan)`` returns a pure ``train_step(state, tables, hyper,
key) -> (state, metrics)``. ``Hyperparams`` are arrays, so ``jax.vmap`` over a stacked
``Hyperparams`` (and a stacked ``TrainState``) trains several configurations in one program.

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

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from starpo_jax import advantages as adv
from starpo_jax import filtering, losses, rewards, sharding
from starpo_jax.masked import masked_mean
from starpo_jax.models import lora
from starpo_jax.models.decoder import ModelState
from starpo_jax.rollout import RolloutPlan, Trajectories, initial_states_from_key, make_rollout


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """Static switches and sizes of the update (a sweep does not vary these)."""

    adv_estimator: str = "gae"  # gae | grpo | bilevel_gae
    grpo_norm_by_std: bool = True
    reward_grouping: str = "state"
    reward_method: str = "identity"
    use_turn_scores: bool = False
    filter_type: str = "std"
    kept_groups: int = 2  # static upper bound of kept groups (int(ratio * env_groups) for top-k)
    loss_agg_mode: str = "seq-mean-token-mean"
    ppo_mini_batch_size: int = 32
    micro_batch_size: int = 4
    ppo_epochs: int = 1
    use_kl_loss: bool = False
    kl_loss_type: str = "kl"
    kl_in_reward: bool = False
    kl_penalty: str = "kl"
    rollout_temperature: float = 1.0
    use_sampler_logprobs: bool = False
    critic_warmup: int = 0
    actor_betas: tuple[float, float] = (0.9, 0.999)
    critic_betas: tuple[float, float] = (0.9, 0.999)
    actor_weight_decay: float = 0.01
    critic_weight_decay: float = 0.01
    actor_grad_clip: float = 1.0
    critic_grad_clip: float = 1.0
    cliprange_value: float = 0.5
    logprob_chunk: int = 512  # positions per chunk when computing log-probs from hidden states
    lora_rank: int = 0  # 0: full fine-tuning
    lora_alpha: float = 64.0

    @property
    def uses_critic(self) -> bool:
        return self.adv_estimator in ("gae", "bilevel_gae")

    @property
    def uses_ref(self) -> bool:
        return self.use_kl_loss or self.kl_in_reward

    @property
    def lora_scale(self) -> float:
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0


@flax.struct.dataclass
class Hyperparams:
    """The values a sweep varies, as float32 arrays (scalars, or [S] under ``vmap``)."""

    actor_lr: jax.Array
    critic_lr: jax.Array
    clip_ratio_low: jax.Array
    clip_ratio_high: jax.Array
    clip_ratio_c: jax.Array
    entropy_coeff: jax.Array
    kl_loss_coef: jax.Array
    kl_in_reward_coef: jax.Array
    filter_ratio: jax.Array
    gamma: jax.Array
    lam: jax.Array
    high_level_gamma: jax.Array

    @classmethod
    def create(cls, **values: float) -> "Hyperparams":
        return cls(**{k: jnp.asarray(v, jnp.float32) for k, v in values.items()})


@flax.struct.dataclass
class Critic:
    backbone: nnx.State | lora.Adapters  # its decoder weights, or its LoRA adapters over the base
    head_w: jax.Array  # [D]
    head_b: jax.Array  # []


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    actor: nnx.State | lora.Adapters  # what the actor trains: its weights, or its LoRA adapters
    actor_opt: Any
    critic: Critic | None
    critic_opt: Any
    ref: nnx.State | None  # a frozen copy of the initial actor (full fine-tuning with a KL term)
    skipped_steps: jax.Array  # actor optimiser steps skipped for a non-finite gradient, so far
    critic_skipped_steps: jax.Array
    base: nnx.State | None = None  # with LoRA: the frozen initial weights under both sets of adapters


def with_adapters(settings: TrainSettings, base: nnx.State | None, trained) -> nnx.State:
    """Full decoder weights from what trains: the weights themselves, or base + merged adapters."""
    return trained if base is None else lora.merge(base, trained, settings.lora_scale)


def policy_weights(settings: TrainSettings, state: TrainState) -> nnx.State:
    """The actor's full decoder weights (what samples, what gets exported)."""
    return with_adapters(settings, state.base, state.actor)


def reference_weights(state: TrainState) -> nnx.State:
    """The frozen reference policy: the initial weights (with LoRA, the base with adapters off)."""
    return state.base if state.base is not None else state.ref


# ---- optimiser ---------------------------------------------------------------------------------


def optimizer(grad_clip: float, betas: tuple[float, float], weight_decay: float) -> optax.GradientTransformation:
    """AdamW without the learning rate (applied by ``apply_update`` so it can be traced)."""
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
    safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, 0.0), grads)
    updates, new_opt = tx.update(safe_grads, opt_state, params)
    new_params = jax.tree.map(lambda p, u: p - lr * u.astype(p.dtype), params, updates)
    take = finite & live
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(take, n, o), new, old)  # noqa: E731
    return keep(new_params, params), keep(new_opt, opt_state), grad_norm, live & ~finite


# ---- forward passes over whole trajectories ----------------------------------------------------


def _positions_and_segments(tokens, length):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    segments = (positions < length[:, None]).astype(jnp.int32)
    return positions, segments


def _shift_to_targets(hidden):
    """Hidden state that predicts token t is at t - 1: [B, L, D] -> [B, L, D] (row 0 is padding)."""
    return jnp.pad(hidden[:, :-1], ((0, 0), (1, 0), (0, 0)))


def _chunked(fn, hidden, targets, chunk: int):
    """``fn(hidden[:, c], targets[:, c])`` over chunks of positions, rematerialised in the backward
    pass, so only one chunk's [B, chunk, V] logits exist at a time."""
    B, K = targets.shape
    chunk = min(chunk, K)
    n = -(-K // chunk)
    pad = n * chunk - K
    h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0))).reshape(B, n, chunk, -1).swapaxes(0, 1)
    t = jnp.pad(targets, ((0, 0), (0, pad))).reshape(B, n, chunk).swapaxes(0, 1)
    out = jax.lax.map(jax.checkpoint(lambda xs: fn(*xs)), (h, t))
    return jax.tree.map(lambda o: o.swapaxes(0, 1).reshape(B, n * chunk)[:, :K], out)


def policy_positions(mask, max_tokens: int):
    """Indices [B, K] of each row's masked positions (K = max_tokens, static), and which are real."""
    index = jax.vmap(lambda m: jnp.nonzero(m, size=max_tokens, fill_value=m.shape[0])[0])(mask)
    return index, index < mask.shape[1]


def token_logprobs(graphdef, params, tokens, length, needed, temperature: float, chunk: int, max_tokens: int):
    """(logp, entropy) [B, L]: log p(token_t | tokens_<t) under the policy, and its entropy.

    Only positions where ``needed`` (the loss mask, at most ``max_tokens`` per row) is set are
    computed: their hidden states are gathered first, so the vocabulary projection — the largest
    cost of a small model — is paid only where the loss looks. Other positions are 0."""
    model = nnx.merge(graphdef, params)
    positions, segments = _positions_and_segments(tokens, length)
    hidden = _shift_to_targets(model.hidden_states(tokens, positions, segments))
    index, real = policy_positions(needed, max_tokens)
    safe = jnp.where(real, index, 0)
    h = jnp.take_along_axis(hidden, safe[..., None], axis=1)
    t = jnp.take_along_axis(tokens, safe, axis=1)
    logp, entropy = _chunked(lambda h, t: losses.token_logprobs_and_entropy(model.logits(h), t, temperature), h, t, chunk)
    rows = jnp.arange(tokens.shape[0])[:, None]
    scatter = lambda x: jnp.zeros(tokens.shape, jnp.float32).at[rows, index].set(x, mode="drop")  # noqa: E731
    return scatter(logp), scatter(entropy)


def token_values(graphdef, critic: Critic, tokens, length):
    """V[B, L]: the critic's value of the state before token t (aligned like the log-probs)."""
    model = nnx.merge(graphdef, critic.backbone)
    positions, segments = _positions_and_segments(tokens, length)
    hidden = _shift_to_targets(model.hidden_states(tokens, positions, segments))
    return jnp.einsum("bld,d->bl", hidden.astype(jnp.float32), critic.head_w) + critic.head_b


def sampling_policy(graphdef, params) -> ModelState:
    """The policy for sampling: master weights cast once to the compute dtype (bf16 on GPU halves
    the bytes read per decode step), then gathered over the ``fsdp`` mesh axis (cast first, so the
    gather moves half the bytes): decoding reads every weight per token and wants them local."""
    dtype = jnp.dtype(nnx.merge(graphdef, params).config.dtype)
    return ModelState(graphdef, sharding.for_decoding(jax.tree.map(lambda p: p.astype(dtype), params)))


# ---- state -------------------------------------------------------------------------------------


def init_train_state(settings: TrainSettings, model: ModelState, key) -> TrainState:
    """Actor, critic (same checkpoint + a fresh value head) and reference from one model.

    Full fine-tuning copies the weights for the critic and the reference; LoRA keeps one frozen
    base and gives the actor and the critic fresh adapters (the merged model starts as the base)."""
    config = model.merge().config
    head_key, actor_key, critic_key = jax.random.split(key, 3)
    if settings.lora_rank:
        base, ref = model.params, None
        actor = lora.init_adapters(config, settings.lora_rank, actor_key)
        critic_backbone = lora.init_adapters(config, settings.lora_rank, critic_key)
    else:
        base, actor = None, model.params
        ref = jax.tree.map(jnp.copy, actor) if settings.uses_ref else None
        critic_backbone = jax.tree.map(jnp.copy, actor)
    actor_tx = optimizer(settings.actor_grad_clip, settings.actor_betas, settings.actor_weight_decay)
    critic = critic_opt = None
    if settings.uses_critic:
        critic = Critic(
            backbone=critic_backbone,
            head_w=0.02 * jax.random.normal(head_key, (config.hidden_size,), jnp.float32),
            head_b=jnp.zeros((), jnp.float32),
        )
        critic_opt = optimizer(settings.critic_grad_clip, settings.critic_betas, settings.critic_weight_decay).init(critic)
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


# ---- the batch the update sees -----------------------------------------------------------------


@flax.struct.dataclass
class UpdateBatch:
    tokens: jax.Array
    length: jax.Array
    mask: jax.Array  # float32 [M, L]: policy tokens of kept trajectories
    old_logp: jax.Array
    ref_logp: jax.Array
    values: jax.Array
    advantages: jax.Array
    returns: jax.Array


def _minibatches(batch, n_mini: int, n_micro: int):
    """[M, ...] -> [n_mini, n_micro, M / (n_mini * n_micro), ...] without shuffling (veRL)."""
    return jax.tree.map(lambda x: x.reshape((n_mini, n_micro, -1) + x.shape[1:]), batch)


def _map_micro(fn, batch, micro: int):
    """Run ``fn`` over micro-batches of ``batch`` (leading dim M) and stitch the outputs back."""
    M = jax.tree.leaves(batch)[0].shape[0]
    split = jax.tree.map(lambda x: x.reshape((M // micro, micro) + x.shape[1:]), batch)
    out = jax.lax.map(fn, split)
    return jax.tree.map(lambda x: x.reshape((M,) + x.shape[2:]), out)


def rollout_metrics(traj: Trajectories, plan: RolloutPlan, prefix: str) -> dict[str, jax.Array]:
    """RAGEN's per-tag env metrics (spec §2.2, §4.1), computed over every trajectory."""
    metrics = {}
    group_success = jax.ops.segment_max(traj.success.astype(jnp.float32), traj.group_id, plan.num_groups)
    group_tag = traj.tag_id[jnp.arange(plan.num_groups) * plan.group_size]
    for i, tag in enumerate(plan.tags):
        rows = traj.tag_id == i
        per_env = {
            "success": traj.success.astype(jnp.float32),
            "num_actions": traj.num_actions.astype(jnp.float32),
            "action_is_effective": traj.action_is_effective,
            "action_is_valid": traj.action_is_valid,
        }
        for name, value in per_env.items():
            metrics[f"{prefix}/{tag.name}/{name}"] = masked_mean(value, rows)
            metrics[f"{prefix}/{tag.name}/non-zero/{name}"] = masked_mean(value, rows & (value != 0))
        metrics[f"{prefix}/{tag.name}/pass@{plan.group_size}"] = masked_mean(group_success, group_tag == i)
    everything = jnp.ones_like(traj.success)
    metrics[f"{prefix}/response_length"] = traj.response_tokens.astype(jnp.float32).mean()
    metrics[f"{prefix}/think_length"] = traj.think_tokens.astype(jnp.float32).mean()
    metrics[f"{prefix}/reward/mean"] = masked_mean(traj.env_reward + traj.format_penalty_sum, everything)
    metrics[f"{prefix}/reward/std"] = jnp.std(traj.env_reward + traj.format_penalty_sum)
    metrics[f"{prefix}/num_turns"] = traj.num_turns.astype(jnp.float32).mean()
    metrics[f"{prefix}/context_exhausted"] = traj.context_exhausted.astype(jnp.float32).mean()
    metrics[f"{prefix}/generated_tokens"] = traj.response_tokens.sum().astype(jnp.float32)
    metrics[f"{prefix}/env_steps"] = traj.num_actions.sum().astype(jnp.float32)
    return metrics


# ---- the training step ---------------------------------------------------------------------------


def make_train_step(settings: TrainSettings, graphdef, plan: RolloutPlan, responder=None):
    """Returns ``train_step(state, tables, hyper, key) -> (state, metrics)``; jit it whole.

    Its two phases are also exposed, ``train_step.collect(state, tables, key) -> Trajectories`` and
    ``train_step.learn(state, traj, hyper)``, for a driver that times them apart, and the first part
    of ``learn``, ``train_step.prepare(state, traj, hyper) -> (UpdateBatch, metrics)``, for tests."""
    rollout = make_rollout(plan, responder)
    G, N = plan.num_groups, plan.group_size
    k = settings.kept_groups
    M = k * N
    mini = settings.ppo_mini_batch_size
    micro = settings.micro_batch_size
    if M % mini or mini % micro:
        raise ValueError(
            f"The update batch ({k} kept groups × {N} = {M} trajectories) must split into mini-batches of "
            f"{mini}, and those into micro-batches of {micro}; change filter.ratio, ppo_mini_batch_size or "
            "micro_batch_size."
        )
    n_mini, n_micro = M // mini, mini // micro
    actor_tx = optimizer(settings.actor_grad_clip, settings.actor_betas, settings.actor_weight_decay)
    critic_tx = optimizer(settings.critic_grad_clip, settings.critic_betas, settings.critic_weight_decay)
    temperature = settings.rollout_temperature
    chunk = settings.logprob_chunk
    max_policy = min(plan.max_len, plan.max_turn * plan.response_length)  # policy tokens per row

    def logprobs_of(params, batch):
        return _map_micro(
            lambda b: token_logprobs(graphdef, params, b["tokens"], b["length"], b["mask"], temperature, chunk, max_policy),
            batch,
            micro,
        )

    def critic_weights(critic: Critic, base) -> Critic:
        return critic.replace(backbone=with_adapters(settings, base, critic.backbone))

    def prepare(state: TrainState, traj: Trajectories, hyper: Hyperparams):
        """Filter, then everything the update needs: old/ref log-probs, values, advantages.

        Returns (UpdateBatch, metrics). Only real rows (``valid``) enter a statistic."""
        raw = traj.env_reward.reshape(G, N)
        keep, metrics = filtering.select_groups(raw, hyper.filter_ratio, settings.filter_type)
        # RAGEN normalises the scores over the whole rollout batch (ctx_manager), then filters
        score = rewards.trajectory_score(
            traj.env_reward, traj.format_penalty_sum, traj.group_id, traj.tag_id,
            settings.reward_grouping, settings.reward_method,
        )
        (kept, score), valid = filtering.gather_kept_groups((traj, score), keep, k, N)
        mask = (kept.loss_mask & valid[:, None]).astype(jnp.float32)
        seqs = {"tokens": kept.tokens, "length": kept.length, "mask": mask > 0}
        old_logp, _ = logprobs_of(policy_weights(settings, state), seqs)
        if settings.use_sampler_logprobs:
            old_logp = kept.sampler_logprobs
        old_logp = jax.lax.stop_gradient(old_logp)
        ref_logp = logprobs_of(reference_weights(state), seqs)[0] if settings.uses_ref else jnp.zeros_like(old_logp)
        critic = critic_weights(state.critic, state.base) if settings.uses_critic else None
        values = (
            _map_micro(lambda b: token_values(graphdef, critic, b["tokens"], b["length"]), seqs, micro)
            * mask
            if settings.uses_critic
            else jnp.zeros_like(old_logp)
        )

        if settings.use_turn_scores:  # raw turn rewards: no normalisation, no format penalty (RAGEN)
            token_rewards = rewards.turn_scores_to_token_rewards(
                kept.turn_reward, kept.turn_end - 1, kept.turn_played, kept.tokens.shape[1]
            )
            score = token_rewards.sum(axis=1)
        else:
            token_rewards = rewards.scores_to_token_rewards(score, mask)
        if settings.kl_in_reward:
            kl = losses.kl_penalty(old_logp, ref_logp, settings.kl_penalty)
            token_rewards, kl_metrics = rewards.kl_in_reward(token_rewards, kl, mask, hyper.kl_in_reward_coef)
            metrics |= kl_metrics

        if settings.adv_estimator == "gae":
            advantages, returns = adv.gae(token_rewards, values, mask, hyper.gamma, hyper.lam)
        elif settings.adv_estimator == "bilevel_gae":
            advantages, returns = adv.bilevel_gae(
                token_rewards, values, mask, kept.turn_end - 1, kept.turn_played,
                hyper.gamma, hyper.lam, hyper.high_level_gamma,
            )
        elif settings.adv_estimator == "grpo":
            # veRL's outcome is the summed token reward (KL penalty included), grouped over real rows
            advantages, returns = adv.grpo_outcome(
                token_rewards.sum(axis=1), kept.group_id, mask, settings.grpo_norm_by_std, valid=valid
            )
        else:
            raise ValueError(f"Unknown advantage estimator {settings.adv_estimator!r}: use gae, grpo or bilevel_gae.")

        metrics |= {
            "critic/score/mean": masked_mean(score, valid),
            "critic/rewards/mean": masked_mean(token_rewards.sum(axis=1), valid),
            "critic/advantages/mean": masked_mean(advantages, mask),
            "critic/returns/mean": masked_mean(returns, mask),
            "rollout/old_log_prob": masked_mean(old_logp, mask),
        }
        if settings.uses_ref:
            metrics["rollout/ref_log_prob"] = masked_mean(ref_logp, mask)
        if settings.uses_critic:
            metrics["critic/values/mean"] = masked_mean(values, mask)
            metrics["critic/vf_explained_var"] = losses.explained_variance(returns, values, mask)
        batch = UpdateBatch(kept.tokens, kept.length, mask, old_logp, ref_logp, values, advantages, returns)
        return batch, metrics

    def actor_loss_fn(trained, b: UpdateBatch, hyper, base, horizon):
        params = with_adapters(settings, base, trained)
        logp, entropy = token_logprobs(graphdef, params, b.tokens, b.length, b.mask > 0, temperature, chunk, max_policy)
        return losses.actor_loss(
            logp, entropy, b.old_logp, b.advantages, b.mask,
            clip_low=hyper.clip_ratio_low, clip_high=hyper.clip_ratio_high, clip_c=hyper.clip_ratio_c,
            entropy_coeff=hyper.entropy_coeff, agg_mode=settings.loss_agg_mode,
            ref_logp=b.ref_logp if settings.use_kl_loss else None, kl_coef=hyper.kl_loss_coef,
            kl_kind=settings.kl_loss_type, horizon=horizon,
        )

    def critic_loss_fn(critic, b: UpdateBatch, hyper, base):
        values = token_values(graphdef, critic_weights(critic, base), b.tokens, b.length)
        return losses.value_loss(values, b.values, b.returns, b.mask, settings.cliprange_value, "seq-mean-token-mean")

    def accumulate(loss_fn, params, micro_batches, hyper):
        """Mean gradient and metrics over the micro-batches of one mini-batch (veRL: Σ loss / n_micro),
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

    def update(loss_fn, tx, params, opt_state, batch, lr, hyper, prefix):
        """ppo_epochs passes over the mini-batches, one optimiser step each: ((params, opt_state,
        skipped steps), metrics averaged over the mini-batches that hold a trained token)."""

        def one_minibatch(carry, micro_batches):
            params, opt_state, skipped = carry
            grads, metrics, live = accumulate(loss_fn, params, micro_batches, hyper)
            params, opt_state, grad_norm, skip = apply_update(tx, params, opt_state, grads, lr, live)
            metrics[f"{prefix}/grad_norm"] = grad_norm
            return (params, opt_state, skipped + skip), (metrics, live)

        def one_epoch(carry, _):
            return jax.lax.scan(one_minibatch, carry, _minibatches(batch, n_mini, n_micro))

        carry, (metrics, live) = jax.lax.scan(
            one_epoch, (params, opt_state, jnp.zeros((), jnp.int32)), None, settings.ppo_epochs
        )
        return carry, jax.tree.map(lambda m: masked_mean(m, live), metrics)

    def collect(state: TrainState, tables, key) -> Trajectories:
        """The rollout phase: fresh levels, then the policy plays them (weights in compute dtype)."""
        level_key, rollout_key = jax.random.split(jax.random.fold_in(key, state.step))
        return rollout(sampling_policy(graphdef, policy_weights(settings, state)), tables, initial_states_from_key(plan, level_key), rollout_key, temperature)

    def learn(state: TrainState, traj: Trajectories, hyper: Hyperparams):
        """The update phase: filter, advantages, critic and actor updates."""
        metrics = rollout_metrics(traj, plan, "train")
        batch, prep_metrics = prepare(state, traj, hyper)
        metrics |= prep_metrics
        # seq-mean-token-sum-norm's divisor: RAGEN's padded batch width, i.e. the rollout batch's
        # longest sequence minus its first token
        horizon = (traj.length.max() - 1).astype(jnp.float32)

        critic, critic_opt, critic_skipped = state.critic, state.critic_opt, jnp.zeros((), jnp.int32)
        if settings.uses_critic:
            (critic, critic_opt, critic_skipped), critic_metrics = update(
                functools.partial(critic_loss_fn, base=state.base), critic_tx, critic, critic_opt, batch, hyper.critic_lr, hyper, "critic"
            )
            metrics |= critic_metrics
            metrics["critic/skipped_steps"] = (state.critic_skipped_steps + critic_skipped).astype(jnp.float32)
        (actor, actor_opt, skipped), actor_metrics = update(
            functools.partial(actor_loss_fn, base=state.base, horizon=horizon), actor_tx, state.actor, state.actor_opt,
            batch, hyper.actor_lr, hyper, "actor",
        )
        train_actor = state.step >= settings.critic_warmup  # RAGEN: the actor waits critic_warmup steps
        actor = jax.tree.map(lambda n, o: jnp.where(train_actor, n, o), actor, state.actor)
        actor_opt = jax.tree.map(lambda n, o: jnp.where(train_actor, n, o), actor_opt, state.actor_opt)
        skipped = jnp.where(train_actor, skipped, 0)
        metrics |= actor_metrics
        metrics["actor/lr"] = hyper.actor_lr
        metrics["actor/skipped_steps"] = (state.skipped_steps + skipped).astype(jnp.float32)
        new_state = state.replace(
            step=state.step + 1,
            actor=actor,
            actor_opt=actor_opt,
            critic=critic,
            critic_opt=critic_opt,
            skipped_steps=state.skipped_steps + skipped,
            critic_skipped_steps=state.critic_skipped_steps + critic_skipped,
        )
        return new_state, metrics

    def train_step(state: TrainState, tables, hyper: Hyperparams, key):
        return learn(state, collect(state, tables, key), hyper)

    train_step.collect = collect
    train_step.prepare = prepare
    train_step.learn = learn
    return train_step
