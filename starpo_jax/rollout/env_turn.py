"""One agent turn on the environment side, in-graph: RAGEN's es_manager step (ragen-reference.md §2.2).

Given the actions parsed from a response, step the env through them in order, within the
trajectory's remaining action budget, and report what the turn did. Vectorised with ``vmap``
over rows; finished rows pass ``active=False`` and nothing changes for them.

Semantics kept from the original:
- unknown action names were dropped by the parser (they consume no budget; the format penalty is
  the parser's verdict); a language-action env (Countdown) gets every answer piece's text as is;
- valid actions run in order until the env says done or the budget ``actions_left`` is spent;
- the turn's info is the last executed action's (a turn that executed nothing has none, i.e. 0);
- an episode ends when the env is done or the action budget is exhausted.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp
from jumanji.types import StepType


class TurnResult(flax.struct.PyTreeNode):
    reward: jnp.ndarray  # float32: sum of the executed actions' env rewards
    reward_index: jnp.ndarray  # int32: which sequence of step rewards the turn paid (mixed radix, see below)
    num_executed: jnp.ndarray  # int32
    env_done: jnp.ndarray  # bool: the env terminated or truncated during this turn
    success: jnp.ndarray  # bool: the env reported success on its final step
    effective: jnp.ndarray  # bool: last executed action's action_is_effective (False if none)
    valid: jnp.ndarray  # bool: last executed action's action_is_valid (False if none)


def reward_categories(reward, values):
    """Index of the nearest known per-step reward value (float32 env reward -> exact category)."""
    return jnp.argmin(jnp.abs(reward - values)).astype(jnp.int32)


def execute_turn(env, state, actions, n_actions, actions_left, active, reward_values):
    """Step one row's env through the valid actions of one turn: ``(new_state, TurnResult)``.

    ``env`` is the row's env (static), ``state`` its env state. ``actions`` holds the turn's valid
    actions in order, a pytree with leading dim K whose slot ``k`` is what ``env.step`` takes: int32[K]
    action ids for named actions (unknown names already dropped), or ``(uint8[K, W], int32[K])``
    answer texts for language actions; slots past ``n_actions`` (int32, how many valid actions the
    response gave) are ignored. ``actions_left`` (int32) is the trajectory's remaining action budget,
    ``active`` (bool) whether this row still plays, and ``reward_values`` (float32[C]) the env's
    possible per-step rewards: categories for the reward message, whose text depends on the exact
    sequence of doubles. ``TurnResult.reward_index`` numbers the sequence of the executed steps'
    reward categories ``c_1, c_2, ...`` as ``sum_i (c_i + 1) * (C + 1) ** (i - 1)`` (0: no step), the
    row of the reward message in ``prompts.PromptTables`` (``reward_sequence_index``).
    """
    num_categories = reward_values.shape[0]
    slots = jnp.arange(jax.tree.leaves(actions)[0].shape[0])

    def body(carry, slot):
        st, reward, reward_index, radix, executed, done, success, effective, valid = carry
        act = active & (slot < n_actions) & (executed < actions_left) & ~done
        new_st, ts = env.step(st, jax.tree.map(lambda a: a[slot], actions))
        st = jax.tree.map(lambda n, o: jnp.where(act, n, o), new_st, st)
        category = reward_categories(ts.reward, reward_values)
        reward = reward + jnp.where(act, ts.reward, 0.0)
        reward_index = reward_index + jnp.where(act, (category + 1) * radix, 0)
        radix = jnp.where(act, radix * (num_categories + 1), radix)
        executed = executed + act.astype(jnp.int32)
        done = done | (act & (ts.step_type == StepType.LAST))
        success = jnp.where(act, ts.extras["success"], success)
        effective = jnp.where(act, ts.extras["action_is_effective"], effective)
        valid = jnp.where(act, ts.extras["action_is_valid"], valid)
        return (st, reward, reward_index, radix, executed, done, success, effective, valid), None

    false = jnp.zeros((), bool)
    init = (state, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32), jnp.ones((), jnp.int32),
            jnp.zeros((), jnp.int32), false, false, false, false)
    (state, reward, reward_index, _, executed, done, success, effective, valid), _ = jax.lax.scan(body, init, slots)
    return state, TurnResult(
        reward=reward,
        reward_index=reward_index,
        num_executed=executed,
        env_done=done,
        success=success,
        effective=effective,
        valid=valid,
    )
