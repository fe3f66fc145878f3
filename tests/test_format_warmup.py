"""Format warm-up: its answers are valid answers of the episode (any named-action env, the Bandit's
swapped arms too), drawn without looking at the board, and a few steps teach them."""

import dataclasses

import jax
import numpy as np
import pytest

import envs_jax
from helpers import tiny_llama_for
from starpo_jax.format_warmup import answer_pieces, format_warmup, warmup_batch
from starpo_jax.rollout.multi_turn import RolloutPlan, TagPlan, build_tables, stop_tokens_for
from starpo_jax.rollout.parsing import decode_response, parse_response_text
from starpo_jax.runtime.settings import ConfigError, TrainSettings
from starpo_jax.train import init_train_state


def plan_of(*tags, enable_think=True, max_actions=3):
    return RolloutPlan(tags=tuple(TagPlan(name, envs_jax.make(name), 4, 10) for name in tags), group_size=2,
                       max_turn=2, max_actions_per_turn=max_actions, response_length=24, max_len=640,
                       enable_think=enable_think)


@pytest.mark.parametrize("enable_think", [True, False])
def test_answers_parse_as_valid_answers_of_their_episode(smollm2_tokenizer, enable_think):
    tok = smollm2_tokenizer
    plan = plan_of("FrozenLake", "SimpleSokoban", "Bandit", enable_think=enable_think)
    tables = build_tables(tok, plan)
    tokens, length, _, answer = jax.device_get(tuple(jax.jit(warmup_batch, static_argnums=0)(
        plan, tables, answer_pieces(tok, plan, tables), jax.random.PRNGKey(0))))
    counts, rows = set(), 0
    for t, tag in enumerate(plan.tags):
        for r in range(t * 8, (t + 1) * 8):
            ids = tokens[r][answer[r]]
            assert ids[-1] == tables.tags[t].prompts.stop_token_id and answer[r].sum() == length[r] - answer[r].argmax()
            text = decode_response(tok, ids)
            prompt = decode_response(tok, tokens[r][: answer[r].argmax()])
            parsed = parse_response_text(text, tag.env.action_names, plan.max_actions_per_turn, enable_think)
            assert parsed.matched and not parsed.format_error, text
            assert all(name in prompt for name in parsed.actions), (prompt, parsed.actions)  # the episode's names
            counts.add(len(parsed.actions))
            rows += 1
    assert rows == 24 and counts == {1, 2, 3}  # 1 to max_actions_per_turn actions


def test_an_env_without_action_names_is_one_sentence(smollm2_tokenizer):
    plan = RolloutPlan(tags=(TagPlan("Countdown", envs_jax.make("Countdown"), 2, 1),), group_size=2, max_turn=1,
                       max_actions_per_turn=1, response_length=24, max_len=640)
    with pytest.raises(ConfigError, match="Countdown answers in free text"):
        answer_pieces(smollm2_tokenizer, plan, build_tables(smollm2_tokenizer, plan))


def test_a_few_steps_teach_the_answers(smollm2_tokenizer):
    """On a tiny random model, the answers' negative log-likelihood falls step after step, and only
    the actor's weights move."""
    tok = smollm2_tokenizer
    plan = plan_of("FrozenLake", max_actions=2)
    tables = build_tables(tok, plan)
    plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(tok, tables))
    model = tiny_llama_for(tok)
    settings = TrainSettings(adv_estimator="gae", micro_batch_size=4, ppo_mini_batch_size=8, logprob_chunk=64)
    state = init_train_state(settings, model, jax.random.PRNGKey(0))
    nll, before = [], jax.tree.map(np.asarray, state)  # the warm-up consumes the actor's arrays
    warmed = format_warmup(settings, model.graphdef, plan, tables, answer_pieces(tok, plan, tables), state,
                           jax.random.PRNGKey(1), steps=6, lr=3e-3, on_step=lambda i, m: nll.append(m["format_warmup/nll"]))
    assert len(nll) == 6 and all(np.diff(nll) < 0) and nll[-1] < 0.9 * nll[0], nll  # fresh answers each step
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), warmed.actor, before.actor))
    assert all(moved)
    for kept in ("critic", "ref", "actor_opt"):  # RL starts from the same critic, reference and fresh moments
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(getattr(warmed, kept)),
                                                        jax.tree.leaves(getattr(before, kept))))
