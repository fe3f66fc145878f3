"""Format warm-up: a few supervised steps that teach the answer format before RL, not the task.

An untrained small model may never write a valid answer (SmolLM2-135M on FrozenLake: about 2 in 384
first turns at temperature 1), and RL learns nothing from groups whose members all fail alike.
Before the first rollout, ``actor.format_warmup_steps`` steps of supervised learning show it the
answer format on the envs' own first prompts: each answer is a uniformly random sequence of 1 to
``max_actions_per_turn`` of the episode's valid action names,

    (forced "<think>")</think><answer>Up || Left</answer><|im_end|>

with an empty think (nothing about how to solve the task is shown) and the actions drawn without
looking at the board, so the answers carry no information about it: what is learned is the format.
It works for any env of the contract whose actions are named (``TextEnv.action_names``, the
episode's names from ``action_name_ids``); a language-action env (Countdown) has no names to draw.

Design: the answers are composed inside the compiled step from token pieces tokenized once on the
host (the first name, ``" || " + name`` for the next ones, the closing tags, the template's end of
turn), so a step is a pure function of a key. The pieces are tokenized one by one, so an answer's
ids may be segmented differently from the tokenizer's encoding of the whole text; the parser reads
bytes, so both parse alike. The loss is the mean negative log-likelihood of the answer tokens
(``forward.token_logprobs`` over the prompt and answer), the optimiser a fresh AdamW of the actor's
settings with ``actor.format_warmup_lr``; RL then starts with fresh moments, and the reference
policy (KL) stays the original model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from starpo_jax.forward import ForwardPass, Rows, UpdateLayout, most_prompts_per_micro_batch, token_logprobs
from starpo_jax.rollout.multi_turn import (
    RolloutPlan,
    RolloutTables,
    concat_ids,
    first_prompts,
    initial_states_from_key,
)
from starpo_jax.rollout.sampling import DecodeOutput
from starpo_jax.runtime import distributed
from starpo_jax.runtime.settings import ConfigError, Hyperparams, TrainSettings
from starpo_jax.train import TrainState, accumulate_gradients, apply_update, optimizer, with_adapters


class AnswerPieces(flax.struct.PyTreeNode):
    """One env tag's answer pieces as token ids (host-built, a jit argument)."""

    opening: jax.Array  # int32[O]: what follows the forced prefix before the first name
    first: jax.Array  # int32[N, F]: each action name, padded
    first_length: jax.Array  # int32[N]
    later: jax.Array  # int32[N, S]: " || " + each action name, padded
    later_length: jax.Array  # int32[N]
    closing: jax.Array  # int32[C]: "</answer>" and the end of turn


def check_named_actions(plan: RolloutPlan) -> None:
    """Raise ``ConfigError`` for a tag whose env has no action names to draw answers from."""
    for tag in plan.tags:
        if not tag.env.action_names:
            raise ConfigError(f"actor.format_warmup_steps needs envs whose actions are named; {tag.name} answers in "
                              "free text (no action_names): set actor.format_warmup_steps=0.")


def answer_pieces(tokenizer, plan: RolloutPlan, tables: RolloutTables) -> tuple[AnswerPieces, ...]:
    """Every tag's pieces, tokenized once (``check_named_actions`` first)."""
    check_named_actions(plan)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    out = []
    for tag, tag_tables in zip(plan.tags, tables.tags):
        names = tag.env.action_names
        opening = "</think><answer>" if plan.enable_think else ""  # after the forced "<think>" / "<answer>"
        first, later = _padded([encode(n) for n in names]), _padded([encode(" || " + n) for n in names])
        out.append(AnswerPieces(
            opening=jnp.asarray(encode(opening), jnp.int32).reshape(-1),
            first=first[0], first_length=first[1], later=later[0], later_length=later[1],
            closing=jnp.asarray(encode("</answer>") + [tag_tables.prompts.stop_token_id], jnp.int32),
        ))
    return tuple(out)


def _padded(ids: list[list[int]]) -> tuple[jax.Array, jax.Array]:
    width = max(map(len, ids))
    return (jnp.asarray([i + [0] * (width - len(i)) for i in ids], jnp.int32),
            jnp.asarray([len(i) for i in ids], jnp.int32))


def answer_width(pieces: AnswerPieces, max_actions: int) -> int:
    """The most tokens an answer of ``max_actions`` actions can take (static)."""
    return (pieces.opening.shape[0] + pieces.first.shape[1] + (max_actions - 1) * pieces.later.shape[1]
            + pieces.closing.shape[0])


def _write(buffer, offset, piece, length):
    """``buffer`` [n, W] with ``piece[r, :length[r]]`` written at ``offset[r]``."""
    rows = jnp.arange(buffer.shape[0])[:, None]
    at = offset[:, None] + jnp.arange(piece.shape[1])[None]
    at = jnp.where(jnp.arange(piece.shape[1])[None] < length[:, None], at, buffer.shape[1])  # past the end: dropped
    return buffer.at[rows, at].set(piece, mode="drop"), offset + length


def random_answers(pieces: AnswerPieces, name_ids, max_actions: int, key, pad_id: int):
    """``(tokens int32[n, W], lengths int32[n])``: per row 1..``max_actions`` actions drawn uniformly
    from the episode's action ids (``name_ids`` int32[n, A]: their names' indices), as answer tokens."""
    n, num_actions = name_ids.shape
    count_key, pick_key = jax.random.split(key)
    count = jax.random.randint(count_key, (n,), 1, max_actions + 1)
    names = jnp.take_along_axis(name_ids, jax.random.randint(pick_key, (n, max_actions), 0, num_actions), axis=1)
    return compose_answers(pieces, names, count, pad_id)


def compose_answers(pieces: AnswerPieces, names, count, pad_id: int):
    """``(tokens int32[n, W], lengths int32[n])``: each row's first ``count`` action names (``names``
    int32[n, K], indices into the env's action names) written as an answer."""
    n, max_actions = names.shape
    tokens = jnp.full((n, answer_width(pieces, max_actions)), pad_id, jnp.int32)
    whole = lambda piece: (jnp.broadcast_to(piece, (n,) + piece.shape), jnp.full((n,), piece.shape[0]))  # noqa: E731
    tokens, offset = _write(tokens, jnp.zeros((n,), jnp.int32), *whole(pieces.opening))
    for slot in range(max_actions):
        table, length = (pieces.first, pieces.first_length) if slot == 0 else (pieces.later, pieces.later_length)
        tokens, offset = _write(tokens, offset, table[names[:, slot]],
                                jnp.where(slot < count, length[names[:, slot]], 0))
    tokens, offset = _write(tokens, offset, *whole(pieces.closing))
    return tokens, offset


@dataclasses.dataclass(frozen=True)
class RandomAnswers:
    """A rollout responder (``multi_turn.make_rollout``) that answers every turn as the warm-up's
    examples do: 1 to ``max_actions_per_turn`` uniformly random valid actions, the model and the
    board unread. Its success is what a policy that does not read the board scores by chance, the
    baseline ``experiments.evaluate --policy random-valid`` measures on the fixed levels. Action ids
    are drawn uniformly, so an episode's order of names (``action_name_ids``) does not matter."""

    plan: RolloutPlan
    pieces: tuple[AnswerPieces, ...]  # ``answer_pieces`` of the plan's tags

    def __post_init__(self):
        widest = max(answer_width(p, self.plan.max_actions_per_turn) for p in self.pieces)
        if widest > self.plan.response_length:
            raise ConfigError(f"A random answer takes up to {widest} tokens; raise rollout.response_length "
                              f"({self.plan.response_length}) to at least that.")

    def init(self, model, batch_size: int):
        return jnp.zeros((), jnp.int32)  # no cache: nothing is read

    def respond(self, model, cache, prompt_ids, num_new, key, temperature, active, turn):
        plan = self.plan
        answers = []
        for t, (tag, pieces) in enumerate(zip(plan.tags, self.pieces)):
            rows, names = tag.n_groups * plan.group_size, len(tag.env.action_names)
            ids = jnp.broadcast_to(jnp.arange(names, dtype=jnp.int32), (rows, names))
            answers.append(random_answers(pieces, ids, plan.max_actions_per_turn, jax.random.fold_in(key, t), plan.pad_id))
        tokens, lengths = concat_ids(answers, plan.pad_id)
        return DecodeOutput(tokens=tokens, logprobs=jnp.zeros(tokens.shape, jnp.float32),
                            lengths=jnp.where(active, lengths, 0), cache=cache, last_logits=None)


class AnswerBatch(NamedTuple):
    """Fresh levels' first prompts, each followed by a random valid answer."""

    tokens: jax.Array  # int32[B, P + W]: the prompt in the first P slots, then the answer
    length: jax.Array  # int32[B]
    split: jax.Array  # int32[B]: the prompt's last token (``forward.first_prompt_split``)
    mask: jax.Array  # bool[B, P + W]: the answer's tokens, what the loss reads


def warmup_batch(plan: RolloutPlan, tables: RolloutTables, pieces: tuple[AnswerPieces, ...], key) -> AnswerBatch:
    """A batch of ``plan``'s rows: fresh levels (one per group), first prompts, random answers."""
    level_key, answer_key = jax.random.split(key)
    states = initial_states_from_key(plan, level_key)
    answers = concat_ids([
        random_answers(tag_pieces, jax.vmap(tag.env.action_name_ids)(tag_states).astype(jnp.int32),
                       plan.max_actions_per_turn, jax.random.fold_in(answer_key, t), plan.pad_id)
        for t, (tag, tag_pieces, tag_states) in enumerate(zip(plan.tags, pieces, states))
    ], plan.pad_id)
    return answer_batch(plan, tables, states, *answers)


def answer_batch(plan: RolloutPlan, tables: RolloutTables, states, answers, answer_len) -> AnswerBatch:
    """The first prompts of ``states`` (per tag, as the rollout holds them), each followed by its
    answer (``answers`` int32[B, W], ``answer_len`` int32[B]: ``compose_answers``')."""
    prompt_ids, prompt_len = first_prompts(plan, tables, states)
    B, P = prompt_ids.shape
    width = answers.shape[1]
    tokens = jnp.full((B, P + width), plan.pad_id, jnp.int32).at[:, :P].set(prompt_ids)
    tokens, length = _write(tokens, prompt_len, answers, answer_len)
    positions = jnp.arange(P + width)[None]
    return AnswerBatch(tokens, length, prompt_len - 1, (positions >= prompt_len[:, None]) & (positions < length[:, None]))


def warmup_step(settings: TrainSettings, graphdef, plan: RolloutPlan, trained, base, opt_state, tables, pieces, key,
                lr):
    """One supervised step on a fresh batch: (trained weights, optimiser state, metrics)."""
    answers = max(answer_width(p, plan.max_actions_per_turn) for p in pieces)
    batch = warmup_batch(plan, tables, pieces, key)
    return supervised_step(settings, graphdef, plan.group_size, answers, trained, base, opt_state, batch, lr)


def supervised_step(settings: TrainSettings, graphdef, group_size: int, answer_width: int, trained, base, opt_state,
                    batch: AnswerBatch, lr):
    """One step of supervised learning on ``batch``'s answers, whose rows come in blocks of
    ``group_size`` that share a prompt: (trained weights, optimiser state, metrics)."""
    micro = math.gcd(settings.micro_batch_size, batch.tokens.shape[0])
    # As the update computes its rows: each group's prompt once, and from each prompt's last token on
    # only the answer's width.
    layout = UpdateLayout(prefix=batch.tokens.shape[1] - answer_width, width=answer_width + 1,
                          prompts=most_prompts_per_micro_batch(micro, group_size))
    ctx = ForwardPass(graphdef, layout, answer_width, settings.logprob_chunk, 1.0)

    def loss_fn(trained, b: AnswerBatch, hyper):
        rows = Rows(b.tokens, b.length, b.split, b.mask)
        logp, _ = token_logprobs(ctx, with_adapters(settings, base, trained), rows)
        nll = -jnp.sum(jnp.where(b.mask, logp, 0.0)) / jnp.maximum(b.mask.sum(), 1)
        return nll, {"format_warmup/nll": nll}

    batches = jax.tree.map(lambda x: x.reshape((-1, micro) + x.shape[1:]), batch)
    grads, metrics, live = accumulate_gradients(loss_fn, trained, batches, Hyperparams.create())
    trained, opt_state, grad_norm, _ = apply_update(optimizer(settings, "actor"), trained, opt_state, grads, lr, live)
    return trained, opt_state, metrics | {"format_warmup/grad_norm": grad_norm}


def format_warmup(settings: TrainSettings, graphdef, plan: RolloutPlan, tables: RolloutTables, pieces, state: TrainState,
                  key, steps: int, lr: float, on_step=None) -> TrainState:
    """``steps`` warm-up steps on the actor of ``state`` (its optimiser state untouched; its actor
    weights are donated to the first step, so read only the returned state's); ``on_step(i,
    metrics)`` after each."""
    step = jax.jit(functools.partial(warmup_step, settings, graphdef, plan), donate_argnums=(0, 2))
    trained, opt_state = state.actor, optimizer(settings, "actor").init(state.actor)
    for i in range(steps):
        trained, opt_state, metrics = step(trained, state.base, opt_state, tables, pieces, jax.random.fold_in(key, i),
                                           jnp.float32(lr))
        if on_step is not None:
            on_step(i, {k: float(v) for k, v in distributed.to_host(metrics).items()})  # on every process
    return state.replace(actor=trained)
