"""Checking an env against the environment contract (``envs_jax.base.TextEnv``) when a run starts.

A broken env would otherwise fail deep inside tracing, or worse, train on prompts that are not
what its ``render_text`` says. ``check_env`` finds the first problem and names it in one sentence.
"""

from __future__ import annotations

import jax
import numpy as np
from jumanji.types import StepType

from envs_jax.base import TextEnv
from starpo_jax.rollout.parsing import ACTION_SEP


class EnvContractError(ValueError):
    """An env does not follow the environment contract."""


def check_env(env, tag: str = "") -> None:
    """Raise ``EnvContractError`` naming the first way ``env`` breaks the contract.

    Checks the declarations (action names distinct and parseable, step rewards, a piece table),
    their shapes (``action_name_ids``, ``observation_pieces``), and on a few states (the level of
    ``reset_from_seed(0)`` and one step of each of its first 8 actions from it, or of an empty
    answer for a language-action env) that the pieces spell ``render_text(state) + "\\n"`` and that
    ``state_key`` (a ``uint32`` scalar) tells apart the states whose observations differ. Then
    plays ``REWARD_EPISODES`` seeded random episodes from that level and checks that every reward a
    step pays is one of ``step_reward_values`` (the reward message shows the nearest one otherwise).
    """
    what = f"Env {tag or getattr(env, 'name', '') or type(env).__name__!r}"

    def fail(problem: str):
        raise EnvContractError(f"{what} breaks the environment contract (docs/environments.md): {problem}")

    if not isinstance(env, TextEnv):
        fail(f"it is a {type(env).__name__}, not an envs_jax.base.TextEnv subclass.")
    names = tuple(env.action_names)
    language = env.answer_width != 0
    if language and (not isinstance(env.answer_width, int) or env.answer_width < 0 or names):
        fail(
            f"a language-action env declares answer_width > 0 (an int: the answer bytes step reads) and no "
            f"action names; got answer_width={env.answer_width!r}, action_names={names!r}."
        )
    if not language and (not names or any(not isinstance(n, str) or not n.strip() or not n.isascii() for n in names)):
        fail(f"action_names must be non-empty ASCII strings, got {names!r}.")
    if any(ACTION_SEP in n or n != n.strip() for n in names):
        fail(f"an action name contains the separator {ACTION_SEP!r} or surrounding spaces: {names!r}.")
    lowered = [n.lower() for n in names]
    clashes = sorted({n for n in names if lowered.count(n.lower()) > 1})
    if clashes:
        fail(f"action names clash (the parser ignores case): {', '.join(clashes)}.")
    rewards = tuple(env.step_reward_values)
    if not rewards or len(set(np.asarray(rewards, np.float32).tolist())) != len(rewards):
        fail(f"step_reward_values must list each reward a step can pay once, got {rewards!r}.")
    texts = env.piece_texts
    if not texts or any(not isinstance(t, str) for t in texts):
        fail("piece_texts, the table of observation pieces, is empty or holds non-strings.")

    state = env.reset_from_seed(0)
    ids = jax.eval_shape(env.action_name_ids, state)
    if ids.shape != (env.num_actions,) or not np.issubdtype(ids.dtype, np.integer):
        fail(f"action_name_ids(state) must be int[{env.num_actions}], got {ids.dtype}{list(ids.shape)}.")
    pieces_shape = jax.eval_shape(env.observation_pieces, state)
    if len(pieces_shape.shape) != 1 or not np.issubdtype(pieces_shape.dtype, np.integer):
        fail(f"observation_pieces(state) must be a 1-D int array, got {pieces_shape.dtype}{list(pieces_shape.shape)}.")
    key_shape = jax.eval_shape(env.state_key, state)
    if key_shape.shape != () or key_shape.dtype != np.uint32:
        fail(f"state_key(state) must be a uint32 scalar, got {key_shape.dtype}{list(key_shape.shape)}.")
    observation_pieces, step, state_key = jax.jit(env.observation_pieces), jax.jit(env.step), jax.jit(env.state_key)
    keys: dict[int, tuple[list, str]] = {}  # state key -> (the observation pieces of a state with it, which state)
    # The first level and one step of each action from it (a few states, seen as the rollout sees
    # them); a language-action env steps once, with an empty answer.
    actions = [(np.zeros(env.answer_width, np.uint8), np.int32(0))] if language else range(min(env.num_actions, 8))
    for action in [None, *actions]:
        seen = state if action is None else step(state, action)[0]
        pieces = np.asarray(observation_pieces(seen))
        if np.any((pieces < -1) | (pieces >= len(texts))):
            fail(f"observation_pieces(state) holds ids outside the piece table (size {len(texts)}): {pieces.tolist()}.")
        spelled = "".join(texts[int(p)] for p in pieces if p >= 0)
        expected = env.render_text(seen) + "\n"
        after = "of seed 0" if action is None else f"after action {'<empty answer>' if language else action} from seed 0"
        if spelled != expected:
            fail(
                f"the observation pieces {after} spell {spelled!r}, not render_text + newline {expected!r} "
                f"(an observation wider than its {len(pieces)} pieces, or a piece table out of step)."
            )
        key = int(state_key(seen))
        other, where = keys.setdefault(key, (pieces.tolist(), after))
        if other != pieces.tolist():
            fail(
                f"state_key gives the state {after} and the state {where} the same key {key}, but they show "
                "different observations (GiGPO would compare their turns as turns from one position)."
            )

    check_step_rewards(env, state, step, fail)


REWARD_EPISODES = 4  # random episodes from the seed-0 level whose step rewards check_env compares


def check_step_rewards(env, state, step, fail, episodes: int = REWARD_EPISODES, seed: int = 0) -> None:
    """Play ``episodes`` random episodes from ``state`` (each within the env's default action
    budget) and ``fail`` at the first reward a step pays that ``step_reward_values`` does not list."""
    declared = np.float32(env.step_reward_values)
    rng = np.random.default_rng(seed)
    for _ in range(episodes):
        seen = state
        for _ in range(max(int(env.default_max_actions_per_traj), 1)):
            seen, ts = step(seen, random_action(env, rng))
            paid = np.float32(ts.reward)
            if not np.any(np.isclose(paid, declared, rtol=1e-6, atol=1e-7)):
                fail(
                    f"a random episode from seed 0 paid a step reward of {float(paid):g}, which its "
                    f"step_reward_values {tuple(env.step_reward_values)!r} do not list (the reward "
                    "message shown to the model would say the nearest listed value)."
                )
            if int(ts.step_type) == StepType.LAST:
                break


def random_action(env, rng):
    """A random action as ``step`` takes it: an action id, or a language env's answer bytes and length
    (the same types as ``check_env``'s steps, so the jitted ``step`` is not compiled again)."""
    if not env.answer_width:
        return int(rng.integers(env.num_actions))
    length = int(rng.integers(env.answer_width + 1))
    text = rng.integers(32, 127, env.answer_width).astype(np.uint8)
    return text * (np.arange(env.answer_width) < length), np.int32(length)
