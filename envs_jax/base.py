"""The environment interface every starpo-jax env follows.

Envs are jumanji ``Environment`` subclasses: ``reset(key)`` and ``step(state, action)`` are pure,
``jit``- and ``vmap``-able and return ``(state, TimeStep)``. Static parameters (room size, symbols,
payouts) live on the env object; everything that varies lives in the state pytree.

On top of jumanji, a text env declares what the LLM rollout needs, the environment contract:
instruction, action names, step rewards, observation text and its pieces (see ``TextEnv``).
Grid envs (``GridEnv``) get their pieces, one per row, from ``symbols`` (the glyph of each symbol
id) and ``render_symbols(state)`` (jittable ``int32[rows, cols]`` symbol ids), and offer
``state_from_text(text)`` for custom levels. ``docs/environments.md`` walks through a new env.

Terminated and truncated stay apart: a terminated step has discount 0, a truncated one discount 1,
both are ``StepType.LAST``. ``extras`` holds per-step ``success``, ``action_is_effective`` and
``action_is_valid`` (RAGEN's ``info`` keys).

Randomness inside ``step`` comes from ``envs_jax.hashing`` (a counter-based hash of a key the
state carries); grid cells as bit sets from ``envs_jax.bitboards``.
"""

from __future__ import annotations

import abc
import itertools
from functools import cached_property
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jumanji import specs
from jumanji.env import Environment
from jumanji.types import StepType, TimeStep

from envs_jax.hashing import hash_words, mix32


def make_timestep(
    observation: Any,
    reward: jnp.ndarray,
    terminated: jnp.ndarray,
    truncated: jnp.ndarray,
    extras: dict[str, jnp.ndarray],
) -> TimeStep:
    """A jittable TimeStep from explicit flags (jumanji's helpers pick the step type in Python)."""
    last = jnp.logical_or(terminated, truncated)
    return TimeStep(
        # jumanji annotates step_type as a StepType; a jitted TimeStep holds it as an int8 array
        step_type=jnp.where(last, StepType.LAST, StepType.MID).astype(jnp.int8),  # type: ignore[arg-type]
        reward=jnp.asarray(reward, jnp.float32),
        discount=jnp.where(terminated, 0.0, 1.0).astype(jnp.float32),
        observation=observation,
        extras=extras,
    )


def first_timestep(observation: Any) -> TimeStep:
    """The TimeStep returned by ``reset``."""
    return TimeStep(
        step_type=jnp.asarray(StepType.FIRST, jnp.int8),  # type: ignore[arg-type]  # an int8 array, as above
        reward=jnp.zeros((), jnp.float32),
        discount=jnp.ones((), jnp.float32),
        observation=observation,
        extras={
            "success": jnp.zeros((), bool),
            "action_is_effective": jnp.zeros((), bool),
            "action_is_valid": jnp.zeros((), bool),
        },
    )


def step_extras(success, effective, valid=True) -> dict[str, jnp.ndarray]:
    return {
        "success": jnp.asarray(success, bool),
        "action_is_effective": jnp.asarray(effective, bool),
        "action_is_valid": jnp.asarray(valid, bool),
    }


class TextEnv(Environment, abc.ABC):
    """A jumanji environment whose observations an LLM reads as text: the environment contract.

    Everything the LLM rollout (``starpo_jax``) knows about an env is declared here, in the env's own
    file; starpo_jax reads nothing else (no class names, no fields). To write a new env, subclass
    this (or ``GridEnv``) and fill in:

    - ``instruction`` (str): the task description at the start of the first user message. The
      prompt prefix is ``instruction_text(max_actions_per_traj)``: the instruction, the ``legend``
      (grid envs: what each glyph means), and unless ``lists_actions`` is False the action list and
      the per-episode action budget. Override ``instruction_text`` for a different layout.
    - ``action_names``: every action name the env uses, and ``action_name_ids(state)`` (jittable):
      the index in ``action_names`` of each action id in this episode. Fixed names (the default):
      ``arange(num_actions)``; Bandit's arms swap places per episode.
    - ``step_reward_values``: every reward one step can pay, as the Python floats RAGEN's env
      returns; the reward message prints their sums (``str`` of the double) after each turn.
    - ``render_text(state)``: the observation text (host side, the oracle), and the same text as
      pieces from a finite table, which the rollout turns into token ids inside the graph:
      ``piece_texts`` (the table) and ``observation_pieces(state)`` (jittable: ``int32[P]`` indices
      into it, ``-1`` for none; ``P`` is the observation's budget). The pieces' texts joined are
      ``render_text(state) + "\n"``. Cut where a tokenizer starts a new chunk anyway: after a
      newline, or before a space-led word or number (a grid row with its newline is one piece).
    - ``reset(key)`` / ``step(state, action)`` (jumanji, pure, jittable), with per-step
      ``extras["success"]``, ``"action_is_effective"`` and ``"action_is_valid"``.
    - language actions instead of names (Countdown): ``answer_width`` > 0 and no ``action_names``;
      ``step(state, (bytes, length))`` then gets each answer piece's text as ``uint8[answer_width]``.
    - optionally ``reset_from_seed(seed)``: RAGEN's level for a seed (validation sets); by default
      ``reset(PRNGKey(seed))``.
    - optionally ``success_meaning``: what a successful episode is, in a few words (the
      ``extras["success"]`` the env reports at the episode's end); ``experiments/report.py`` shows
      it beside each outcome. Default: that the env reported success.
    - optionally ``default_max_actions_per_traj``: the action budget of an episode when the config
      names none (RAGEN's envs.yaml ``max_actions_per_traj``), and
      ``sample_observation_pieces(rng, P)``: random observations for the tokenizer cut checks
      (default: uniform draws from the table, right when any piece may follow any other).
    - optionally ``state_key(state)`` (jittable ``uint32[]``): which position a turn starts from,
      for GiGPO's step groups (turns of one group with equal keys are compared). Default: a hash of
      ``observation_pieces(state)``, so two states that show the same observation share a key
      whatever else they carry (FrozenLake's slip key, Bandit's payout key change every step).

    ``starpo_jax.runtime.contract.check_env`` checks an env against this contract when a run starts.
    """

    #: registry name of the variant (e.g. "SimpleSokoban"); set by ``envs_jax.make``.
    name: str = ""
    #: the task description that opens the prompt.
    instruction: str = ""
    #: whether the prompt lists the action names and the action budget after the instruction.
    lists_actions: bool = True
    #: what ``extras["success"]`` at an episode's end means, in a few words (shown by the run report).
    success_meaning: str = "the env reports success at the episode's end"
    #: an episode's action budget where the config gives none.
    default_max_actions_per_traj: int = 10
    #: language-action envs (Countdown): the answer bytes ``step(state, (bytes, length))`` reads
    #: (``uint8[answer_width]``; a longer answer is cut); such an env has no ``action_names``.
    #: 0 for envs whose actions are named (``action_names``).
    answer_width: int = 0

    @property
    @abc.abstractmethod
    def action_names(self) -> tuple[str, ...]:
        """Every action name, in action-id order for envs whose names are fixed."""

    @property
    def num_actions(self) -> int:
        """Actions one step accepts (ids ``0 .. num_actions - 1``)."""
        return len(self.action_names)

    def action_name_ids(self, state) -> jnp.ndarray:
        """Jittable ``int32[num_actions]``: the ``action_names`` index of each action id this episode."""
        return jnp.arange(self.num_actions, dtype=jnp.int32)

    @property
    @abc.abstractmethod
    def step_reward_values(self) -> tuple[float, ...]:
        """Every reward one step can pay, as Python floats (their order fixes the reward keys)."""

    def legend(self, from_env_symbols: bool = False) -> str:
        """Text after the instruction that explains the observation's symbols ("" for none)."""
        return ""

    def instruction_text(self, max_actions_per_traj: int, legend_from_env_symbols: bool = False) -> str:
        """The per-tag prefix of the first user message (RAGEN's ``env_instruction``, ragen-reference.md §2.3)."""
        text = self.instruction + self.legend(legend_from_env_symbols)
        if self.lists_actions:
            text += "\nYour available actions are:\n" + ", ".join(self.action_names)
            text += (
                f"\nYou can make up to {max_actions_per_traj} actions, "
                'separated by the action separator " || "\n'
            )
        return text

    @abc.abstractmethod
    def render_text(self, state) -> str:
        """The observation text exactly as RAGEN renders it."""

    @property
    @abc.abstractmethod
    def piece_texts(self) -> Sequence[str]:
        """The finite table of observation pieces (host side, built once)."""

    @abc.abstractmethod
    def observation_pieces(self, state) -> jnp.ndarray:
        """Jittable ``int32[P]``: the observation as indices into ``piece_texts`` (``-1``: none)."""

    def state_key(self, state) -> jnp.ndarray:
        """Jittable ``uint32[]``: the position ``state`` shows the model, as a key. GiGPO groups the
        turns of a group that start from equal keys (verl-agent's anchor states).

        Default: a hash of ``observation_pieces(state)`` (the observation the turn starts from), so
        states that differ only in what the model cannot see, such as an RNG key the state carries,
        share a key. Each piece is hashed with its position (``hashing.hash_words``), the hashes
        summed modulo 2**32 and mixed: two different observations share a key with probability
        about 2**-32. Override it to compare turns by something other than the observation.
        """
        pieces = jax.lax.bitcast_convert_type(jnp.asarray(self.observation_pieces(state), jnp.int32), jnp.uint32)
        pieces = pieces.reshape(-1)
        position = jnp.arange(pieces.shape[0], dtype=jnp.uint32)
        total = jnp.sum(hash_words(pieces, position), dtype=jnp.uint32)
        return mix32(total ^ jnp.uint32(pieces.shape[0]))

    def reset_from_seed(self, seed: int):
        """A level for ``seed`` (host side); envs with RAGEN's seeded levels reproduce them."""
        return self.reset(jax.random.PRNGKey(seed))[0]

    def sample_observation_pieces(self, rng, num_pieces: int) -> list[int]:
        """Host: the pieces of a random observation, for checking the cuts between pieces against
        a tokenizer. Default: ``num_pieces`` pieces drawn uniformly from the table (right for grid
        rows); envs whose pieces follow an order (a list: first item, later items, end) override it."""
        return [int(rng.integers(len(self.piece_texts))) for _ in range(num_pieces)]


class GridEnv(TextEnv, abc.ABC):
    """A text env whose observation is a grid of symbols, one glyph per cell, one piece per row."""

    #: The glyph of each symbol id, e.g. Sokoban ``("#", "_", "O", "√", "X", "P", "S")``; set in ``__init__``.
    grid_symbols: tuple[str, ...] = ()
    #: What each symbol id means, for the legend and the run report's boards (``experiments/report.py``
    #: draws the meanings it knows, such as "wall", "box on target" or "hole", and any other as its
    #: glyph); ``()``: no legend.
    symbol_meanings: tuple[str, ...] = ()
    #: Symbol id every border cell holds in every state (Sokoban's wall), or None. Only the interior
    #: of a row then varies, which keeps the row table small (an 8x8 room: 7**6 rows, not 7**8).
    border_symbol: int | None = None

    @property
    def symbols(self) -> tuple[str, ...]:
        return self.grid_symbols

    @property
    def legend_symbols(self) -> tuple[str, ...]:
        """The glyphs the legend names (RAGEN: its config class's defaults, see Sokoban)."""
        return self.symbols

    def legend(self, from_env_symbols: bool = False) -> str:
        if not self.symbol_meanings:
            return ""
        symbols = self.symbols if from_env_symbols else self.legend_symbols
        entries = ", ".join(f"{s}: {m}" for s, m in zip(symbols, self.symbol_meanings))
        return "\nThe meaning of each symbol in the state is:\n" + entries

    @cached_property
    def action_spec(self):
        return specs.DiscreteArray(len(self.action_names), name="action")

    @property
    @abc.abstractmethod
    def grid_shape(self) -> tuple[int, int]:
        """(rows, cols) of the rendered grid."""

    @abc.abstractmethod
    def render_symbols(self, state) -> jnp.ndarray:
        """Jittable: ``int32[rows, cols]`` symbol ids of the observation."""

    @abc.abstractmethod
    def state_from_text(self, text: str):
        """A state from a rendered grid; a malformed grid is a ``ValueError`` naming the problem."""

    def render_text(self, state) -> str:
        return symbols_to_text(self.render_symbols(state), self.symbols)

    # ---- pieces: one per row, keyed by the row's varying cells ---------------------------------

    def _row_width(self) -> int:
        """Cells of a row that vary (all, or the interior when the border is fixed)."""
        return self.grid_shape[1] - (2 if self.border_symbol is not None else 0)

    @cached_property
    def piece_texts(self) -> tuple[str, ...]:
        """Every possible row with its newline, keyed by its varying cells' symbol ids read as a
        base-``len(symbols)`` number, first cell most significant (``itertools.product``'s order)."""
        wall = self.symbols[self.border_symbol] if self.border_symbol is not None else ""
        return tuple(
            wall + "".join(cells) + wall + "\n"
            for cells in itertools.product(self.symbols, repeat=self._row_width())
        )

    def grid_pieces(self, symbol_grid) -> jnp.ndarray:
        """Jittable ``int32[rows]``: the piece of each row of a ``[rows, cols]`` symbol grid."""
        cells = jnp.asarray(symbol_grid, jnp.int32)
        if self.border_symbol is not None:
            cells = cells[:, 1:-1]
        weights = len(self.symbols) ** jnp.arange(cells.shape[1] - 1, -1, -1, dtype=jnp.int32)
        return cells @ weights

    def observation_pieces(self, state) -> jnp.ndarray:
        return self.grid_pieces(self.render_symbols(state))


def symbols_to_text(grid, symbols: Sequence[str]) -> str:
    """Rows of glyphs joined by newlines, no trailing newline (RAGEN's text rendering)."""
    grid = np.asarray(grid)
    return "\n".join("".join(symbols[int(c)] for c in row) for row in grid)


def parse_grid_text(text: str, symbols: Sequence[str], what: str) -> list[list[int]]:
    """Split a rendered grid into symbol ids; ragged rows or unknown glyphs are ValueErrors."""
    lookup = {s: i for i, s in enumerate(symbols)}
    rows = text.strip("\n").split("\n")
    if not rows or not rows[0]:
        raise ValueError(f"{what} level is empty.")
    width = len(rows[0])
    ids = []
    for r, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(
                f"{what} level has ragged rows: row {r} has {len(row)} cells, row 0 has {width}."
            )
        for c, ch in enumerate(row):
            if ch not in lookup:
                raise ValueError(
                    f"{what} level has unknown symbol {ch!r} at row {r}, column {c}; "
                    f"known symbols: {' '.join(symbols)}."
                )
        ids.append([lookup[ch] for ch in row])
    return ids
