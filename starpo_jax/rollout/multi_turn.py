"""The compiled multi-turn rollout of StarPO (ragen-reference.md §2.2-2.6): one jitted function per batch.

For every turn, inside one XLA program:

    prompt tokens (from tables) → append to the KV cache → decode → parse <answer> on token ids
    → step the envs (with action ids, or the answer text for language-action envs such as
    Countdown) → reward message and next observation as tokens → next turn

The KV cache of each row lives for the whole episode, so a turn only prefills what it appends.
Finished rows keep their slot and stop generating; from the second turn on, the rows still playing
are gathered into a quarter or a half of the batch where they fit (``on_live_rows``), so ended
episodes cost no compute; within a turn, the decode does the same with the rows still answering
(``sampling.decode``). Host Python never sees a token or a turn.

Batch layout (RAGEN's es_manager, ragen-reference.md §2.2): the env tags of ``RolloutPlan.tags`` in order, tag
``t`` owning ``n_groups[t] * group_size`` consecutive rows; row ``b`` belongs to group
``b // group_size``, and all rows of a group start from the same initial state.

Departures from the original, on purpose:

- **Token-in / token-out.** The trajectory is exactly the ids the model sampled, interleaved with
  the prompt ids the environment produced (which equal the tokenizer's encoding of RAGEN's
  chat-templated text, see ``starpo_jax.rollout.prompts``). RAGEN re-renders each response from the parse
  (``<think>{think}</think><answer>{answer}</answer>``, text outside the tags dropped) and re-encodes
  the whole conversation (quirk 4); we never decode and re-encode.
- **Loss mask = sampled tokens.** ``loss_mask`` marks exactly the tokens the policy generated
  (its stop token included). RAGEN's mask is shifted by one (quirk 3: it trains the assistant
  header and the next ``<|im_start|>`` but not the assistant's own ``<|im_start|>``).
- **Context budget.** A row whose next turn (prompt plus ``response_length``) would not fit in
  ``max_len`` tokens ends there, unsuccessful, and is flagged ``context_exhausted``; vLLM would
  have refused the request.
- A response cut by ``response_length`` is closed with the template's assistant end
  (``<|im_end|>\\n``), which is not in the loss mask.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Protocol, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from envs_jax.base import TextEnv
from starpo_jax.models.decoder import ModelState, batch_splits
from starpo_jax.rollout import parsing, prompts
from starpo_jax.rollout.env_turn import execute_turn
from starpo_jax.rollout.sampling import (
    MIN_LIVE_ROWS,
    DecodeOutput,
    append,
    decode,
    gather_local_rows,
    in_head,
    init_cache,
    live_batch_sizes,
    live_rows_of_each_shard,
    scatter_local_rows,
)
from starpo_jax.runtime import distributed, sharding
from starpo_jax.runtime.settings import setting_default


@dataclasses.dataclass(frozen=True)
class TagPlan:
    """One env tag's share of the batch (static)."""

    name: str
    env: TextEnv
    n_groups: int
    max_actions_per_traj: int


@dataclasses.dataclass(frozen=True)
class RolloutPlan:
    """Everything static about a rollout: shapes, budgets, sampling switches. A field with a
    config key takes its config default from settings.SETTINGS (``setting_default``)."""

    tags: tuple[TagPlan, ...]
    group_size: int
    max_turn: int = setting_default("RolloutPlan", "max_turn")
    max_actions_per_turn: int = setting_default("RolloutPlan", "max_actions_per_turn")
    response_length: int = setting_default("RolloutPlan", "response_length")  # max new tokens per turn
    # tokens per trajectory, all turns (rollout.max_model_len; ``fit_to_tables`` lowers it to what can be reached)
    max_len: int = setting_default("RolloutPlan", "max_len")
    enable_think: bool = setting_default("RolloutPlan", "enable_think")
    format_penalty: float = setting_default("RolloutPlan", "format_penalty")
    top_k: int = setting_default("RolloutPlan", "top_k")  # <= 0: no top-k filter
    top_p: float = setting_default("RolloutPlan", "top_p")
    stop_tokens: tuple[int, ...] = ()
    pad_id: int = 0
    # tokens every first prompt begins with, the tags' chat heads as far as they agree
    # (``shared_head``; 0: none known): the first turn prefills them once for the whole batch
    shared_head: int = 0

    @property
    def batch_size(self) -> int:
        return sum(t.n_groups for t in self.tags) * self.group_size

    @property
    def answer_width(self) -> int:
        """Bytes of answer text the parser keeps per piece: the widest language-action env's
        ``answer_width`` (0: every tag's actions are named)."""
        return max(t.env.answer_width for t in self.tags)

    @property
    def num_groups(self) -> int:
        return sum(t.n_groups for t in self.tags)

    def row_slices(self) -> list[slice]:
        out, start = [], 0
        for t in self.tags:
            stop = start + t.n_groups * self.group_size
            out.append(slice(start, stop))
            start = stop
        return out


class Trajectories(flax.struct.PyTreeNode):
    """One rollout batch: token sequences and what happened in each episode."""

    tokens: jax.Array  # int32[B, L] the whole conversation, padded with pad_id
    loss_mask: jax.Array  # bool[B, L] tokens the policy generated
    sampler_logprobs: jax.Array  # float32[B, L] log-prob of each generated token at sampling time
    length: jax.Array  # int32[B] tokens in the conversation
    turn_start: jax.Array  # int32[B, T] first response token of each turn
    turn_end: jax.Array  # int32[B, T] one past the last response token of each turn
    turn_played: jax.Array  # bool[B, T]
    turn_reward: jax.Array  # float32[B, T] env reward of each turn
    turn_penalised: jax.Array  # bool[B, T] the turn paid the format penalty
    env_reward: jax.Array  # float32[B] sum of env rewards
    format_penalty_sum: jax.Array  # float32[B] the penalties paid: format_penalty * turns penalised (<= 0)
    success: jax.Array  # bool[B] the env reported success when the episode ended
    num_actions: jax.Array  # int32[B] actions executed
    num_turns: jax.Array  # int32[B]
    action_is_effective: jax.Array  # float32[B] per-turn mean (RAGEN's metric, ragen-reference.md §2.2)
    action_is_valid: jax.Array  # float32[B] per-turn mean
    response_tokens: jax.Array  # int32[B] generated tokens over all turns
    think_tokens: jax.Array  # int32[B] tokens inside <think> over all turns (matched turns only)
    context_exhausted: jax.Array  # bool[B] ended because max_len could not hold another turn
    group_id: jax.Array  # int32[B]
    tag_id: jax.Array  # int32[B]
    action_name_ids: jax.Array  # int32[B, A] index into the tag env's action_names of each action id (-1: none)
    # uint32[B, T] the env's state_key of the state each turn starts from (0: not played); GiGPO's
    # step groups. Last, with a default, so that a batch made by hand without it stays valid.
    turn_state_key: jax.Array | None = None


class Responder(Protocol):
    """Who answers each turn: the policy sampling from its KV cache (``LLMResponder``), or a scripted
    answerer (``format_warmup.RandomAnswers``, tests). The rollout only calls these two."""

    def init(self, model: ModelState, batch_size: int):
        """The per-row state carried across turns (a KV cache, or anything the responder needs)."""

    def respond(self, model: ModelState, cache, prompt_ids, num_new, key, temperature, active, turn) -> DecodeOutput:
        """This turn's responses after reading ``num_new[b]`` new prompt tokens of ``prompt_ids[b]``;
        rows not ``active`` answer nothing. ``turn`` is 0-based (a Python int on the first turn)."""
        ...


# ---- the rollout ---------------------------------------------------------------------------------
#
# ``rollout`` plays turn 1, scans the others and packs the ``Trajectories``. One turn is
# ``play_turn``: ``turn_rows`` (who plays) → ``sample_turn`` (the responder answers) → ``write_turn``
# (prompt and response into the token buffers) → ``parse_turn`` (the answers, on token ids) →
# ``step_envs`` (the actions, in the envs) → ``next_prompts`` (reward message and next observation as
# tokens) → a new ``_Carry`` and the turn's record. Each is a pure function of the frozen
# ``RolloutPlan`` and arrays.


def make_rollout(plan: RolloutPlan, responder: Responder | None = None):
    """Returns ``rollout(model, tables, init_states, key, temperature) -> Trajectories`` (jitted).

    ``responder`` produces each turn's responses (default: ``LLMResponder``, the model sampling
    from its KV cache); tests pass a scripted one.
    """
    return jax.jit(functools.partial(rollout, plan, responder or LLMResponder(plan)))


def chunked_rollout(
    plan: RolloutPlan, chunks: int, responder: Responder | None = None, first_prompts: int | None = None
):
    """``make_rollout(plan)``'s function, run as ``chunks`` calls of one compiled program, each on
    1/chunks of every tag's groups (validation on many levels in a fraction of the memory: the KV
    cache is the rollout's largest buffer). Returns the same batch, rows in the plan's order; chunk
    ``i`` samples with ``fold_in(key, i)`` (one chunk: ``key`` itself). ``first_prompts``: distinct
    first prompts in the whole batch, at most (``distinct_first_prompts``; default one per group).
    The returned function's ``progress``, if given, is called as each chunk finishes (a progress
    bar's ``update``): it waits for each chunk, which the chunks' one device does anyway."""
    part = chunk_plan(plan, chunks)
    run_part = make_rollout(part, responder or LLMResponder(part, first_prompts=first_prompts))
    rows = [sl.stop - sl.start for sl in part.row_slices()]

    def chunk_states(init_states, i):
        return tuple(jax.tree.map(lambda x, n=n: x[i * n:(i + 1) * n], s) for s, n in zip(init_states, rows))

    def one_chunk(model, tables, init_states, key, temperature, i, progress):
        traj = run_part(model, tables, chunk_states(init_states, i), key if chunks == 1 else jax.random.fold_in(key, i),
                        temperature)
        if progress is not None:
            jax.block_until_ready(traj)
            progress(1)
        return traj

    def run(model, tables, init_states, key, temperature, progress=None) -> Trajectories:
        parts = [one_chunk(model, tables, init_states, key, temperature, i, progress) for i in range(chunks)]
        if chunks == 1:
            return parts[0]
        # tag by tag, each tag's rows from every chunk in order: the plan's row order
        pieces = [jax.tree.map(lambda x, sl=sl: x[sl], p) for sl in part.row_slices() for p in parts]
        merged = jax.tree.map(lambda *xs: jnp.concatenate(xs), *pieces)
        return merged.replace(group_id=jnp.arange(plan.batch_size, dtype=jnp.int32) // plan.group_size)

    return run


def chunk_plan(plan: RolloutPlan, chunks: int) -> RolloutPlan:
    """The plan of one of ``chunks`` calls: 1/chunks of every tag's groups (what a responder other
    than the policy is built for, in a chunked rollout)."""
    if any(t.n_groups % chunks for t in plan.tags):
        raise ValueError(f"Every tag's group count ({[t.n_groups for t in plan.tags]}) must split into {chunks} chunks.")
    return dataclasses.replace(plan, tags=tuple(dataclasses.replace(t, n_groups=t.n_groups // chunks) for t in plan.tags))


def rollout(plan: RolloutPlan, responder: Responder, model: ModelState, tables: RolloutTables, init_states: tuple, key,
            temperature) -> Trajectories:
    """Every episode of the batch, ``plan.max_turn`` turns at most (traced as one program)."""
    carry = initial_carry(plan, responder, model, tables, init_states)
    # Turn 1 has its own (long) prompt width; later turns share one, so they run in a scan.
    carry, first = play_turn(plan, responder, model, tables, key, temperature, 0, carry)
    if plan.max_turn > 1:
        def body(c, turn):
            return play_turn(plan, responder, model, tables, key, temperature, turn, c)

        carry, rest = jax.lax.scan(body, carry, jnp.arange(1, plan.max_turn))
        records = jax.tree.map(lambda a, b: jnp.concatenate([a[None], b]), first, rest)
    else:
        records = jax.tree.map(lambda a: a[None], first)
    return pack_trajectories(plan, init_states, carry, records)


def _starts_at_zero(dtype, per_position: bool = False) -> dict:
    """The metadata of a carry field that starts as zeros of ``dtype``, one per row (``[B]``) or per
    row and position (``[B, max_len]``); ``initial_carry`` makes them all."""
    return {"zeros": (dtype, per_position)}


class _Carry(flax.struct.PyTreeNode):
    """What a turn passes to the next. A field named as one of ``Trajectories`` becomes that field
    when the rollout ends (``pack_trajectories``)."""

    tokens: jax.Array  # pad_id until written
    loss_mask: jax.Array = flax.struct.field(metadata=_starts_at_zero(bool, per_position=True))
    sampler_logprobs: jax.Array = flax.struct.field(metadata=_starts_at_zero(jnp.float32, per_position=True))
    length: jax.Array = flax.struct.field(metadata=_starts_at_zero(jnp.int32))
    cache: object
    env_states: tuple
    done: jax.Array = flax.struct.field(metadata=_starts_at_zero(bool))
    success: jax.Array = flax.struct.field(metadata=_starts_at_zero(bool))
    num_actions: jax.Array = flax.struct.field(metadata=_starts_at_zero(jnp.int32))
    num_turns: jax.Array = flax.struct.field(metadata=_starts_at_zero(jnp.int32))
    effective_sum: jax.Array = flax.struct.field(metadata=_starts_at_zero(jnp.int32))
    valid_sum: jax.Array = flax.struct.field(metadata=_starts_at_zero(jnp.int32))
    response_tokens: jax.Array = flax.struct.field(metadata=_starts_at_zero(jnp.int32))
    think_tokens: jax.Array = flax.struct.field(metadata=_starts_at_zero(jnp.int32))
    context_exhausted: jax.Array = flax.struct.field(metadata=_starts_at_zero(bool))
    prompt_ids: jax.Array  # the next turn's prompt
    prompt_len: jax.Array


def initial_carry(plan: RolloutPlan, responder: Responder, model, tables: RolloutTables, init_states) -> _Carry:
    """Empty buffers, a fresh cache, the initial env states and the first prompts."""
    B = plan.batch_size
    first_ids, first_len = first_prompts(plan, tables, init_states)
    zeros = {}
    for field in dataclasses.fields(_Carry):
        if "zeros" in field.metadata:
            dtype, per_position = field.metadata["zeros"]
            zeros[field.name] = jnp.zeros((B, plan.max_len) if per_position else (B,), dtype)
    return _Carry(
        tokens=jnp.full((B, plan.max_len), plan.pad_id, jnp.int32),
        cache=responder.init(model, B),
        env_states=tuple(init_states),
        prompt_ids=first_ids,
        prompt_len=first_len,
        **zeros,
    )


def play_turn(plan: RolloutPlan, responder: Responder, model, tables: RolloutTables, key, temperature, turn, c: _Carry):
    """One turn for every row still playing: ``(carry, record)``; ``turn`` is 0-based."""
    active, exhausted = turn_rows(plan, c)
    out, n_new, n_out = sample_turn(responder, model, c, active, key, temperature, turn)
    tokens, loss_mask, logprobs, start, end = write_turn(c, out, n_new, n_out)
    parsed, ended_with_stop = parse_turn(plan, tables, c.env_states, out.tokens, n_out)

    budget = _per_row(plan, [t.max_actions_per_traj for t in plan.tags])  # actions per trajectory
    actions_left = budget - c.num_actions
    env_states, res = step_envs(plan, tables, c.env_states, parsed, actions_left, active)
    prompt_ids, prompt_len = next_prompts(
        plan, tables, env_states, res, actions_left - res.num_executed, ended_with_stop, turn
    )

    num_actions = c.num_actions + res.num_executed
    finished = active & (res.env_done | (num_actions >= budget))
    record = dict(  # the Trajectories' per-turn fields, one turn of each
        turn_start=jnp.where(active, start, 0),
        turn_end=jnp.where(active, end, 0),
        turn_played=active,
        turn_reward=jnp.where(active, res.reward, 0.0),
        turn_penalised=active & parsed.format_error,
        turn_state_key=jnp.where(active, state_keys(plan, c.env_states), jnp.uint32(0)),
    )
    carry = _Carry(
        tokens=tokens,
        loss_mask=loss_mask,
        sampler_logprobs=logprobs,
        length=end,
        cache=out.cache,
        env_states=env_states,
        done=c.done | finished | exhausted,
        success=c.success | (finished & res.env_done & res.success),
        num_actions=num_actions,
        num_turns=c.num_turns + active,
        effective_sum=c.effective_sum + (active & res.effective),
        valid_sum=c.valid_sum + (active & res.valid),
        response_tokens=c.response_tokens + n_out,
        think_tokens=c.think_tokens + jnp.where(active, jnp.maximum(parsed.think_tokens, 0), 0),
        context_exhausted=c.context_exhausted | exhausted,
        prompt_ids=prompt_ids,
        prompt_len=prompt_len,
    )
    return carry, record


def turn_rows(plan: RolloutPlan, c: _Carry):
    """``(active, exhausted)`` bool[B]: rows that play this turn, and rows that end now because the
    prompt plus a full response would not fit in ``max_len``."""
    fits = c.length + c.prompt_len + plan.response_length <= plan.max_len
    return ~c.done & fits, ~c.done & ~fits


def sample_turn(responder: Responder, model, c: _Carry, active, key, temperature, turn):
    """``(out, n_new, n_out)``: the responder's ``DecodeOutput`` after reading this turn's prompt,
    the prompt tokens appended and the response tokens kept per row (0 for inactive rows)."""
    n_new = jnp.where(active, c.prompt_len, 0)
    out = responder.respond(model, c.cache, c.prompt_ids, n_new, jax.random.fold_in(key, turn), temperature, active, turn)
    return out, n_new, jnp.where(active, out.lengths, 0)


def write_turn(c: _Carry, out, n_new, n_out):
    """The prompt then the response appended to each row's buffers: ``(tokens, loss_mask,
    logprobs, start, end)``, ``[start, end)`` being the response's positions."""
    tokens = _write(c.tokens, c.length, c.prompt_ids, n_new)
    start = c.length + n_new
    tokens = _write(tokens, start, out.tokens, n_out)
    loss_mask = _write(c.loss_mask, start, jnp.ones_like(out.tokens, bool), n_out)
    logprobs = _write(c.sampler_logprobs, start, out.logprobs, n_out)
    return tokens, loss_mask, logprobs, start, start + n_out


def parse_turn(plan: RolloutPlan, tables: RolloutTables, env_states, response_ids, n_out):
    """``(ParseResult, ended_with_stop bool[B])``: each row's answer parsed on token ids against
    its own action names (and its pieces' text if a tag takes language actions), and whether the
    response ended with the end-of-turn token (a cut one did not; its prompt closes it)."""
    parser_tables = parsing.ParserTables(tables.token_bytes, tables.token_lengths, row_action_names(plan, tables, env_states))
    in_response = jnp.arange(response_ids.shape[1])[None] < n_out[:, None]
    parsed = parsing.parse_response_tokens(
        parser_tables, response_ids, in_response, plan.max_actions_per_turn, plan.enable_think, plan.answer_width
    )
    if plan.answer_width:  # a language-action row's pieces are all its actions: an error is having none
        language = _per_row(plan, [t.env.answer_width > 0 for t in plan.tags]).astype(bool)
        parsed = parsed.replace(format_error=jnp.where(language, parsed.n_kept == 0, parsed.format_error))
    last_token = jnp.take_along_axis(response_ids, jnp.maximum(n_out - 1, 0)[:, None], axis=1)[:, 0]
    ended_with_stop = (n_out > 0) & (last_token == tables.tags[0].prompts.stop_token_id)
    return parsed, ended_with_stop


def step_envs(plan: RolloutPlan, tables: RolloutTables, env_states, parsed, actions_left, active):
    """``(new_states, TurnResult[B])``: every active row's env stepped through its valid actions,
    within ``actions_left`` (``starpo_jax.rollout.env_turn.execute_turn``), tag by tag. Named actions are
    action ids; a language-action env gets each answer piece's bytes ``(uint8[W], length)``."""
    new_states, results = [], []
    for tag, tag_tables, states, sl in zip(plan.tags, tables.tags, env_states, plan.row_slices()):
        width = tag.env.answer_width
        actions: jax.Array | tuple[jax.Array, jax.Array]  # answer bytes and lengths, or action ids
        if width:
            actions = (parsed.answers.bytes[sl, :, :width], jnp.minimum(parsed.answers.lengths[sl], width))
            n_actions = parsed.n_kept[sl]
        else:
            actions, n_actions = jnp.maximum(parsed.valid_action_ids[sl], 0), parsed.n_valid[sl]
        step = jax.vmap(execute_turn, in_axes=(None, 0, 0, 0, 0, 0, None))
        state, res = step(
            tag.env, states, actions, n_actions, actions_left[sl], active[sl], tag_tables.prompts.reward_values,
        )
        new_states.append(state)
        results.append(res)
    return tuple(new_states), _concat_rows(results)


def next_prompts(plan: RolloutPlan, tables: RolloutTables, env_states, res, actions_left, ended_with_stop, turn):
    """``(ids int32[B, P], lengths int32[B])``: the next user turn of every row (the reward message
    of turn ``turn``, 0-based, then the observation and the actions left after it)."""
    outs = []
    for tag, tag_tables, states, sl in zip(plan.tags, tables.tags, env_states, plan.row_slices()):
        obs = jax.vmap(tag.env.observation_pieces)(states)
        outs.append(jax.vmap(prompts.next_turn_tokens, in_axes=(None, 0, None, 0, 0, 0))(
            tag_tables.prompts, res.reward_index[sl], turn + 2, obs, actions_left[sl], ended_with_stop[sl]
        ))
    return concat_ids(outs, plan.pad_id)


# The carry's fields that the trajectories keep as they are, under the same names.
_KEPT_FROM_CARRY = tuple(
    f.name for f in dataclasses.fields(_Carry) if f.name in {t.name for t in dataclasses.fields(Trajectories)}
)


def pack_trajectories(plan: RolloutPlan, init_states, carry: _Carry, records) -> Trajectories:
    """The finished episodes: the last carry, and the turns' records stacked as ``[T, B]`` (each
    ``play_turn`` record is named as the ``Trajectories`` field it fills)."""
    B = plan.batch_size
    rec = jax.tree.map(lambda x: x.T, records)  # [B, T]
    turns = jnp.maximum(carry.num_turns, 1)
    return Trajectories(
        **{name: getattr(carry, name) for name in _KEPT_FROM_CARRY},
        **rec,
        env_reward=jnp.sum(rec["turn_reward"], axis=1),
        format_penalty_sum=plan.format_penalty * jnp.sum(rec["turn_penalised"], axis=1).astype(jnp.float32),
        action_is_effective=carry.effective_sum / turns,
        action_is_valid=carry.valid_sum / turns,
        group_id=jnp.arange(B, dtype=jnp.int32) // plan.group_size,
        tag_id=_per_row(plan, range(len(plan.tags))),
        action_name_ids=jnp.concatenate(
            [action_name_ids(plan, t, s, pad=-1) for t, s in zip(plan.tags, init_states)]
        ),
    )


def first_prompts(plan: RolloutPlan, tables: RolloutTables, env_states):
    """``(ids int32[B, P], lengths int32[B])``: the first user turn of every row (system prompt,
    instruction, first observation, generation prompt)."""
    outs = []
    for tag, tag_tables, states in zip(plan.tags, tables.tags, env_states):
        obs = jax.vmap(tag.env.observation_pieces)(states)
        left = jnp.full(obs.shape[:1], tag.max_actions_per_traj, jnp.int32)
        outs.append(jax.vmap(prompts.first_prompt_tokens, in_axes=(None, 0, 0))(tag_tables.prompts, obs, left))
    return concat_ids(outs, plan.pad_id)


def state_keys(plan: RolloutPlan, env_states) -> jax.Array:
    """uint32[B]: each row's ``TextEnv.state_key`` of its env state, tag by tag."""
    return jnp.concatenate(
        [jax.vmap(tag.env.state_key)(states).astype(jnp.uint32) for tag, states in zip(plan.tags, env_states)]
    )


def row_action_names(plan: RolloutPlan, tables: RolloutTables, env_states) -> parsing.ActionNames:
    """Each row's action names in action-id order, [B, A, L] (padded with the empty name)."""
    outs = []
    for tag, tag_tables, states in zip(plan.tags, tables.tags, env_states):
        ids = action_name_ids(plan, tag, states, pad=len(tag.env.action_names))
        outs.append(jax.tree.map(lambda x: x[ids], tag_tables.names))
    return _concat_rows(outs)


def action_name_ids(plan: RolloutPlan, tag: TagPlan, states, pad: int) -> jax.Array:
    """int32[rows, A]: the tag's action-name index of each action id, ``pad`` past the tag's own
    actions (``A``: the action ids of the plan's widest tag)."""
    num_actions = max(max(t.env.num_actions for t in plan.tags), 1)  # >= 1: the parser needs a name
    ids = jax.vmap(tag.env.action_name_ids)(states).astype(jnp.int32)
    return jnp.pad(ids, ((0, 0), (0, num_actions - ids.shape[1])), constant_values=pad)


# ---- row helpers ---------------------------------------------------------------------------------


def _pad_to(ids, width: int, pad_id: int):
    return jnp.pad(ids, ((0, 0), (0, width - ids.shape[1])), constant_values=pad_id)


def _per_row(plan: RolloutPlan, per_tag_values) -> jax.Array:
    """int32[B]: each tag's value repeated over that tag's rows."""
    return jnp.concatenate(
        [jnp.full((sl.stop - sl.start,), v, jnp.int32) for v, sl in zip(per_tag_values, plan.row_slices())]
    )


def concat_ids(outs, pad_id):
    """``(ids, lengths)`` of several tags' rows, one after the other: ``outs`` a list of ``(ids
    int32[n, W_t], lengths int32[n])``, the ids padded with ``pad_id`` to the widest."""
    width = max(ids.shape[1] for ids, _ in outs)
    ids = jnp.concatenate([_pad_to(ids, width, pad_id) for ids, _ in outs])
    return ids, jnp.concatenate([n for _, n in outs])


def _concat_rows(trees):
    """The per-tag pytrees of a turn joined along the batch (tags own consecutive rows)."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs), *trees)


def _write(buffer, offsets, values, count):
    """buffer[b, offsets[b] + j] = values[b, j] for j < count[b]; other writes are dropped."""
    W = values.shape[1]
    cols = offsets[:, None] + jnp.arange(W)[None]
    cols = jnp.where(jnp.arange(W)[None] < count[:, None], cols, buffer.shape[1])  # out of range
    return sharding.scatter_rows(buffer, cols, values)


# ---- the policy as responder ---------------------------------------------------------------------

def on_live_rows(respond, min_rows: int, pad_id: int, active, model, cache, prompt_ids, num_new, key,
                 temperature) -> DecodeOutput:
    """``respond(model, cache, prompt_ids, num_new, key, temperature, active, rows, of_rows)`` on
    the rows still playing only: each device's ``active`` rows gathered into the smallest of
    ``live_batch_sizes`` that holds them (one ``lax.switch``), their cache rows too, and the
    outputs scattered back. Ended episodes keep their rows, and once the first turns end many
    episodes, computing them is most of a later turn's work. The rows sample what they would in
    the whole batch (``rows`` names them); a row not playing answers nothing (``pad_id``), its
    cache untouched.

    Rows are gathered within each device's share of the batch (``[shards, rows]``, a batched
    gather), so a row-sharded batch moves no row between devices."""
    B = active.shape[0]
    shards = batch_splits()
    per = B // shards
    sizes = live_batch_sizes(per, min_rows)

    def in_batch_of(size: int):
        def run(cache):
            if size == per:
                return respond(model, cache, prompt_ids, num_new, key, temperature, active)
            # each shard's playing rows, padded with the index ``per`` (no row: gathered as the
            # shard's last, kept inactive, dropped when scattered back)
            local = live_rows_of_each_shard(active, shards, size)
            live = (local < per).reshape(-1)
            take = functools.partial(gather_local_rows, local)
            row_ids = take(jnp.arange(B, dtype=jnp.int32))
            temp = temperature if jnp.ndim(temperature) == 0 else take(temperature)
            out = respond(model, jax.tree.map(take, cache), take(prompt_ids), jnp.where(live, take(num_new), 0), key,
                          temp, live, row_ids, B)
            put = functools.partial(scatter_local_rows, local)

            def spread(rows, fill=0):  # the gathered rows back in a batch of B, ``fill`` elsewhere
                return put(jnp.full((B,) + rows.shape[1:], fill, rows.dtype), rows)

            return DecodeOutput(tokens=spread(out.tokens, pad_id), logprobs=spread(out.logprobs),
                                lengths=spread(out.lengths), cache=jax.tree.map(put, cache, out.cache),
                                last_logits=spread(out.last_logits))

        return run

    if len(sizes) == 1:
        return in_batch_of(per)(cache)
    most_live = jnp.max(jnp.sum(active.reshape(shards, per), axis=1))
    return jax.lax.switch(jnp.searchsorted(jnp.asarray(sizes), most_live), [in_batch_of(n) for n in sizes], cache)


@dataclasses.dataclass(frozen=True)
class LLMResponder:
    """The policy's side of a turn: append the prompt to the KV cache, then sample a response.

    ``fixed_length`` (benchmarks): every response is exactly that many sampled tokens, stop tokens
    ignored, as if each turn ended there; the plan's ``response_length`` still sizes the context
    budget and the update. A fixed workload for random weights, which never stop on their own.

    ``first_prompts``: at most this many distinct first prompts in a batch, counted on the host for
    fixed levels (``distinct_first_prompts``). By default one per group, since a group's rows start
    from the same level, and the first turn counts them in its program: sampled levels may repeat a
    prompt (the Bandit's show two). The first turn prefills each distinct prompt once.

    ``min_live_rows``: later turns run on the rows still playing (``on_live_rows``), and a decode
    goes on with the rows still answering (``sampling.decode``), in batches of no fewer than this
    many rows per device.
    """

    plan: RolloutPlan
    fixed_length: int | None = None
    first_prompts: int | None = None
    min_live_rows: int = MIN_LIVE_ROWS

    def init(self, model: ModelState, batch_size: int):
        return init_cache(model.merge().config, batch_size, self.plan.max_len)

    def respond(self, model, cache, prompt_ids, num_new, key, temperature, active, turn):
        """Returns ``DecodeOutput`` (tokens, logprobs, lengths, cache) of this turn's responses."""
        if isinstance(turn, int) and turn == 0:
            return self.first_turn(model, cache, prompt_ids, num_new, key, temperature, active)
        return on_live_rows(self.append_and_sample, self.min_live_rows, self.plan.pad_id, active,
                            model, cache, prompt_ids, num_new, key, temperature)

    def first_turn(self, model, cache, prompt_ids, num_new, key, temperature, active):
        """The first turn in the head of the cache it can reach: the first prompts' width plus the
        token budget (a static size). The cache is sized for the last turn, and each decode step's
        attention reads every slot it is given, so the first turn runs in its head (FrozenLake's
        preset: 313 of 640 slots), which is then written back into the whole cache once."""
        def prefill_and_sample(head):
            head, logits = self.prefill_first_prompts(model, prompt_ids, num_new, head)
            out = self.sample(model, head, logits, key, temperature, active)
            return out.cache, out

        reach = prompt_ids.shape[1] + (self.fixed_length or self.plan.response_length)
        cache, out = in_head(prefill_and_sample, cache, reach)
        return out.replace(cache=cache)

    def append_and_sample(self, model, cache, prompt_ids, num_new, key, temperature, active, rows=None, of_rows=0):
        """A later turn: the prompt appended to the cache, then the response sampled (``rows``,
        ``of_rows``: as ``decode``'s)."""
        cache, logits = append(model, cache, prompt_ids, num_new)
        return self.sample(model, cache, logits, key, temperature, active, rows, of_rows)

    def sample(self, model, cache, logits, key, temperature, active, rows=None, of_rows=0):
        plan = self.plan
        stops = (-1,) if self.fixed_length else plan.stop_tokens or (-1,)
        return decode(
            model, cache, logits, key,
            max_new_tokens=self.fixed_length or plan.response_length, temperature=temperature, top_k=plan.top_k,
            top_p=plan.top_p, stop_tokens=jnp.asarray(stops, jnp.int32), active=active, pad_id=plan.pad_id,
            rows=rows, of_rows=of_rows, min_live_rows=self.min_live_rows,
        )


    def prefill_first_prompts(self, model, prompt_ids, num_new, cache):
        """The first turn's prefill, once per distinct first prompt: each is computed for one of its
        rows and its keys, values and logits gathered to every row that reads it. A group's rows read
        the same prompt (the same level), and levels often repeat one (the Bandit's show two: its
        arms in either order), so this is most of the first turn's compute saved. The batch's
        distinct prompts of sampled levels are counted in the program, and the prefill runs in the
        smallest of ``prefill_batch_sizes`` that holds them (one ``lax.switch``), the head they all
        begin with computed once (``prefill``)."""
        count = self.first_prompts or self.plan.num_groups
        if count >= prompt_ids.shape[0]:
            return self.prefill(model, prompt_ids, num_new, cache.max_len)
        real = jnp.arange(prompt_ids.shape[1])[None] < num_new[:, None]
        distinct, leaders, inverse = jnp.unique(
            sharding.replicated(jnp.where(real, prompt_ids, -1)),
            axis=0, size=count, return_index=True, return_inverse=True, fill_value=-1,
        )
        inverse = inverse.reshape(-1)  # each row's prompt among ``distinct``, the first ones

        def in_batch_of(size: int):
            def run():
                lead = leaders[:size]
                once, logits = self.prefill(model, prompt_ids[lead], num_new[lead], cache.max_len)
                return once.copies(inverse), logits[inverse]
            return run

        sizes = (count,) if self.first_prompts else prefill_batch_sizes(count)
        if len(sizes) == 1:
            return in_batch_of(count)()
        found = jnp.sum(distinct[:, 0] >= 0)  # a padding row is all fill; a prompt's first token is real
        return jax.lax.switch(jnp.searchsorted(jnp.asarray(sizes), found), [in_batch_of(n) for n in sizes])

    def prefill(self, model, prompt_ids, num_new, max_len: int):
        """First prompts [R, W] prefilled into a fresh cache of ``max_len`` slots: the head every
        first prompt begins with (``plan.shared_head`` tokens: the system message and the env's
        instructions, most of a FrozenLake prompt) computed once and copied to every row, then each
        row's own tokens appended. The rows are one prefix group, so the CPU kernel reads the head
        once for a few of them."""
        config, rows, head = model.merge().config, prompt_ids.shape[0], self.plan.shared_head
        if not head:
            return append(model, init_cache(config, rows, max_len), prompt_ids, num_new)
        once, _ = append(model, init_cache(config, 1, max_len), prompt_ids[:1, :head], jnp.full((1,), head, jnp.int32))
        return append(model, once.copies(jnp.zeros(rows, jnp.int32)), prompt_ids[:, head:], num_new - head)


def prefill_batch_sizes(groups: int) -> tuple[int, ...]:
    """The batch sizes a first turn of ``groups`` sampled groups prefills its distinct prompts in,
    ascending: one per group, and a half, a quarter and an eighth of that where they divide it, 2 at
    least (the Bandit's two prompts). Each is a prefill compiled in the rollout, run when it holds
    them."""
    return tuple(sorted({groups} | {groups // d for d in (2, 4, 8) if groups % d == 0 and groups // d >= 2}))


def distinct_first_prompts(plan: RolloutPlan, tables: RolloutTables, init_states) -> int:
    """How many distinct first prompts a batch of fixed levels shows (host; validation): the
    ``first_prompts`` of an ``LLMResponder`` that plays them."""
    # on every process, wherever the current mesh put them
    ids, lengths = distributed.to_host(jax.jit(functools.partial(first_prompts, plan))(tables, init_states))
    return len(first_rows_of_distinct_prompts(ids, lengths))


def first_rows_of_distinct_prompts(ids, lengths) -> np.ndarray:
    """int [D], ascending: the first row of each distinct prompt among ``ids`` [B, W] (host), a
    row's prompt being its first ``lengths[b]`` tokens (what lies past them is not part of it)."""
    return np.sort(np.unique(_prompts(ids, lengths), axis=0, return_index=True)[1])


def distinct_prompt_of_rows(ids, lengths) -> np.ndarray:
    """int [B]: which of the distinct prompts among ``ids`` [B, W] each row reads (host; as
    ``first_rows_of_distinct_prompts`` reads them)."""
    return np.unique(_prompts(ids, lengths), axis=0, return_inverse=True)[1].reshape(-1)


def _prompts(ids, lengths) -> np.ndarray:
    """``ids`` with each row's tokens past its length -1."""
    ids, lengths = np.asarray(ids), np.asarray(lengths)
    return np.where(np.arange(ids.shape[1])[None] < lengths[:, None], ids, -1)


# ---- tables: built once on the host, read by every turn --------------------------------------------


class TagTables(flax.struct.PyTreeNode):
    prompts: prompts.PromptTables
    names: parsing.ActionNames  # [N + 1, L]: the env's action names, then an empty name (padding)


class RolloutTables(flax.struct.PyTreeNode):
    """Host-built lookup tables (prompt pieces, token bytes, action names); a jit argument."""

    tags: tuple[TagTables, ...]
    token_bytes: jax.Array
    token_lengths: jax.Array


def build_tables(
    tokenizer, plan: RolloutPlan, *, max_tokens: int = 100, legend_from_env_symbols=False, chat_template=None,
    vocab_size: int | None = None,
) -> RolloutTables:
    """Tokenise every prompt piece and action name of the plan's tags (host, once)."""
    tags = []
    max_name = max((len(n) for t in plan.tags for n in t.env.action_names), default=1)
    for tag in plan.tags:
        tables = prompts.PromptTables.build(
            tokenizer,
            tag.env,
            max_actions_per_traj=tag.max_actions_per_traj,
            max_actions_per_turn=plan.max_actions_per_turn,
            max_turn=plan.max_turn,
            max_tokens=max_tokens,
            enable_think=plan.enable_think,
            legend_from_env_symbols=legend_from_env_symbols,
            chat_template=chat_template,
        )
        tags.append(TagTables(tables, _names_with_empty(tag.env.action_names, max_name)))
    # vocab_size: the model's logit count, which may exceed the tokenizer's (Qwen2.5: 151,936 vs
    # 151,665); ids past the tokenizer add no text, as they decode to nothing on the host.
    token_bytes, token_lengths = parsing.build_token_bytes_table(tokenizer, vocab_size)
    return RolloutTables(tuple(tags), jnp.asarray(token_bytes), jnp.asarray(token_lengths))


def _names_with_empty(names: Sequence[str], width: int) -> parsing.ActionNames:
    """A tag's action names as [N + 1, width]; the last, empty name pads shorter action lists (an
    empty name never matches: an empty answer piece is dropped). A language-action env has only it."""
    if not names:
        return parsing.ActionNames(jnp.zeros((1, width), jnp.int32), jnp.zeros((1,), jnp.int32))
    encoded = parsing.encode_action_names(list(names), width)
    return parsing.ActionNames(
        jnp.pad(encoded.bytes, ((0, 1), (0, 0))), jnp.pad(encoded.lengths, ((0, 1),))
    )


def stop_tokens_for(tokenizer, tables: RolloutTables) -> tuple[int, ...]:
    """The chat template's end-of-turn token and the tokenizer's EOS (RAGEN: 151645, 151643)."""
    ids = {tables.tags[0].prompts.stop_token_id}
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    end_of_text = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    if isinstance(end_of_text, int) and end_of_text != tokenizer.unk_token_id:
        ids.add(end_of_text)
    return tuple(sorted(ids))


def shared_head(tables: RolloutTables) -> int:
    """How many tokens every first prompt of ``tables`` begins with: the tags' chat heads (system
    message, the env's instructions, "Turn 1:") as far as they agree (host). A first prompt is its
    tag's head, then the observation and the tail (``prompts.first_prompt_tokens``)."""
    heads = [np.asarray(t.prompts.head.ids[0, : int(t.prompts.head.lengths[0])]) for t in tables.tags]
    shortest = min(len(h) for h in heads)
    agree = np.all([h[:shortest] == heads[0][:shortest] for h in heads], axis=0)
    return int(shortest if agree.all() else np.argmin(agree))


def longest_trajectory(plan: RolloutPlan, tables: RolloutTables) -> int:
    """The most tokens a trajectory of ``plan`` can hold, whatever ``max_len``: the first prompt,
    ``max_turn - 1`` later prompts (each opens with the assistant end that closes a cut response)
    and ``max_turn`` full responses, at the widths of the prompt tables (the widest tag's)."""
    prompt_tokens = max(t.prompts.first_len + (plan.max_turn - 1) * t.prompts.next_len for t in tables.tags)
    return prompt_tokens + plan.max_turn * plan.response_length


def fit_to_tables(plan: RolloutPlan, tables: RolloutTables) -> RolloutPlan:
    """``plan`` with ``max_len`` lowered to ``longest_trajectory`` where that is less. The KV cache,
    the trajectory buffers and the update's widest rows are sized by it (Countdown: 648 tokens of
    RAGEN's 3,600). Nothing else changes: every turn that fits ``rollout.max_model_len`` fits
    ``longest_trajectory`` too, so the same rows play and ``context_exhausted`` is the same."""
    return dataclasses.replace(plan, max_len=min(plan.max_len, longest_trajectory(plan, tables)))


# ---- initial states ------------------------------------------------------------------------------


def repeat_groups(states, group_size: int):
    """[G, ...] group states -> [G * group_size, ...] row states (rows of a group are identical)."""
    return jax.tree.map(lambda x: jnp.repeat(x, group_size, axis=0), states)


def initial_states_from_key(plan: RolloutPlan, key) -> tuple:
    """Fresh procedurally generated levels, one per group (training)."""
    states = []
    for i, tag in enumerate(plan.tags):
        keys = jax.random.split(jax.random.fold_in(key, i), tag.n_groups)
        group_states, _ = jax.vmap(tag.env.reset)(keys)
        states.append(repeat_groups(group_states, plan.group_size))
    return tuple(states)


def initial_states_from_seeds(plan: RolloutPlan, first_seed: int) -> tuple:
    """RAGEN's levels for seeds ``first_seed, first_seed + 1, ...``, continuing across tags in group
    order (validation: seed 123 gives the paper's 256 fixed levels)."""
    states, seed = [], first_seed
    for tag in plan.tags:
        group_states = [tag.env.reset_from_seed(seed + g) for g in range(tag.n_groups)]
        seed += tag.n_groups
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *group_states)
        states.append(repeat_groups(stacked, plan.group_size))
    return tuple(states)
