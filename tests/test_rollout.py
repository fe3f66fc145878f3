"""The compiled rollout against a plain-Python reference of RAGEN's agent loop (ragen-reference.md §2.2-2.6).

A scripted responder replaces the model (forced token sequences per row and turn), so every path is
reachable on purpose: valid, invalid and unknown actions, too many actions, an early solve, the
action budget running out, and a response cut by the token budget. The reference replays the same
responses with the text parser (``parse_response_text``), ``env.step`` one action at a time and
RAGEN's message building, and the rollout must produce the same tokens, rewards, penalties and
episode ends.
"""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TypedDict

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs_jax
from helpers import ScriptedResponder, simulated_devices, tiny_llama_for
from starpo_jax.rollout import multi_turn as R_
from starpo_jax.rollout import prompts, sampling
from starpo_jax.rollout.multi_turn import (
    LLMResponder,
    RolloutPlan,
    TagPlan,
    build_tables,
    initial_states_from_seeds,
    make_rollout,
    stop_tokens_for,
)
from starpo_jax.rollout.parsing import parse_response_text
from starpo_jax.rollout.sampling import DecodeOutput

R = 40  # response_length


# (row, turn) responses, without the forced "<think>" (the model continues after it). Each starts
# with a letter: a response starting with "</" would merge with the forced "<think>" when the text
# is re-encoded ("></"), so only the ids the model sampled reproduce it (token-in / token-out).
SCRIPTS = [
    # seed 10001 is solved by Right, Up, Left (ragen-reference.md §1.6): solve in turn 2
    ["go</think><answer>Right || Up</answer>", "<think>now</think> <answer>left</answer>"],
    # no tags; an unknown name beside a valid one; a clean turn
    ["I will just move up", "x</think><answer>Up || Jump</answer>", "ok</think><answer>Down</answer>"],
    # more than max_actions_per_turn actions: only the first 5 are kept
    ["a</think><answer>Up || Up || Left || Left || Down || Down || Right</answer>", "ok</think><answer>Up</answer>"],
    # ten actions over two turns spend the whole budget
    ["ok</think><answer>Left || Right || Left || Right || Left</answer>",
     "ok</think><answer>Right || Left || Right || Left || Right</answer>", "ok</think><answer>Up</answer>"],
    # a response cut by the token budget (no end-of-turn token), then a valid one
    ["thinking " * 60, "ok</think><answer>Up</answer>"],
]
MAX_TURN = 3


@pytest.fixture(scope="module")
def scripted(smollm2_tokenizer):
    """The plan, tables and scripted responder of the Sokoban rows of ``SCRIPTS``."""
    tok = smollm2_tokenizer
    env = envs_jax.make("SimpleSokoban")
    plan = RolloutPlan(
        tags=(TagPlan("SimpleSokoban", env, len(SCRIPTS), 10),),
        group_size=1,
        max_turn=MAX_TURN,
        max_actions_per_turn=5,
        response_length=R,
        max_len=2048,
    )
    tables = build_tables(tok, plan)
    stop = tables.tags[0].prompts.stop_token_id
    plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(tok, tables), pad_id=0)
    script = np.zeros((len(SCRIPTS), MAX_TURN, R), np.int32)
    lengths = np.zeros((len(SCRIPTS), MAX_TURN), np.int32)
    for b, turns in enumerate(SCRIPTS):
        for t, text in enumerate(turns):
            ids = tok.encode(text, add_special_tokens=False) + [stop]
            ids = ids[:R]
            script[b, t, : len(ids)] = ids
            lengths[b, t] = len(ids)
    return tok, env, plan, tables, ScriptedResponder(script, lengths)


@pytest.fixture(scope="module")
def setup(scripted):
    tok, env, plan, tables, responder = scripted
    rollout = make_rollout(plan, responder)
    init = initial_states_from_seeds(plan, 10001)
    traj = jax.device_get(rollout(None, tables, init, jax.random.PRNGKey(0), 1.0))
    return tok, env, plan, responder.script, responder.lengths, traj


class ReferenceEpisode(TypedDict):
    turn_rewards: list[float]
    penalties: int  # format errors
    num_actions: int
    success: bool
    turns: int
    history: list[dict]  # the messages' turns, as prompts.build_messages reads them


def reference_episode(tok, env, seed, responses, plan) -> ReferenceEpisode:
    """RAGEN's loop for one env on the host: text parser, env.step per action, message building."""
    step = jax.jit(env.step)
    state = env.reset_from_seed(seed)
    values = env.step_reward_values
    budget = plan.tags[0].max_actions_per_traj
    history = [{"state": env.render_text(state), "actions_left": budget}]
    out = ReferenceEpisode(turn_rewards=[], penalties=0, num_actions=0, success=False, turns=0, history=history)
    for text in responses:
        out["turns"] += 1
        parsed = parse_response_text(text, env.action_names, plan.max_actions_per_turn)
        step_rewards, done, success = [], False, False
        for action in parsed.valid_action_ids[: budget - out["num_actions"]]:
            state, ts = step(state, action)
            step_rewards.append(values[int(np.argmin(np.abs(np.asarray(values) - float(ts.reward))))])
            if bool(ts.step_type == 2):
                done, success = True, bool(ts.extras["success"])
                break
        out["num_actions"] += len(step_rewards)
        out["penalties"] += int(parsed.format_error)
        out["turn_rewards"].append(prompts.accumulated_reward(step_rewards))
        history[-1].update(llm_response=text, reward=prompts.accumulated_reward(step_rewards))
        history.append({"state": env.render_text(state), "actions_left": budget - out["num_actions"]})
        if done or out["num_actions"] >= budget:
            out["success"] = done and success
            break
    return out


def decoded_responses(tok, traj, b):
    """The text of each played turn's response, as the reference parser sees it."""
    texts = []
    for t in range(MAX_TURN):
        if traj.turn_played[b, t]:
            ids = traj.tokens[b, traj.turn_start[b, t] : traj.turn_end[b, t]]
            texts.append(tok.decode(ids, skip_special_tokens=True))
    return texts


@pytest.mark.parametrize("b", range(len(SCRIPTS)))
def test_rollout_matches_reference_loop(setup, b):
    tok, env, plan, script, lengths, traj = setup
    texts = decoded_responses(tok, traj, b)
    ref = reference_episode(tok, env, 10001 + b, texts, plan)
    assert int(traj.num_turns[b]) == ref["turns"] == len(texts)
    np.testing.assert_allclose(traj.turn_reward[b, : ref["turns"]], ref["turn_rewards"], atol=1e-5)
    assert int(traj.num_actions[b]) == ref["num_actions"]
    assert bool(traj.success[b]) == ref["success"]
    assert traj.format_penalty_sum[b] == pytest.approx(-0.1 * ref["penalties"])
    # the token sequence is the chat-templated conversation: prompts re-encoded by the tokenizer
    # equal the in-graph ones, and each response is exactly the scripted ids
    prefix = prompts.env_instruction(env, 10)
    for t in range(ref["turns"]):
        hist = [dict(h) for h in ref["history"][: t + 1]]
        for h in hist[:-1]:
            h["llm_response"] = "<think>" + h["llm_response"]
        hist[-1] = {"state": hist[-1]["state"], "actions_left": hist[-1]["actions_left"]}
        messages = prompts.build_messages(hist, prefix, 100, True)
        text = prompts.chat_text(tok, messages, add_generation_prompt=True, enable_think=True)
        start = int(traj.turn_start[b, t])
        if (lengths[b, :t] < R).all():  # a cut response need not re-encode to the same ids
            got, want = traj.tokens[b, :start].tolist(), tok.encode(text, add_special_tokens=False)
            assert got == want
        n = int(lengths[b, t])
        assert traj.tokens[b, start : start + n].tolist() == script[b, t, :n].tolist()
        assert traj.loss_mask[b, start : start + n].all()
    # only sampled tokens are trained on
    assert int(traj.loss_mask[b].sum()) == int(traj.response_tokens[b]) == sum(int(lengths[b, t]) for t in range(ref["turns"]))


def test_paths_are_the_intended_ones(setup):
    tok, env, plan, script, lengths, traj = setup
    # row 0: solved on turn 2 with 10.9 on the final push
    assert traj.success[0] and int(traj.num_turns[0]) == 2
    np.testing.assert_allclose(traj.turn_reward[0, :2], [-0.2, 10.9], atol=1e-5)
    # row 1: the no-tag turn and the unknown-name turn pay the penalty, the clean one does not
    assert traj.turn_penalised[1, :3].tolist() == [True, True, False]
    # row 2: 7 valid actions named, the first 5 kept: no penalty
    assert not traj.turn_penalised[2, 0]
    # row 3: budget of 10 actions spent in two turns; the third turn is never played
    assert int(traj.num_actions[3]) == 10 and int(traj.num_turns[3]) == 2 and not traj.success[3]
    # row 4: the cut response is closed by the template's end-of-turn, which is not trained on
    start, end = int(traj.turn_start[4, 0]), int(traj.turn_end[4, 0])
    assert end - start == R
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    assert int(traj.tokens[4, end]) == stop and not traj.loss_mask[4, end]
    assert traj.turn_penalised[4, 0]


# ---- each step of a turn alone ----------------------------------------------------------------


@pytest.fixture(scope="module")
def first_turn(scripted):
    """The first turn's steps run one by one on the scripted rows (eagerly, no jit)."""
    tok, env, plan, tables, responder = scripted
    init = initial_states_from_seeds(plan, 10001)
    carry = R_.initial_carry(plan, responder, None, tables, init)
    active, exhausted = R_.turn_rows(plan, carry)
    out, n_new, n_out = R_.sample_turn(responder, None, carry, active, jax.random.PRNGKey(0), 1.0, 0)
    return dict(tok=tok, env=env, plan=plan, tables=tables, responder=responder, init=init, carry=carry,
                active=active, out=out, n_new=n_new, n_out=n_out)


def test_first_prompts_hold_the_instruction_and_each_level(first_turn):
    t = first_turn
    ids, lengths = R_.first_prompts(t["plan"], t["tables"], t["init"])
    for b in range(ids.shape[0]):
        text = t["tok"].decode(np.asarray(ids[b, : int(lengths[b])]))
        level = t["env"].render_text(jax.tree.map(lambda x: x[b], t["init"][0]))
        assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n<think>")
        assert prompts.env_instruction(t["env"], 10) in text and level in text


def test_turn_rows_stop_rows_whose_next_turn_cannot_fit(first_turn):
    t = first_turn
    plan, carry = t["plan"], t["carry"]
    assert np.asarray(t["active"]).all()
    # row 0 done, row 1 one token short of room for its prompt plus a whole response
    room = plan.max_len - int(carry.prompt_len[1]) - plan.response_length
    carry = carry.replace(done=carry.done.at[0].set(True), length=carry.length.at[1].set(room + 1))
    active, exhausted = R_.turn_rows(plan, carry)
    assert np.asarray(active).tolist() == [False, False, True, True, True]
    assert np.asarray(exhausted).tolist() == [False, True, False, False, False]
    _, _, n_out = R_.sample_turn(t["responder"], None, carry, active, jax.random.PRNGKey(0), 1.0, 0)
    assert np.asarray(n_out)[:2].tolist() == [0, 0]


def test_write_turn_appends_the_prompt_then_the_trained_response(first_turn):
    t = first_turn
    carry, out, n_new, n_out = t["carry"], t["out"], t["n_new"], t["n_out"]
    tokens, loss_mask, logprobs, start, end = R_.write_turn(carry, out, n_new, n_out)
    for b in range(tokens.shape[0]):
        p, n = int(n_new[b]), int(n_out[b])
        assert int(start[b]) == p and int(end[b]) == p + n
        assert np.asarray(tokens[b, :p]).tolist() == np.asarray(carry.prompt_ids[b, :p]).tolist()
        assert np.asarray(tokens[b, p : p + n]).tolist() == t["responder"].script[b, 0, :n].tolist()
        assert np.asarray(loss_mask[b]).nonzero()[0].tolist() == list(range(p, p + n))
        assert (np.asarray(logprobs[b, p : p + n]) == -1.0).all() and (np.asarray(logprobs[b, :p]) == 0).all()


def test_parse_turn_equals_the_text_parser(first_turn):
    t = first_turn
    parsed, ended_with_stop = R_.parse_turn(t["plan"], t["tables"], t["carry"].env_states, t["out"].tokens, t["n_out"])
    for b in range(len(SCRIPTS)):
        n = int(t["n_out"][b])
        text = t["tok"].decode(t["responder"].script[b, 0, :n], skip_special_tokens=True)
        ref = parse_response_text(text, t["env"].action_names, t["plan"].max_actions_per_turn)
        assert tuple(np.asarray(parsed.valid_action_ids[b, : int(parsed.n_valid[b])]).tolist()) == ref.valid_action_ids
        assert bool(parsed.format_error[b]) == ref.format_error
    # every response ends with the end-of-turn token except row 4's, cut by the token budget
    assert np.asarray(ended_with_stop).tolist() == [True, True, True, True, False]


def test_step_envs_then_next_prompts_show_the_new_state(first_turn):
    t = first_turn
    env, plan, tables = t["env"], t["plan"], t["tables"]
    init = t["init"][0]
    parsed, ended = R_.parse_turn(plan, tables, t["carry"].env_states, t["out"].tokens, t["n_out"])
    left = jnp.full((len(SCRIPTS),), 10, jnp.int32)
    states, res = R_.step_envs(plan, tables, t["carry"].env_states, parsed, left, t["active"])
    # row 0 pushed Right then Up from seed 10001: the env, stepped by hand, agrees
    by_hand = jax.tree.map(lambda x: x[0], init)
    for action in (env.action_names.index("Right"), env.action_names.index("Up")):
        by_hand, _ = env.step(by_hand, action)
    row0 = jax.tree.map(lambda x: x[0], states[0])
    assert env.render_text(row0) == env.render_text(by_hand) != env.render_text(jax.tree.map(lambda x: x[0], init))
    assert np.asarray(res.num_executed).tolist() == [2, 0, 5, 5, 0]  # row 1: no tags, no action
    ids, lengths = R_.next_prompts(plan, tables, states, res, left - res.num_executed, ended, 0)
    text = t["tok"].decode(np.asarray(ids[0, : int(lengths[0])]))
    assert "Reward:\n-0.2\n" in text and "Turn 2:\nState:\n" + env.render_text(row0) in text
    assert "You have 8 actions left." in text


def rollout_on_every_env(model, tok):
    """``model`` plays two turns of every env (one batch, three tags): (model, tok, plan, traj)."""
    tags = (
        TagPlan("SimpleSokoban", envs_jax.make("SimpleSokoban"), 1, 10),
        TagPlan("FrozenLake", envs_jax.make("FrozenLake"), 1, 10),
        TagPlan("Bandit", envs_jax.make("Bandit"), 1, 1),
    )
    # 1,000 slots, under sampling.MIN_WINDOWED_CACHE: one cache window, so the 30-layer decode is
    # compiled once a turn, not once per window (windows are tested on the tiny model).
    plan = RolloutPlan(tags=tags, group_size=2, max_turn=2, response_length=16, max_len=1000)
    assert plan.max_len < sampling.MIN_WINDOWED_CACHE
    tables = build_tables(tok, plan)
    plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(tok, tables))
    init = initial_states_from_seeds(plan, 123)
    traj = jax.device_get(make_rollout(plan)(model, tables, init, jax.random.PRNGKey(0), 1.0))
    return model, tok, plan, traj


@pytest.fixture(scope="module")
def smollm2_rollout():
    """The bundled SmolLM2 on every env."""
    from starpo_jax.models.decoder import ModelState
    from starpo_jax.models.loading import load_model

    model, tok = load_model("smollm2-135m-instruct")
    return rollout_on_every_env(ModelState.split(model), tok)


@pytest.fixture(scope="module")
def tiny_rollout(smollm2_tokenizer):
    """A random tiny-llama over SmolLM2's tokenizer on every env: the same rollout code as the bundled
    model's, its 30-layer decode's minutes of compiling left to the slow case."""
    return rollout_on_every_env(tiny_llama_for(smollm2_tokenizer), smollm2_tokenizer)


# The tiny model by default; the bundled SmolLM2 is slow (its real-weights rollout stays in the default
# suite through tests/envs/test_countdown.py's evaluation of the bundled model).
ROLLOUTS = ["tiny_rollout", pytest.param("smollm2_rollout", marks=pytest.mark.slow)]


@pytest.mark.parametrize("which", ROLLOUTS)
def test_model_rollout_on_every_env(which, request):
    model, tok, plan, traj = request.getfixturevalue(which)
    env_texts = [tags.env.render_text(s) for tags, s in zip(plan.tags, [
        tags.env.reset_from_seed(123 + i) for i, tags in enumerate(plan.tags)])]
    for b in range(plan.batch_size):
        first = tok.decode(traj.tokens[b, : traj.turn_start[b, 0]])
        assert env_texts[b // 2] in first  # the level of seed 123 + group
        assert int(traj.loss_mask[b].sum()) == int(traj.response_tokens[b]) > 0
        assert 1 <= int(traj.num_turns[b]) <= 2


@pytest.mark.parametrize("which", ROLLOUTS)
def test_kv_cache_continuation_equals_a_fresh_forward(which, request):
    """The log-probs the sampler saw across turns (cache appended turn by turn) equal those of one
    forward pass over the finished conversation."""
    from starpo_jax.forward import ForwardPass, Rows, full_layout, token_logprobs

    model, tok, plan, traj = request.getfixturevalue(which)
    ctx = ForwardPass(model.graphdef, full_layout(traj.tokens.shape[1]), plan.max_turn * plan.response_length, chunk=128)
    length = jnp.asarray(traj.length)
    rows = Rows(jnp.asarray(traj.tokens), length, jnp.zeros(length.shape, jnp.int32), jnp.asarray(traj.loss_mask))
    logp, _ = jax.jit(token_logprobs, static_argnums=0)(ctx, model.params, rows)
    mask = traj.loss_mask
    np.testing.assert_allclose(np.asarray(logp)[mask], traj.sampler_logprobs[mask], atol=2e-3)


# ---- language actions: Countdown ------------------------------------------------------------------


def _solution(nums, target):
    """An expression using each number once that equals the target (procedural tasks are +- solvable)."""
    import itertools

    for signs in itertools.product("+-", repeat=len(nums) - 1):
        expr = str(nums[0]) + "".join(f" {s} {n}" for s, n in zip(signs, nums[1:]))
        if eval(expr) == target:
            return expr
    for signs in itertools.product("+-", repeat=len(nums)):  # a negative first number
        expr = "".join(f" {s} {n}" for s, n in zip(signs, nums)).strip()
        if eval(expr) == target:
            return expr
    raise AssertionError(f"no +- solution for {nums} -> {target}")


def test_countdown_answers_are_scored_in_the_graph_as_ragen_does(smollm2_tokenizer):
    """A batch of Sokoban and Countdown rows: a Countdown row answering a correct expression earns
    1.0, one with the wrong numbers 0, as RAGEN's plain-Python scorer says on the parsed answer."""
    from envs_jax.countdown_score import ragen_score

    tok = smollm2_tokenizer
    countdown = envs_jax.make("Countdown")
    tags = (TagPlan("SimpleSokoban", envs_jax.make("SimpleSokoban"), 1, 10), TagPlan("Countdown", countdown, 5, 1))
    plan = RolloutPlan(tags=tags, group_size=1, max_turn=1, max_actions_per_turn=2, response_length=R, max_len=2048)
    tables = build_tables(tok, plan)
    plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(tok, tables))
    init = initial_states_from_seeds(plan, 10001)  # Sokoban 10001, Countdown 10002..10006
    tasks = [(np.asarray(init[1].nums[g, : int(init[1].num_count[g])]).tolist(), int(init[1].target[g])) for g in range(5)]
    right = [_solution(*task) for task in tasks]
    texts = [
        "go</think><answer>Right || Up</answer>",
        f"ok</think><answer> {right[0]} </answer>",  # correct
        "ok</think><answer>1 + 1</answer>",  # wrong numbers
        f"ok</think><answer>1 + 1 || {right[2]}</answer>",  # the budget is one answer: the first
        f"ok</think><answer>({right[3]}) * 2</answer>",  # a number too many
        f"I think {right[4]}",  # no answer tags: a format error, nothing scored
    ]
    stop = tables.tags[0].prompts.stop_token_id
    script = np.zeros((len(texts), 1, R), np.int32)
    lengths = np.zeros((len(texts), 1), np.int32)
    for b, text in enumerate(texts):
        ids = tok.encode(text, add_special_tokens=False) + [stop]
        script[b, 0, : len(ids)], lengths[b, 0] = ids, len(ids)
    traj = jax.device_get(make_rollout(plan, ScriptedResponder(script, lengths))(None, tables, init, jax.random.PRNGKey(0), 1.0))

    np.testing.assert_allclose(traj.turn_reward[0, 0], -0.2, atol=1e-6)  # Sokoban, two moves
    assert traj.turn_reward[1:, 0].tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert traj.success.tolist() == [False, True, False, False, False, False]
    assert traj.num_actions.tolist() == [2, 1, 1, 1, 1, 0]
    assert traj.turn_penalised[:, 0].tolist() == [False] * 5 + [True]
    for g, (nums, target) in enumerate(tasks):
        b = g + 1
        text = tok.decode(traj.tokens[b, traj.turn_start[b, 0] : traj.turn_end[b, 0]], skip_special_tokens=True)
        parsed = parse_response_text(text, None, plan.max_actions_per_turn)
        want = ragen_score(parsed.actions[0], nums, target) if parsed.actions else 0.0
        assert float(traj.turn_reward[b, 0]) == pytest.approx(want), (text, nums, target)
        assert bool(traj.turn_penalised[b, 0]) == parsed.format_error
    # the dumps show each answer string (the action a language-action env took)
    from starpo_jax.diagnostics.dumps import trajectory_records

    records = trajectory_records(traj, plan, tok, first_seed=10001)
    assert [r["turns"][0]["actions"] for r in records] == [
        ["Right", "Up"], [right[0]], ["1 + 1"], ["1 + 1", right[2]], [f"({right[3]}) * 2"], []
    ]
    assert records[1]["turns"][0]["answer"] == right[0] and records[1]["success"]
    assert records[5]["turns"][0]["format_error"] and records[5]["format_penalty_sum"] == pytest.approx(-0.1)


@dataclasses.dataclass(frozen=True)
class EchoResponder:
    """Answers each row with the first tokens of its own prompt and a stop token: what it says
    depends only on the row, never on the batch it is played in."""

    stop: int

    def init(self, model, batch_size):
        return jnp.zeros((), jnp.int32)

    def respond(self, model, cache, prompt_ids, num_new, key, temperature, active, turn):
        tokens = jnp.concatenate([prompt_ids[:, 30:34], jnp.full((prompt_ids.shape[0], 1), self.stop)], axis=1)
        lengths = jnp.where(active, 5, 0)
        logprobs = -jnp.ones(tokens.shape, jnp.float32)
        return DecodeOutput(tokens=tokens, logprobs=logprobs, lengths=lengths, cache=cache, last_logits=None)


def test_a_chunked_rollout_plays_the_same_rows_in_the_same_order(smollm2_tokenizer):
    """Validation in chunks (``trainer.val_chunks``): each tag's groups split evenly over calls of
    one smaller program, merged back tag by tag: the same batch as one call."""
    envs = {"Bandit": envs_jax.make("Bandit"), "BanditTest": envs_jax.make("Bandit", lo_arm_name="Trader", hi_arm_name="Librarian")}
    plan = RolloutPlan(
        tags=tuple(TagPlan(name, env, 4, 1) for name, env in envs.items()), group_size=2, max_turn=1,
        max_actions_per_turn=1, response_length=8, max_len=320, enable_think=False,
    )
    tables = build_tables(smollm2_tokenizer, plan)
    responder = EchoResponder(tables.tags[0].prompts.stop_token_id)
    init = initial_states_from_seeds(plan, 123)
    whole = jax.device_get(make_rollout(plan, responder)(None, tables, init, jax.random.PRNGKey(0), 1.0))
    done: list[int] = []  # the progress callback: one call per finished chunk
    chunked = jax.device_get(R_.chunked_rollout(plan, 2, responder)(None, tables, init, jax.random.PRNGKey(0), 1.0,
                                                                    done.append))
    one = jax.device_get(R_.chunked_rollout(plan, 1, responder)(None, tables, init, jax.random.PRNGKey(0), 1.0))
    assert done == [1, 1]
    for name, a, b, c in zip(R_.Trajectories.__dataclass_fields__, jax.tree.leaves(whole), jax.tree.leaves(chunked),
                             jax.tree.leaves(one)):
        np.testing.assert_array_equal(a, b, err_msg=name)
        np.testing.assert_array_equal(a, c, err_msg=name)
    assert len(set(map(tuple, np.asarray(whole.tokens)[::2]))) > 2  # the rows really differ (arm orders, tags)
    with pytest.raises(ValueError, match="must split into 3 chunks"):
        R_.chunked_rollout(plan, 3, responder)


def test_the_first_turn_prefills_each_distinct_first_prompt_once():
    """Rows that read the same first prompt (a group; validation levels that repeat one) share one
    prefill: the same cache and logits as prefilling every row, computed in a batch of another
    shape (float32 rounding), and rows with a prompt of their own keep it."""
    from flax import nnx

    from starpo_jax.models import Decoder, ModelState, preset
    from starpo_jax.rollout.sampling import append, init_cache

    model = ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0)))
    plan = RolloutPlan(tags=(TagPlan("Bandit", envs_jax.make("Bandit"), 3, 1),), group_size=2, max_len=32)
    rng = np.random.default_rng(0)
    prompts = rng.integers(1, 200, (3, 12))
    ids = jnp.asarray(prompts[[0, 0, 1, 1, 2, 2]], jnp.int32)  # one prompt per group ...
    num_new = jnp.asarray([12, 12, 9, 9, 12, 12], jnp.int32)
    ids = ids.at[3, 9:].set(7)  # ... padding past a row's length is not part of its prompt
    cache = init_cache(model.merge().config, 6, plan.max_len)
    every_row, every_logits = append(model, cache, ids, num_new)
    for count in (3, 4):  # one per group (the default), or more than there are
        shared, logits = LLMResponder(plan, first_prompts=count).prefill_first_prompts(model, ids, num_new, cache)
        np.testing.assert_allclose(logits, every_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(shared.lengths, num_new)
        np.testing.assert_allclose(shared.k, every_row.k, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(shared.v, every_row.v, rtol=1e-5, atol=1e-6)
        assert_prefix_groups(shared, np.repeat(np.arange(3), 2), num_new)


def assert_prefix_groups(cache, prompt, num_new):
    """Rows of one prompt are one prefix group, apart from the others, sharing their prompt's slots
    (what the CPU kernel reads once for them)."""
    group = np.asarray(cache.prefix_group)
    np.testing.assert_array_equal(group[:, None] == group[None], prompt[:, None] == prompt[None])
    np.testing.assert_array_equal(cache.prefix_length, num_new)


def test_the_first_turn_counts_the_distinct_prompts_of_sampled_levels():
    """By default (sampled levels) the first turn counts the batch's distinct first prompts in its
    program and prefills them in the smallest batch that holds them: the same cache and logits as
    prefilling every row, in each of its batches (2 of 8 groups, 3 in 4 rows, 8)."""
    from flax import nnx

    from starpo_jax.models import Decoder, ModelState, preset
    from starpo_jax.rollout.multi_turn import prefill_batch_sizes
    from starpo_jax.rollout.sampling import append, init_cache

    model = ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0)))
    plan = RolloutPlan(tags=(TagPlan("Bandit", envs_jax.make("Bandit"), 8, 1),), group_size=2, max_len=32)
    assert prefill_batch_sizes(plan.num_groups) == (2, 4, 8)
    rng = np.random.default_rng(1)
    prompts = rng.integers(1, 200, (8, 12))
    cache = init_cache(model.merge().config, 16, plan.max_len)
    prefill = jax.jit(LLMResponder(plan).prefill_first_prompts)
    for distinct in (2, 3, 8):
        level = np.repeat(rng.permutation(np.arange(8) % distinct), 2)  # each group's prompt, two rows each
        ids = jnp.asarray(prompts[level], jnp.int32)
        num_new = jnp.asarray(12 - level % 3, jnp.int32)  # a prompt's length is its own
        every_row, every_logits = append(model, cache, ids, num_new)
        shared, logits = prefill(model, ids, num_new, cache)
        np.testing.assert_allclose(logits, every_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(shared.lengths, num_new)
        np.testing.assert_allclose(shared.k, every_row.k, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(shared.v, every_row.v, rtol=1e-5, atol=1e-6)
        assert_prefix_groups(shared, level, num_new)


def test_the_first_turn_reads_and_writes_only_the_head_it_can_reach():
    """The first turn runs in the cache's first ``first prompt width + token budget`` slots: slots
    past them, here NaN, are neither read (a NaN read by attention would reach every logit) nor
    written, and the turn samples exactly what it samples from an empty cache (the same program)."""
    from flax import nnx

    from starpo_jax.models import Decoder, ModelState, preset
    from starpo_jax.rollout.sampling import init_cache

    model = ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0)))
    plan = RolloutPlan(tags=(TagPlan("Bandit", envs_jax.make("Bandit"), 3, 1),), group_size=2, response_length=6,
                       max_len=40)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(1, 200, (3, 12))[[0, 0, 1, 1, 2, 2]], jnp.int32)
    num_new = jnp.asarray([12, 12, 9, 9, 12, 12], jnp.int32)
    head = 12 + plan.response_length
    empty = init_cache(model.merge().config, 6, plan.max_len)
    poisoned = empty.replace(k=tuple(k.at[:, :, head:].set(jnp.nan) for k in empty.k),
                             v=tuple(v.at[:, :, head:].set(jnp.nan) for v in empty.v))
    responder = LLMResponder(plan, first_prompts=6)  # every row prefilled in the cache it is given
    respond = jax.jit(lambda cache: responder.respond(model, cache, ids, num_new, jax.random.PRNGKey(1), 1.0,
                                                      jnp.ones(6, bool), 0))
    clean, dirty = jax.device_get(respond(empty)), jax.device_get(respond(poisoned))
    assert (clean.lengths == plan.response_length).any()  # some rows use the whole budget
    np.testing.assert_array_equal(dirty.tokens, clean.tokens)
    np.testing.assert_array_equal(dirty.logprobs, clean.logprobs)
    for got, want in zip(dirty.cache.k + dirty.cache.v, clean.cache.k + clean.cache.v):
        np.testing.assert_array_equal(got[:, :, :head], want[:, :, :head])
        assert np.isnan(got[:, :, head:]).all() and not want[:, :, head:].any()


def test_the_first_turn_prefills_the_head_every_first_prompt_begins_with_once():
    """With ``plan.shared_head`` the first turn computes the head once, copies it to every row and
    appends each row's own tokens: the same cache and logits as prefilling whole prompts (float32
    rounding: the head's keys are attended as held slots, not in the block), whether every row is
    prefilled or each distinct prompt once. The head is computed once, from one row: rows whose head
    differed (no first prompt's does) get exactly what they get with the shared one."""
    from flax import nnx

    from starpo_jax.models import Decoder, ModelState, preset
    from starpo_jax.rollout.sampling import init_cache

    model = ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0)))
    whole = RolloutPlan(tags=(TagPlan("Bandit", envs_jax.make("Bandit"), 3, 1),), group_size=2, max_len=32)
    plan = dataclasses.replace(whole, shared_head=5)
    prompts = np.random.default_rng(2).integers(1, 200, (3, 12))
    prompts[:, :5] = prompts[0, :5]
    level = np.repeat(np.arange(3), 2)
    ids = jnp.asarray(prompts[level], jnp.int32)
    num_new = jnp.asarray([12, 12, 9, 9, 12, 12], jnp.int32)
    cache = init_cache(model.merge().config, 6, plan.max_len)
    for count in (3, 6):  # each distinct prompt once; every row
        prefill = jax.jit(LLMResponder(plan, first_prompts=count).prefill_first_prompts)
        want, want_logits = LLMResponder(whole, first_prompts=count).prefill_first_prompts(model, ids, num_new, cache)
        got, logits = prefill(model, ids, num_new, cache)
        np.testing.assert_allclose(logits, want_logits, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(got.lengths, num_new)
        np.testing.assert_allclose(got.k, want.k, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.v, want.v, rtol=1e-5, atol=1e-6)
        if count == 3:
            assert_prefix_groups(got, level, num_new)
        else:  # one group sharing the head
            np.testing.assert_array_equal(got.prefix_group, 0)
            np.testing.assert_array_equal(got.prefix_length, 5)
        # the last group's head changed (still the greatest prompt, so the distinct ones keep their order)
        other, other_logits = prefill(model, ids.at[4:, :5].set(250), num_new, cache)
        np.testing.assert_array_equal(other_logits, logits)
        for a, b in zip(other.k + other.v, got.k + got.v):
            np.testing.assert_array_equal(a, b)


def test_shared_head_is_where_every_first_prompt_agrees(smollm2_tokenizer):
    """``shared_head``: a tag's first prompts all begin with its head (the chat start, the env's
    instructions, "Turn 1:\nState:\n"), whatever the level; prompts of several tags agree only as far
    as their heads do."""
    tok = smollm2_tokenizer

    def heads_and_prompts(*names):
        tags = tuple(TagPlan(name, envs_jax.make(name), 8, 10) for name in names)
        plan = RolloutPlan(tags=tags, group_size=1, max_len=4096)
        tables = build_tables(tok, plan)
        ids, _ = jax.jit(lambda t, s: R_.first_prompts(plan, t, s))(tables, initial_states_from_seeds(plan, 123))
        return R_.shared_head(tables), np.asarray(ids)

    for name in ("FrozenLake", "SimpleSokoban", "Bandit"):
        head, ids = heads_and_prompts(name)
        assert (ids[:, :head] == ids[0, :head]).all(), name
        text = tok.decode(ids[0, :head])
        assert text.startswith("<|im_start|>system") and text.endswith("Turn 1:\nState:\n"), name
    head, ids = heads_and_prompts("FrozenLake", "Bandit")
    assert (ids[:, :head] == ids[0, :head]).all() and len(set(ids[:, head])) > 1
    assert tok.decode(ids[0, :head]).endswith("<|im_start|>user\n")


def test_distinct_first_prompts_counts_the_bandits_two_arm_orders(smollm2_tokenizer):
    """Validation's count: 8 Bandit levels show at most two first prompts (the arms' two orders)."""
    plan = RolloutPlan(tags=(TagPlan("Bandit", envs_jax.make("Bandit"), 8, 1),), group_size=1, max_turn=1,
                       max_actions_per_turn=1, response_length=8, max_len=320, enable_think=False)
    tables = build_tables(smollm2_tokenizer, plan)
    init = initial_states_from_seeds(plan, 123)
    orders = {bool(x) for x in np.asarray(init[0].hi_first)}
    assert R_.distinct_first_prompts(plan, tables, init) == len(orders) == 2


# ---- the buffers' length: what a trajectory can reach ---------------------------------------------


def assert_same_rows(wide, narrow, logprob_atol=0.0):
    """The same trajectories in buffers of two widths: equal up to the narrow width (the sampler's
    log-probs within ``logprob_atol``), nothing past it."""
    width = narrow.tokens.shape[1]
    for name, a, b in zip(R_.Trajectories.__dataclass_fields__, jax.tree.leaves(wide), jax.tree.leaves(narrow)):
        a, b = np.asarray(a), np.asarray(b)
        if name in ("tokens", "loss_mask", "sampler_logprobs"):
            assert not a[:, width:].any(), name  # padding (pad id 0) only
            a = a[:, :width]
        if name == "sampler_logprobs":
            np.testing.assert_allclose(b, a, rtol=0, atol=logprob_atol, err_msg=name)
        else:
            np.testing.assert_array_equal(a, b, err_msg=name)


def test_buffers_fit_the_longest_trajectory_and_play_the_same_rows(smollm2_tokenizer, scripted):
    """``fit_to_tables`` sizes the buffers and the KV cache to ``longest_trajectory``: a true bound
    (the longest conversations, every turn of four envs at full length, fit it, and no row runs out
    of context that did not before), and the same rows play to the same end. The responders here
    ignore the cache, so both widths run the same program on the same values: equal exactly."""
    tok = smollm2_tokenizer
    tags = tuple(TagPlan(name, envs_jax.make(name), 2, budget) for name, budget in
                 (("SimpleSokoban", 10), ("FrozenLake", 10), ("Countdown", 1), ("Bandit", 1)))
    plan = RolloutPlan(tags=tags, group_size=1, max_turn=3, max_actions_per_turn=2, response_length=R, max_len=4096)
    tables = build_tables(tok, plan)
    plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(tok, tables))
    longest = R_.longest_trajectory(plan, tables)
    # Every row answers every turn with R filler tokens and no stop token: each response is cut, holds
    # no action and is closed by the next prompt's whole assistant end, so every row plays every turn
    # at full length, the longest conversation a plan allows.
    go = tok.encode(" go", add_special_tokens=False)[0]
    rows, turns = plan.batch_size, plan.max_turn
    filler = ScriptedResponder(np.full((rows, turns, R), go, np.int32), np.full((rows, turns), R, np.int32))
    init = initial_states_from_seeds(plan, 123)
    key = jax.random.PRNGKey(0)

    wide = jax.device_get(make_rollout(plan, filler)(None, tables, init, key, 1.0))
    assert (wide.num_turns == 3).all() and not wide.context_exhausted.any()
    assert wide.length.max() <= longest < plan.max_len
    fitted = R_.fit_to_tables(plan, tables)
    assert fitted.max_len == longest
    assert_same_rows(wide, jax.device_get(make_rollout(fitted, filler)(None, tables, init, key, 1.0)))
    # below the bound the user's max_model_len stays the cap: rows run out of context as before
    short = dataclasses.replace(plan, max_len=int(wide.length.max()) - 1)
    assert R_.fit_to_tables(short, tables) == short
    assert jax.device_get(make_rollout(short, filler)(None, tables, init, key, 1.0)).context_exhausted.any()

    # the scripted Sokoban rows: solves, invalid and unknown actions, the budget spent, a cut response
    _, _, plan, tables, responder = scripted
    fitted = R_.fit_to_tables(plan, tables)
    assert fitted.max_len < plan.max_len
    init = initial_states_from_seeds(plan, 10001)
    assert_same_rows(jax.device_get(make_rollout(plan, responder)(None, tables, init, key, 1.0)),
                     jax.device_get(make_rollout(fitted, responder)(None, tables, init, key, 1.0)))


# slow: SmolLM2's rollout twice (~2-4 min on 2 cores); the default suite keeps the fitted buffers'
# exactness with scripted answers (above) and the cache's masking (test_kv_cache_continuation_...)
@pytest.mark.slow
def test_the_model_samples_the_same_in_a_cache_fitted_to_the_longest_trajectory(smollm2_rollout):
    """SmolLM2 in a cache of ``longest_trajectory`` slots rather than 1,000: the same tokens and
    turns. The masked slots add exactly zero to attention, but its reductions run over another
    length, so sums are ordered differently: log-probs agree to
    float32 rounding carried through 30 layers (2.4e-5 at most, measured), not bit for bit. A token
    drawn within that of a boundary of the sampler's distribution would differ; none of these does."""
    model, tok, plan, traj = smollm2_rollout
    tables = build_tables(tok, plan)
    fitted = R_.fit_to_tables(plan, tables)
    assert fitted.max_len < plan.max_len
    init = initial_states_from_seeds(plan, 123)
    narrow = jax.device_get(make_rollout(fitted)(model, tables, init, jax.random.PRNGKey(0), 1.0))
    assert_same_rows(traj, narrow, logprob_atol=1e-4)


# ---- later turns on the rows still playing ----------------------------------------------------------


def test_live_batch_sizes_are_a_quarter_and_a_half_where_they_hold_enough_rows():
    assert R_.live_batch_sizes(64, 8) == (16, 32, 64)
    assert R_.live_batch_sizes(24, 8) == (12, 24)  # a quarter would be 6 rows
    assert R_.live_batch_sizes(6, 8) == (6,)
    assert R_.live_batch_sizes(10, 1) == (5, 10)  # 10 / 4 does not divide


@pytest.mark.parametrize("live", [3, 6, 11], ids=["quarter", "half", "whole"])
def test_a_later_turn_on_the_rows_still_playing_equals_the_whole_batch(live):
    """A later turn run on the playing rows gathered into a quarter, a half or all of the batch
    gives what the whole batch gives: the same tokens (each row draws its own noise), the same
    cache for the playing rows, and nothing for the others, whose cache is left as it was. The
    smaller batches are other programs, so log-probs and keys agree to float32 rounding (a token
    drawn within that of the sampler's boundary would differ; none here does)."""
    from flax import nnx

    from starpo_jax.models import Decoder, ModelState, preset
    from starpo_jax.rollout.sampling import append, init_cache

    B = 12
    model = ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0)))
    plan = RolloutPlan(tags=(TagPlan("Bandit", envs_jax.make("Bandit"), B, 1),), group_size=1, response_length=6,
                       max_len=40, pad_id=3)
    rng = np.random.default_rng(0)
    held = jnp.asarray(rng.integers(5, 15, B), jnp.int32)
    cache, _ = append(model, init_cache(model.merge().config, B, plan.max_len),
                      jnp.asarray(rng.integers(1, 200, (B, 15)), jnp.int32), held)
    prompt_ids = jnp.asarray(rng.integers(1, 200, (B, 8)), jnp.int32)
    active = jnp.asarray(rng.permutation(B) < live)
    num_new = jnp.where(active, jnp.asarray(rng.integers(1, 9, B), jnp.int32), 0)
    temperature = jnp.linspace(0.5, 1.5, B)  # one per row: gathered with the rows
    assert R_.live_batch_sizes(B, 3) == (3, 6, 12)

    def turn(min_rows):
        respond = jax.jit(LLMResponder(plan, min_live_rows=min_rows).respond)
        return jax.device_get(respond(model, cache, prompt_ids, num_new, jax.random.PRNGKey(1), temperature, active,
                                      jnp.int32(1)))

    whole, compact = turn(B + 1), turn(3)
    np.testing.assert_array_equal(compact.tokens, whole.tokens)
    np.testing.assert_array_equal(compact.lengths, whole.lengths)
    assert (compact.lengths[np.asarray(active)] > 0).all() and not compact.lengths[~np.asarray(active)].any()
    assert (compact.tokens[~np.asarray(active)] == plan.pad_id).all()
    np.testing.assert_allclose(compact.logprobs, whole.logprobs, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(compact.cache.lengths, whole.cache.lengths)
    for got, want, before in zip(compact.cache.k + compact.cache.v, whole.cache.k + whole.cache.v, cache.k + cache.v):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(got[~np.asarray(active)], np.asarray(before)[~np.asarray(active)])


FIRST_PROMPTS_ON_TWO_DEVICES = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
import envs_jax
from starpo_jax.models import Decoder, ModelState, preset
from starpo_jax.rollout.multi_turn import LLMResponder, RolloutPlan, TagPlan
from starpo_jax.rollout.sampling import append, init_cache
from starpo_jax.runtime import sharding

model = ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0)))
plan = RolloutPlan(tags=(TagPlan("Bandit", envs_jax.make("Bandit"), 8, 1),), group_size=2, max_len=32)
rng = np.random.default_rng(0)
ids = jnp.asarray(rng.integers(1, 200, (2, 12))[np.arange(16) // 3 % 2], jnp.int32)  # two prompts, mixed
num_new = jnp.asarray(np.where(np.arange(16) // 3 % 2, 12, 10), jnp.int32)
cache = init_cache(model.merge().config, 16, plan.max_len)
_, whole = append(model, cache, ids, num_new)
mesh = sharding.make_mesh(2, 1, 1)
with sharding.use_mesh(mesh):
    by_rows = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    model = jax.device_put(model, NamedSharding(mesh, P()))
    shared, logits = jax.jit(LLMResponder(plan).prefill_first_prompts)(model, by_rows(ids), by_rows(num_new),
                                                                      jax.tree.map(by_rows, cache))
print(json.dumps({"logits": float(np.abs(np.asarray(logits) - np.asarray(whole)).max()),
                  "lengths": np.asarray(shared.lengths).tolist() == np.asarray(num_new).tolist()}))
"""


def test_a_row_sharded_first_turn_prefills_its_distinct_prompts_as_one_device():
    """On two devices splitting the rows, the first turn counts the batch's two distinct prompts
    across both and prefills them in its small batch: the logits of prefilling every row on one."""
    env = {**os.environ, **simulated_devices(2)}
    proc = subprocess.run([sys.executable, "-c", FIRST_PROMPTS_ON_TWO_DEVICES],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["lengths"] and out["logits"] < 1e-4, out


LIVE_ROWS_ON_TWO_DEVICES = r"""
import json, re
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
import envs_jax
from starpo_jax.models import Decoder, ModelState, preset
from starpo_jax.rollout.multi_turn import LLMResponder, RolloutPlan, TagPlan
from starpo_jax.rollout.sampling import append, init_cache
from starpo_jax.runtime import sharding

B = 8
model = ModelState.split(Decoder(preset("tiny-llama"), rngs=nnx.Rngs(0)))
plan = RolloutPlan(tags=(TagPlan("Bandit", envs_jax.make("Bandit"), B, 1),), group_size=1, response_length=6,
                   max_len=40)
rng = np.random.default_rng(0)
cache, _ = append(model, init_cache(model.merge().config, B, plan.max_len),
                  jnp.asarray(rng.integers(1, 200, (B, 15)), jnp.int32), jnp.asarray(rng.integers(5, 15, B), jnp.int32))
prompt_ids = jnp.asarray(rng.integers(1, 200, (B, 8)), jnp.int32)
active = jnp.asarray([0, 1, 0, 0, 1, 0, 1, 0], bool)  # one playing row on the first device, two on the second
num_new = jnp.where(active, jnp.asarray(rng.integers(1, 9, B), jnp.int32), 0)
key = jax.random.PRNGKey(1)
respond = lambda min_rows: jax.jit(lambda m, *a: LLMResponder(plan, min_live_rows=min_rows).respond(m, *a))
whole = jax.device_get(respond(B + 1)(model, cache, prompt_ids, num_new, key, 1.0, active, jnp.int32(1)))
mesh = sharding.make_mesh(2, 1, 1)
with sharding.use_mesh(mesh):
    by_rows = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
    args = (jax.tree.map(by_rows, cache), by_rows(prompt_ids), by_rows(num_new), key, 1.0, by_rows(active),
            jnp.int32(1))
    model = jax.device_put(model, NamedSharding(mesh, P()))
    halves = respond(2)  # two rows of each device's four: the half batch
    hlo = halves.lower(model, *args).compile().as_text()
    compact = jax.device_get(halves(model, *args))
collective = r"= ([^=]+?) (all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)(?:-start)?\("
print(json.dumps({"collectives": sorted({shape for shape, _ in re.findall(collective, hlo)}),
                  "tokens": bool((compact.tokens == whole.tokens).all()),
                  "logprobs": float(np.abs(compact.logprobs - whole.logprobs).max())}))
"""


def test_a_row_sharded_batch_gathers_its_playing_rows_on_each_device():
    """On two devices splitting the rows, each gathers its own playing rows: the compiled turn
    exchanges only scalars (how many rows play, whether every row is done), and samples what one
    device sampling the whole batch does."""
    env = {**os.environ, **simulated_devices(2)}
    proc = subprocess.run([sys.executable, "-c", LIVE_ROWS_ON_TWO_DEVICES], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["collectives"] == ["pred[]", "s32[]"] and out["tokens"], out
    assert out["logprobs"] < 1e-5, out
