"""A new environment in one file, written as a user would (docs/environments.md walks through it).

Guess a secret digit: each guess is answered "too low" or "too high", a right guess pays 1 and
ends the episode. Train on it without touching starpo-jax:

    PYTHONPATH=docs/examples python -m experiments.run --config configs/base.py \\
        --config.envs.train.tags="('guess_digit:GuessDigit',)" \\
        --config.envs.val.tags="('guess_digit:GuessDigit',)"
"""

from functools import cached_property

import jax
import jax.numpy as jnp
from flax import struct
from jumanji import specs

from envs_jax.base import TextEnv, first_timestep, make_timestep, step_extras

DIGITS = tuple(str(d) for d in range(10))
START = "Guess the secret digit.\n"
# The piece table: every observation is one or three of these (see observation_pieces).
PIECES = (START, "Your guess", *(f" {d}" for d in DIGITS), " is too low.\n", " is too high.\n")
YOUR_GUESS, FIRST_DIGIT, TOO_LOW, TOO_HIGH = 1, 2, 12, 13


@struct.dataclass
class GuessState:
    secret: jnp.ndarray  # int32[]: the digit to find
    last_guess: jnp.ndarray  # int32[]: the previous guess, -1 before the first


class GuessDigit(TextEnv):
    instruction = (
        "You are guessing a secret digit from 0 to 9. After each guess you are told whether it was "
        "too low or too high. Example answer format: <answer>5</answer>"
    )
    action_names = DIGITS  # action id d guesses digit d
    step_reward_values = (0.0, 1.0)
    default_max_actions_per_traj = 4
    piece_texts = PIECES

    def reset(self, key):
        state = GuessState(secret=jax.random.randint(key, (), 0, 10), last_guess=jnp.asarray(-1))
        return state, first_timestep(self.observation_pieces(state))

    def step(self, state, action):
        guess = jnp.asarray(action, jnp.int32)
        right = guess == state.secret
        state = state.replace(last_guess=guess)
        timestep = make_timestep(
            self.observation_pieces(state),
            reward=jnp.where(right, 1.0, 0.0),
            terminated=right,
            truncated=jnp.asarray(False),
            extras=step_extras(success=right, effective=True),
        )
        return state, timestep

    def render_text(self, state) -> str:
        guess, secret = int(state.last_guess), int(state.secret)
        if guess < 0:
            return START.rstrip("\n")
        verdict = "low" if guess < secret else "high"  # a right guess ends the episode unseen
        return f"Your guess {guess} is too {verdict}."

    def observation_pieces(self, state):
        """The start text, or "Your guess" + " d" + the verdict (-1: no piece)."""
        guess = state.last_guess
        verdict = jnp.where(guess < state.secret, TOO_LOW, TOO_HIGH)
        started = guess >= 0
        return jnp.where(
            started,
            jnp.stack([YOUR_GUESS, FIRST_DIGIT + guess, verdict]),
            jnp.array([0, -1, -1]),
        ).astype(jnp.int32)

    @cached_property
    def observation_spec(self):
        return specs.Array((3,), jnp.int32, name="pieces")

    @cached_property
    def action_spec(self):
        return specs.DiscreteArray(10, name="action")
