"""Template collapse (RAGEN-2): does a response still depend on the board it answers?

A policy can keep its entropy and still stop reading its input: every board gets the same
answer. RAGEN-2 (arXiv 2604.06268) measures this by scoring each sampled response under the
other prompts of its batch. With ``ℓ_j(z_i)`` the log-prob of response ``z_i`` after prompt
``x_j`` (its mean over the response's tokens, or its sum for the ``_seq`` figures):

- matched ``ℓ_own(i)(z_i)``, marginal ``log (1/P) Σ_j exp ℓ_j(z_i)`` (the prompts of the batch
  taken as uniform);
- the mutual-information estimate ``Î(X; Z) = mean_i [matched − marginal]``: 0 when responses
  ignore their prompts, at most ``log P``;
- the retrieval accuracy: how often a response scores highest under its own prompt (a prompt
  identical to its own counts as its own), against the chance level of guessing.

Here the prompt is a group's first prompt (a group's rows start from the same level) and the
response its first turn's answer, as RAGEN-2's first-turn sample. The cross log-probs are one
compiled program: each prompt's keys and values computed once (``Decoder.prefix_keys_values``),
every response continued from them (``hidden_states_after``), one micro-batch of rows at a time.
Prompts with the same tokens (the Bandit has two: its arms in either order) are scored after once
(``distinct_prompts``, picked on the host) and their scores shared: the same figures for a fraction
of the work.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from starpo_jax.algo import losses
from starpo_jax.forward import first_prompt_split, first_prompt_width
from starpo_jax.models.decoder import ModelState
from starpo_jax.rollout.multi_turn import RolloutPlan, Trajectories, first_rows_of_distinct_prompts
from starpo_jax.runtime import distributed


class CrossScores(NamedTuple):
    """Every sampled first response scored after every sampled first prompt of one env tag."""

    per_token: jax.Array  # float32 [R, P]: mean log-prob of response r's tokens after prompt p
    per_sequence: jax.Array  # float32 [R, P]: their sum
    own: jax.Array  # int32 [R]: the prompt response r answered
    same_prompt: jax.Array  # bool [P, P]: prompts p and q are the same tokens


def template_collapse_metrics(s: CrossScores) -> dict[str, jax.Array]:
    """RAGEN-2's figures from the cross scores: MI estimates (per token and per sequence), retrieval
    accuracy and its chance level."""
    num_prompts = s.per_token.shape[1]
    rows = jnp.arange(s.per_token.shape[0])

    def mi(cross):
        matched = cross[rows, s.own]
        marginal = jax.nn.logsumexp(cross, axis=1) - math.log(num_prompts)
        return jnp.mean(matched - marginal)

    best = jnp.argmax(s.per_token, axis=1)
    alike = s.same_prompt[s.own]  # [R, P]: which prompts equal each response's own
    return {
        "mi": mi(s.per_token),
        "mi_seq": mi(s.per_sequence),
        "retrieval_acc": jnp.mean(alike[rows, best].astype(jnp.float32)),
        "retrieval_chance": jnp.mean(alike.sum(axis=1) / num_prompts),
    }


def sampled_groups(plan: RolloutPlan, max_prompts: int) -> list[tuple[str, np.ndarray]]:
    """Per env tag, the groups whose first prompts and answers are scored: its first
    ``max_prompts`` groups (static), as (tag name, group indices into the batch)."""
    out, first = [], 0
    for tag in plan.tags:
        out.append((tag.name, np.arange(first, first + min(tag.n_groups, max_prompts))))
        first += tag.n_groups
    return out


def distinct_prompts(traj: Trajectories, groups: np.ndarray, group_size: int) -> np.ndarray:
    """int32 [D]: the first of ``groups``' first prompts with each distinct token sequence (its tokens
    up to and including the split's), as indices into ``groups``: the prompts ``cross_scores``
    scores after. Read on the host, on every process alike."""
    leaders = np.asarray(groups) * group_size
    tokens, split = distributed.to_host((traj.tokens[leaders], first_prompt_split(traj)[leaders]))
    return first_rows_of_distinct_prompts(tokens, np.asarray(split) + 1).astype(np.int32)


def prompt_width(traj: Trajectories, plan: RolloutPlan) -> int:
    """The static width that holds every row's first prompt: the update layout's prefix
    (``forward.first_prompt_width``), picked on the host, a few compiled widths per run."""
    return first_prompt_width(np.asarray(distributed.to_host(first_prompt_split(traj))), plan)


@functools.partial(jax.jit, static_argnames=("graphdef", "group_size", "groups", "width", "response_length",
                                             "micro_batch", "temperature"))
def cross_scores(graphdef, params, traj: Trajectories, *, group_size: int, groups: tuple[int, ...], width: int,
                 response_length: int, micro_batch: int, temperature: float,
                 scored: jax.Array | np.ndarray | None = None) -> CrossScores:
    """The first answers of ``groups``' rows scored after each of those groups' first prompts.

    ``width``: the static width that holds the prompts (``prompt_width``); ``response_length``: the
    longest first answer; rows are scored ``micro_batch`` at a time, so at most [micro_batch,
    response_length, V] logits exist at once. ``scored``: int32 [D], the prompts (indices into
    ``groups``) the answers are scored after, one of each distinct prompt (``distinct_prompts``);
    every other prompt takes the scores of the scored one with its tokens. None: every prompt."""
    model = nnx.merge(graphdef, params)
    leaders = np.asarray(groups) * group_size
    rows = (leaders[:, None] + np.arange(group_size)[None]).reshape(-1)
    split = first_prompt_split(traj)[leaders]  # each first prompt's last token: it predicts the first answer token
    prompts = traj.tokens[leaders, :width]
    last = traj.tokens[leaders, split]
    prompt_only = jnp.where(jnp.arange(width)[None] < split[:, None], prompts, -1)
    same = jnp.all(prompt_only[:, None] == prompt_only[None], axis=-1) & (last[:, None] == last[None])
    scored = jnp.arange(len(leaders)) if scored is None else jnp.asarray(scored, jnp.int32)
    keys, values = model.prefix_keys_values(prompts[scored], split[scored])
    split, last = split[scored], last[scored]

    start = traj.turn_start[rows, 0]
    answer_length = traj.turn_end[rows, 0] - start
    offsets = jnp.arange(response_length)
    answers = jnp.take_along_axis(traj.tokens[rows], jnp.minimum(start[:, None] + offsets, traj.tokens.shape[1] - 1), 1)
    real = offsets[None] < answer_length[:, None]

    def after_prompt(p):
        """float32 [R]: each answer's summed log-prob after the p-th scored prompt."""

        def micro(batch):
            answer, mask = batch
            m = answer.shape[0]
            tokens = jnp.concatenate([jnp.full((m, 1), last[p]), answer[:, :-1]], axis=1)
            positions = jnp.broadcast_to(split[p] + offsets, tokens.shape)
            k, v = (jnp.broadcast_to(x[:, p][:, None], (x.shape[0], m) + x.shape[2:]) for x in (keys, values))
            hidden = model.hidden_states_after(tokens, positions, k, v, jnp.broadcast_to(split[p], (m,)))
            logp, _ = losses.token_logprobs_and_entropy(model.logits(hidden), answer, temperature)
            return jnp.sum(jnp.where(mask, logp, 0.0), axis=1)

        shaped = [x.reshape((-1, micro_batch) + x.shape[1:]) for x in (answers, real)]
        return jax.lax.map(micro, tuple(shaped)).reshape(-1)

    summed = jax.lax.map(after_prompt, jnp.arange(scored.shape[0])).T  # [R, D]
    summed = summed[:, jnp.argmax(same[:, scored], axis=1)]  # [R, P]: each prompt the scores of its scored twin
    counts = jnp.maximum(answer_length, 1).astype(jnp.float32)[:, None]
    own = jnp.repeat(jnp.arange(len(leaders), dtype=jnp.int32), group_size)
    return CrossScores(summed / counts, summed, own, same)


_figures = jax.jit(template_collapse_metrics)


def rows_per_pass(rows: int, response_length: int, positions: int) -> int:
    """The fewest of ``rows`` (a divisor) whose answers hold ``positions``: a pass of few positions
    leaves the products short of their rate (docs/benchmarks.md, "The FrozenLake preset's update
    without rematerialisation …"), and its logits [rows, response_length, V] stay bounded."""
    return next(d for d in range(1, rows + 1) if rows % d == 0 and (d * response_length >= positions or d == rows))


def collapse_metrics(policy: ModelState, traj: Trajectories, plan: RolloutPlan, prefix: str, *, max_prompts: int,
                     positions: int, temperature: float) -> dict[str, float]:
    """``{prefix}/{tag}/mi``, ``mi_seq``, ``retrieval_acc`` and ``retrieval_chance`` of a rollout batch,
    per env tag with two prompts or more: the first answers of the tag's first ``max_prompts``
    groups scored by ``policy`` (the weights that sampled them, at their sampling ``temperature``)
    after each of those groups' first prompts, at least ``positions`` answer positions a pass (the
    update's ``logprob_chunk``, the vocabulary projection's chunk)."""
    width = prompt_width(traj, plan)
    out: dict[str, float] = {}
    for name, groups in sampled_groups(plan, max_prompts):
        if len(groups) < 2:
            continue  # one prompt: nothing to tell apart
        rows = len(groups) * plan.group_size
        scores = cross_scores(policy.graphdef, policy.params, traj, group_size=plan.group_size,
                              groups=tuple(int(g) for g in groups), width=width, response_length=plan.response_length,
                              micro_batch=rows_per_pass(rows, plan.response_length, positions),
                              temperature=temperature, scored=distinct_prompts(traj, groups, plan.group_size))
        figures = distributed.to_host(_figures(scores))  # on every process, wherever the batch was scored
        out |= {f"{prefix}/{name}/{key}": float(value) for key, value in figures.items()}
    return out
