"""Bi-arm bandit (RAGEN ``bandit``): pick one of two named arms, once.

One arm is safe (``lo_arm_score`` every pull), the other risky (``hi_arm_hiscore`` with probability
``hi_arm_hiscore_prob``, else ``hi_arm_loscore``). The prompt names the two arms in a random order;
the agent is meant to infer from the names alone which arm is which.

Action ids are positions in the prompt: action 0 pulls the arm named first, action 1 the arm named
second (RAGEN's ``action_lookup`` ``{1: name_a, 2: name_b}``, shifted to 0-based). Because the order
changes per episode, ``action_names`` is ``(safe arm, risky arm)`` and ``action_name_ids(state)``
(jittable, the env contract's per-episode names) says which of them each action id is:
``[1, 0]`` when the risky arm is named first (``hi_first``). Host helpers: ``arm_names(state)``
(the two names in action-id order), ``first_is_hi`` / ``action_is_hi`` (jittable).

The prompt has no instruction prefix (RAGEN's Bandit config has no ``action_lookup`` at class
level): the rules are the observation, one piece per arm order. RAGEN's observation after a pull
(``"Dragon: 0.0 points"``) has no counterpart: every pull ends the episode, and a rollout never
shows the final observation (ragen-reference.md §2.6); the pull's reward reaches the model as the reward message,
written from ``step_reward_values``.

Departures from RAGEN, documented:

- [quirk 16, configurable; ragen-reference.md §1.2] The paper says the safe arm pays 0.15; RAGEN's
  code pays 0.1. We keep the code's 0.1 as the default (``lo_arm_score``).
- Payout draws hash the key in the state (``envs_jax.hashing.draw_bits``, a counter-based hash that
  is much cheaper under ``vmap`` than ``jax.random``), not gymnasium's ``np_random`` stream, so a
  given seed reproduces RAGEN's arm order (``reset_from_seed``) but not its payout sequence.
  ``payout`` is the pure rule both share; the tests drive it with gymnasium's draws to reproduce
  RAGEN's golden step.
"""

from __future__ import annotations

from functools import cached_property

import jax
import jax.numpy as jnp
from flax import struct
from jumanji import specs

from envs_jax.base import TextEnv, first_timestep, make_timestep, step_extras
from envs_jax.hashing import bits_to_uniform, draw_bits
from envs_jax.seeding import gymnasium_rng

INIT_PROMPT = (
    "You are playing a bandit game. Goal: Maximize your total reward by choosing which arm to pull. \n"
    "Game Rules: \n"
    "1. There are 2 arms, named {name_a} and {name_b}\n"
    "2. Each arm has its own reward distribution, related to their names. \n"
    "3. Analyze the symbolic meaning of each arm's name to guess how their reward distribution "
    "might behave.\n"
    "4. Based on the symbolic meaning of their names, which arm do you think is more likely to give "
    "higher rewards on average? Choose between {name_a} and {name_b}, and output like "
    "<answer> {name_a} </answer> or <answer> {name_b} </answer>.\n"
)


class BanditState(struct.PyTreeNode):
    hi_first: jnp.ndarray  # bool[]: the risky (high) arm is named first in the prompt
    key: jnp.ndarray  # PRNG key for payouts (``draw_bits``)


class Bandit(TextEnv):
    lists_actions = False
    default_max_actions_per_traj = 1

    def __init__(
        self,
        lo_arm_name: str = "Phoenix",
        hi_arm_name: str = "Dragon",
        lo_arm_score: float = 0.1,
        hi_arm_loscore: float = 0.0,
        hi_arm_hiscore: float = 1.0,
        hi_arm_hiscore_prob: float = 0.25,
    ):
        if lo_arm_name.lower() == hi_arm_name.lower():
            raise ValueError(
                f"Bandit arm names must differ (case-insensitively), got {lo_arm_name!r} twice."
            )
        self.lo_arm_name = lo_arm_name
        self.hi_arm_name = hi_arm_name
        self.lo_arm_score = lo_arm_score
        self.hi_arm_loscore = hi_arm_loscore
        self.hi_arm_hiscore = hi_arm_hiscore
        self.hi_arm_hiscore_prob = hi_arm_hiscore_prob
        self.success_meaning = (f"pulling the risky arm, {hi_arm_name}, whatever it pays; the safe arm, "
                                f"{lo_arm_name}, pays {lo_arm_score} every time and is a failure")
        super().__init__()

    def __repr__(self) -> str:
        return f"Bandit(lo={self.lo_arm_name!r}, hi={self.hi_arm_name!r})"

    # ---- jumanji API -------------------------------------------------------------------------

    def reset(self, key):
        """The arm order is a fair coin."""
        order_key, key = jax.random.split(key)
        state = BanditState(hi_first=jax.random.bernoulli(order_key), key=key)
        return state, first_timestep(state.hi_first)

    def step(self, state: BanditState, action):
        """Pull arm ``action`` (0: named first, 1: named second); the episode always ends."""
        key, bits = draw_bits(state.key)
        is_hi = self.action_is_hi(state, action)
        reward = self.payout(is_hi, bits_to_uniform(bits))
        state = state.replace(key=key)
        timestep = make_timestep(
            state.hi_first,
            reward,
            terminated=jnp.asarray(True),
            truncated=jnp.asarray(False),
            extras=step_extras(success=is_hi, effective=True),
        )
        return state, timestep

    def payout(self, is_hi, u):
        """Reward of one pull given a uniform draw ``u``: RAGEN's ``u < prob`` rule for the risky arm."""
        hi = jnp.where(u < self.hi_arm_hiscore_prob, self.hi_arm_hiscore, self.hi_arm_loscore)
        return jnp.where(is_hi, hi, self.lo_arm_score).astype(jnp.float32)

    @cached_property
    def observation_spec(self):
        return specs.Array((), bool, name="hi_first")

    @cached_property
    def action_spec(self):
        return specs.DiscreteArray(2, name="action")

    # ---- arm order -------------------------------------------------------------------------

    @staticmethod
    def first_is_hi(state: BanditState):
        """Jittable: whether action 0 (the arm named first) is the risky arm."""
        return state.hi_first

    def action_name_ids(self, state: BanditState):
        """``[0, 1]`` (safe arm first) or ``[1, 0]`` (risky arm first)."""
        hi_first = jnp.asarray(state.hi_first, jnp.int32)
        return jnp.stack([hi_first, 1 - hi_first])

    @staticmethod
    def action_is_hi(state: BanditState, action):
        """Jittable: whether ``action`` pulls the risky arm."""
        return (jnp.asarray(action) == 0) == state.hi_first

    @property
    def lo_hi_names(self) -> tuple[str, str]:
        """(safe arm name, risky arm name)."""
        return self.lo_arm_name, self.hi_arm_name

    def arm_names(self, state: BanditState) -> tuple[str, str]:
        """Host: the arm names in action-id order (the order of the prompt)."""
        lo, hi = self.lo_hi_names
        return (hi, lo) if bool(state.hi_first) else (lo, hi)

    @property
    def action_names(self) -> tuple[str, ...]:
        """(safe arm, risky arm); which action id is which changes per episode (``action_name_ids``)."""
        return self.lo_hi_names

    @property
    def step_reward_values(self) -> tuple[float, ...]:
        return tuple(dict.fromkeys((self.lo_arm_score, self.hi_arm_loscore, self.hi_arm_hiscore)))

    # ---- text --------------------------------------------------------------------------------

    def render_text(self, state: BanditState) -> str:
        """The reset prompt, exactly as RAGEN renders it."""
        name_a, name_b = self.arm_names(state)
        return INIT_PROMPT.format(name_a=name_a, name_b=name_b)

    @cached_property
    def piece_texts(self) -> tuple[str, ...]:
        """The reset prompt for each arm order (indexed by ``hi_first``), with its final newline."""
        lo, hi = self.lo_hi_names
        return tuple(INIT_PROMPT.format(name_a=a, name_b=b) + "\n" for a, b in ((lo, hi), (hi, lo)))

    def observation_pieces(self, state: BanditState):
        return jnp.asarray(state.hi_first, jnp.int32)[None]

    # ---- RAGEN seeds -------------------------------------------------------------------------

    def reset_from_seed(self, seed: int) -> BanditState:
        """RAGEN's arm order for ``seed``: first gymnasium draw < 0.5 puts the safe arm first.

        The payout key is ``PRNGKey(seed)`` (RAGEN's payout stream is not reproduced).
        """
        hi_first = not gymnasium_rng(seed).random() < 0.5
        return BanditState(hi_first=jnp.asarray(hi_first), key=jax.random.PRNGKey(seed))
