"""FrozenLake (RAGEN ``frozen_lake``): walk on slippery ice from the start to the goal, avoiding holes.

The transition and reward rules are gymnasium's ``FrozenLakeEnv``; the maps are RAGEN's (random start,
random goal, a path from one to the other guaranteed).

- Actions 0..3 = Left, Down, Right, Up (RAGEN's LLM action ``k`` is gym action ``k-1``, and ours).
- Slippery ice: the realised direction is ``a-1``, ``a`` or ``a+1`` (mod 4), each with probability 1/3.
  Moving off the grid leaves the player in place.
- Reward 1 on entering the goal, else 0. Entering the goal or a hole terminates the episode; once
  there, further steps change nothing and pay nothing (gymnasium's absorbing terminal states).
- ``action_is_effective``: the position changed; ``success``: the player stands on the goal.

The state (``FrozenLakeState``) keeps holes and goals as bitboards (``envs_jax.base``) and the
start and player as flat cell indices, so a step reads a couple of bits; ``board`` and ``pos`` give
the grid view.

Rendering: one glyph per cell, ``grid_symbols`` indexed by RAGEN's grid codes
0 player, 1 empty (frozen and start), 2 hole, 3 goal, 4 player in a hole, 5 player on the goal.

Departures from RAGEN, documented:

- ``max_steps`` (default 100) truncates an episode. RAGEN's env has no time limit; its rollout budget
  (turns × actions per turn) ends episodes long before, so the limit never binds there.
- Slips hash the key in the state (``envs_jax.hashing.draw_bits``, a counter-based hash that is much
  cheaper under ``vmap`` than ``jax.random``), not gymnasium's ``np_random``: ``reset_from_seed``
  reproduces RAGEN's map for a seed exactly, but not its slip sequence. ``realised_direction`` (the
  slip rule, given a uniform draw) and ``step_in_direction`` (the deterministic transition) are
  what both share; the tests replay gymnasium's draws through them.
- ``reset(key)`` draws maps from RAGEN's distribution (cells frozen with probability ``p``, start and
  goal uniform and distinct, rejected until the goal is reachable) with JAX randomness, so it is not
  seed-compatible; use ``reset_from_seed`` for RAGEN's levels (e.g. validation seeds 123..378).
"""

from __future__ import annotations

from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jumanji import specs

from envs_jax.base import GridEnv, first_timestep, make_timestep, parse_grid_text, step_extras
from envs_jax.bitboards import cell_bit, flat_cells, pack_cells, unpack_cells
from envs_jax.hashing import bits_to_uniform, draw_bits
from envs_jax.seeding import gymnasium_rng

# Board cell codes (gymnasium's map letters F, H, S, G).
FROZEN, HOLE, START, GOAL = 0, 1, 2, 3
LETTERS = "FHSG"

# Grid symbol ids (RAGEN's grid_lookup).
PLAYER, EMPTY, HOLE_SYM, GOAL_SYM, PLAYER_IN_HOLE, PLAYER_ON_GOAL = range(6)

ACTION_NAMES = ("Left", "Down", "Right", "Up")
DEFAULT_GRID_SYMBOLS = ("P", "_", "O", "G", "X", "√")
INSTRUCTION = (  # sic: "Forbid the whole", as in RAGEN's envs.yaml
    "You are solving the FrozenLake puzzle. Forbid the whole and go to the target. You may move to "
    "the unintended direction due to the slippery ice. Example answer format: <think>To forbid the "
    "hole and go to the target, I should go left then go up.</think><answer>Left || Up</answer>"
)
SYMBOL_MEANINGS = ("player", "empty", "hole", "goal", "player in hole", "player on goal")
# (d_row, d_col) of each direction, in action order.
DIRECTION_DELTAS = np.array([[0, -1], [1, 0], [0, 1], [-1, 0]], np.int32)


class FrozenLakeState(struct.PyTreeNode):
    """A FrozenLake state: holes and goals as bitboards (``envs_jax.base``), cells as row-major
    indices, so a step reads a couple of bits. ``board`` and ``pos`` give the grid view."""

    holes: tuple[jnp.ndarray, ...]  # uint32 words: hole cells
    goals: tuple[jnp.ndarray, ...]  # uint32 words: goal cells
    start_cell: jnp.ndarray  # int32[]: row * size + col of the start
    player_cell: jnp.ndarray  # int32[]: row * size + col of the player
    step_count: jnp.ndarray  # int32[] actions taken this episode
    key: jnp.ndarray  # PRNG key for slips (``draw_bits``)
    size: int = struct.field(pytree_node=False)

    @property
    def board(self):
        """int8[..., size, size] of FROZEN / HOLE / START / GOAL."""
        shape = (self.size, self.size)
        start = flat_cells(shape) == self.start_cell[..., None, None]
        board = jnp.where(start, START, FROZEN)
        board = jnp.where(unpack_cells(self.holes, shape), HOLE, board)
        return jnp.where(unpack_cells(self.goals, shape), GOAL, board).astype(jnp.int8)

    @property
    def pos(self):
        """int32[..., 2]: the player's (row, col)."""
        return jnp.stack(jnp.divmod(self.player_cell, self.size), axis=-1)


def neighbour_cell(cell, direction, size: int):
    """The cell one step from row-major ``cell`` in ``direction``; off-grid moves stay put.
    Selects rather than a table lookup: cheaper under ``vmap``."""
    row, col = cell // size, cell % size
    stays = jnp.select(
        [direction == 0, direction == 1, direction == 2], [col == 0, row == size - 1, col == size - 1],
        row == 0,
    )
    step = jnp.select([direction == 0, direction == 1, direction == 2], [-1, size, 1], -size)
    return jnp.where(stays, cell, cell + step)


def goal_reachable(board) -> jnp.ndarray:
    """Jittable: whether a 4-connected path over non-hole cells joins the start to a goal.

    A flood fill from the start on bit rows (bit ``c`` of word ``r`` is cell ``(r, c)``), so one
    growth step is a few shifts and ors; ``size**2`` steps cover any path.
    """
    bit = jnp.left_shift(jnp.uint32(1), jnp.arange(board.shape[1], dtype=jnp.uint32))

    def bit_rows(mask):
        return jnp.sum(jnp.where(mask, bit, jnp.uint32(0)), axis=1, dtype=jnp.uint32)

    passable, goal = bit_rows(board != HOLE), bit_rows(board == GOAL)
    zero = jnp.zeros((1,), jnp.uint32)

    def grow(_, reached):
        sideways = reached | (reached << 1) | (reached >> 1)  # bits past the edge fail `passable`
        from_above = jnp.concatenate([zero, reached[:-1]])
        from_below = jnp.concatenate([reached[1:], zero])
        return (sideways | from_above | from_below) & passable

    reached = jax.lax.fori_loop(0, board.size, grow, bit_rows(board == START))
    return jnp.any((reached & goal) != 0)


class FrozenLake(GridEnv):
    instruction = INSTRUCTION
    symbol_meanings = SYMBOL_MEANINGS
    success_meaning = "the player reaches the goal"
    legend_symbols = DEFAULT_GRID_SYMBOLS  # RAGEN's legend names its config class's glyphs
    step_reward_values = (0.0, 1.0)

    def __init__(
        self,
        size: int = 4,
        p: float = 0.8,
        is_slippery: bool = True,
        max_steps: int = 100,
        grid_symbols: tuple[str, ...] = DEFAULT_GRID_SYMBOLS,
    ):
        if not 2 <= size <= 32:  # the flood fill packs a row into 32 bits
            raise ValueError(f"FrozenLake size must be between 2 and 32, got {size}.")
        if not 0.0 < p <= 1.0:
            raise ValueError(f"FrozenLake p (probability of frozen ice) must be in (0, 1], got {p}.")
        if len(grid_symbols) != 6 or len(set(grid_symbols)) != 6:
            raise ValueError(
                f"FrozenLake grid_symbols must be 6 distinct glyphs (player, empty, hole, goal, "
                f"player in hole, player on goal), got {grid_symbols!r}."
            )
        self.size = size
        self.p = p
        self.is_slippery = is_slippery
        self.max_steps = max_steps
        self.grid_symbols = tuple(grid_symbols)
        super().__init__()

    def __repr__(self) -> str:
        return f"FrozenLake(size={self.size}, p={self.p}, is_slippery={self.is_slippery})"

    # ---- jumanji API -------------------------------------------------------------------------

    def reset(self, key):
        """A random solvable map from RAGEN's distribution, drawn until the goal is reachable."""
        key, map_key = jax.random.split(key)

        cells = jnp.arange(self.size * self.size)

        def draw(carry):
            key, _ = carry
            key, draw_key = jax.random.split(key)
            u = jax.random.uniform(draw_key, (cells.size + 4,))  # one draw per cell, then S and G
            row_col = jnp.floor(u[-4:] * self.size).astype(jnp.int32)
            start = row_col[0] * self.size + row_col[1]
            goal = row_col[2] * self.size + row_col[3]
            board = jnp.where(u[:-4] < self.p, FROZEN, HOLE)
            # Goal written last, so start == goal leaves no start and the flood fill rejects it.
            board = jnp.where(cells == start, START, board)
            board = jnp.where(cells == goal, GOAL, board)
            return key, board.reshape(self.size, self.size).astype(jnp.int8)

        def unsolvable(carry):
            return ~goal_reachable(carry[1])

        empty = jnp.zeros((self.size, self.size), jnp.int8)  # no start: rejected, so drawn at least once
        _, board = jax.lax.while_loop(unsolvable, draw, (map_key, empty))
        state = self._state(board, jnp.argmax((board == START).ravel()), key)
        return state, first_timestep(self.render_symbols(state))

    def step(self, state: FrozenLakeState, action):
        """Take ``action``; on slippery ice the realised direction is a random neighbour of it."""
        key, bits = draw_bits(state.key)
        direction = self.realised_direction(action, bits_to_uniform(bits))
        return self.step_in_direction(state.replace(key=key), direction)

    def realised_direction(self, action, u):
        """``action`` itself, or on slippery ice ``action - 1``, ``action``, ``action + 1`` (mod 4)
        for a uniform draw ``u`` in the first, second, last third of [0, 1) (gymnasium's rule)."""
        action = jnp.asarray(action, jnp.int32)
        if not self.is_slippery:
            return action
        offset = jnp.floor(3 * u).astype(jnp.int32) - 1
        return (action + offset) % 4

    def step_in_direction(self, state: FrozenLakeState, direction):
        """The deterministic transition once the slip is known (gymnasium's ``P[s][a]`` entries)."""
        def terminal(cell):
            return cell_bit(state.holes, cell) | cell_bit(state.goals, cell)

        absorbed = terminal(state.player_cell)
        ahead = neighbour_cell(state.player_cell, direction, self.size)
        player = jnp.where(absorbed, state.player_cell, ahead)
        on_goal = cell_bit(state.goals, player)
        terminated = terminal(player)
        step_count = state.step_count + 1
        moved = player != state.player_cell
        state = state.replace(player_cell=player, step_count=step_count)
        timestep = make_timestep(
            self.render_symbols(state),
            reward=jnp.where(on_goal & ~absorbed, 1.0, 0.0),
            terminated=terminated,
            truncated=(step_count >= self.max_steps) & ~terminated,
            extras=step_extras(success=on_goal, effective=moved),
        )
        return state, timestep

    @cached_property
    def observation_spec(self):
        return specs.BoundedArray(
            (self.size, self.size), jnp.int32, minimum=0, maximum=5, name="grid"
        )

    # ---- text --------------------------------------------------------------------------------

    @property
    def action_names(self) -> tuple[str, ...]:
        return ACTION_NAMES

    @property
    def grid_shape(self) -> tuple[int, int]:
        return self.size, self.size

    def render_symbols(self, state: FrozenLakeState):
        """Jittable ``int32[size, size]`` of RAGEN grid codes.

        Elementwise selects rather than table lookups and a scatter: much cheaper under ``vmap``.
        """
        shape = (self.size, self.size)
        player = flat_cells(shape) == state.player_cell
        hole = jnp.where(player, PLAYER_IN_HOLE, HOLE_SYM)
        goal = jnp.where(player, PLAYER_ON_GOAL, GOAL_SYM)
        frozen = jnp.where(player, PLAYER, EMPTY)  # frozen ice and the start
        symbols = jnp.where(
            unpack_cells(state.holes, shape), hole,
            jnp.where(unpack_cells(state.goals, shape), goal, frozen),
        )
        return symbols.astype(jnp.int32)

    def state_from_text(self, text: str) -> FrozenLakeState:
        """A state from a rendered grid; the player's cell (if ``P``) becomes the start."""
        ids = np.array(parse_grid_text(text, self.symbols, "FrozenLake"), np.int32)
        if ids.shape != (self.size, self.size):
            raise ValueError(
                f"FrozenLake level is {ids.shape[0]}x{ids.shape[1]} but this env is "
                f"{self.size}x{self.size}; pass a {self.size}x{self.size} grid or set size."
            )
        players = np.argwhere(np.isin(ids, [PLAYER, PLAYER_IN_HOLE, PLAYER_ON_GOAL]))
        if len(players) != 1:
            glyphs = ", ".join(self.symbols[i] for i in (PLAYER, PLAYER_IN_HOLE, PLAYER_ON_GOAL))
            raise ValueError(
                f"FrozenLake level must have exactly one player cell ({glyphs}), found {len(players)}."
            )
        if not np.isin(ids, [GOAL_SYM, PLAYER_ON_GOAL]).any():
            raise ValueError(
                f"FrozenLake level has no goal; mark one cell {self.symbols[GOAL_SYM]!r}."
            )
        board_of_symbol = np.array([START, FROZEN, HOLE, GOAL, HOLE, GOAL], np.int8)
        return self._state(board_of_symbol[ids], players[0] @ [self.size, 1], key=jax.random.PRNGKey(0))

    # ---- RAGEN seeds -------------------------------------------------------------------------

    def reset_from_seed(self, seed: int) -> FrozenLakeState:
        """RAGEN's map for ``seed`` (``generate_random_map``), player on its start.

        The slip key is ``PRNGKey(seed)`` (RAGEN's slip stream is not reproduced).
        """
        rows = generate_random_map(self.size, self.p, seed)
        board = np.array([[LETTERS.index(ch) for ch in row] for row in rows], np.int8)
        start = np.flatnonzero(board == START)[0]
        return self._state(board, start, key=jax.random.PRNGKey(seed))

    # ---- helpers -----------------------------------------------------------------------------

    def _state(self, board, start_cell, key) -> FrozenLakeState:
        """The state at the start of an episode on ``board`` (int8 grid), player on ``start_cell``."""
        board = jnp.asarray(board, jnp.int8)
        start_cell = jnp.asarray(start_cell, jnp.int32)
        return FrozenLakeState(
            holes=pack_cells(board == HOLE),
            goals=pack_cells(board == GOAL),
            start_cell=start_cell,
            player_cell=start_cell,
            step_count=jnp.zeros((), jnp.int32),
            key=key,
            size=self.size,
        )


def board_letters(state: FrozenLakeState) -> list[str]:
    """Host: the map as gymnasium ``desc`` rows of F/H/S/G."""
    return ["".join(LETTERS[c] for c in row) for row in np.asarray(state.board)]


def generate_random_map(size: int = 4, p: float = 0.8, seed: int | None = None) -> list[str]:
    """Exact port of RAGEN's ``generate_random_map``: rows of F/H/S/G with S→G reachable."""
    return draw_random_map(gymnasium_rng(seed) if seed is not None else np.random.default_rng(), size, p)


def draw_random_map(rng: np.random.Generator, size: int, p: float) -> list[str]:
    """RAGEN's map recipe on a given generator.

    Draw order (it defines the map of every seed): board cells frozen with probability ``p``, then
    start (row, col), then goal (row, col); start == goal or an unreachable goal draws again.
    """
    while True:
        board = rng.choice(["F", "H"], (size, size), p=[p, 1 - p])
        start_r, start_c = rng.integers(size, size=2)
        goal_r, goal_c = rng.integers(size, size=2)
        if (start_r, start_c) != (goal_r, goal_c):
            board[start_r][start_c], board[goal_r][goal_c] = "S", "G"
            if _host_goal_reachable(board, (start_r, start_c)):
                return ["".join(row) for row in board]


def _host_goal_reachable(board, start) -> bool:
    """Depth-first search from ``start`` over non-hole cells (RAGEN's ``is_valid``)."""
    size = len(board)
    frontier, seen = [tuple(start)], set()
    while frontier:
        r, c = frontier.pop()
        if (r, c) in seen:
            continue
        seen.add((r, c))
        if board[r][c] == "G":
            return True
        for dr, dc in DIRECTION_DELTAS:
            nr, nc = r + dr, c + dc
            if 0 <= nr < size and 0 <= nc < size and board[nr][nc] != "H":
                frontier.append((nr, nc))
    return False
