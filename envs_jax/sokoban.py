"""Sokoban (RAGEN ``sokoban``): push every box onto a target, in pure JAX.

Rules are gym_sokoban's, as RAGEN uses them:

- Actions 0..3 = Up, Down, Left, Right (RAGEN's LLM action ``k`` is ours ``k-1``), all "push"
  actions: a box ahead is pushed if the cell beyond it is floor or an empty target; otherwise the
  player steps onto free floor or target; otherwise nothing happens.
- Reward per step: -0.1, +1 / -1 when the number of boxes on targets goes up / down, +10 when all are
  on targets (10.9 for the last push of a one-box level). Solving terminates; reaching ``max_steps``
  unsolved truncates.
- ``action_is_effective``: the player moved; ``success``: all boxes are on targets.

The state (``SokobanState``) keeps walls, targets and boxes as bitboards (``envs_jax.base``) and
the player as a flat cell index, so a step reads and flips a few bits: under ``vmap`` each word is
one batch-long vector, which XLA vectorises, where a grid of cells per row compiles to loops over
each row's cells (docs/benchmarks.md, "Environments"). Its grid view: cell codes of ``room_state`` are 0
wall, 1 floor, 2 empty target, 3 box on target, 4 box, 5 player; ``room_fixed`` holds 0 wall, 1
floor, 2 target. Rendering adds 6 = player on a target, and maps code ``i`` to
``grid_symbols[i]``.

Levels:

- ``reset_from_seed(seed)``: RAGEN's level for that seed, from the host reference generator
  (``envs_jax.sokoban_reference``), so validation sets are RAGEN's levels exactly.
- ``reset(key)``: a fresh level generated inside ``jit`` with the same recipe in JAX form: the
  random-walk topology, a random player and targets, then reverse play (the player pulls the boxes
  away from their targets, so every level is solvable by construction), keeping the visited state
  with the best RAGEN score ``box_swaps * sum of Manhattan displacements`` among states that leave
  every target uncovered, and finally RAGEN's random player shuffle. Failed attempts (too little
  floor, or no box displaced) are redrawn in a ``lax.while_loop``, ``CANDIDATES_PER_ROUND`` at a
  time.
- ``state_from_text(text)``: a custom level from its rendering.

Reverse play: RAGEN runs a recursive DFS over every state within ``search_depth - 2`` moves, which
does not map onto SIMD hardware. Here it is ``num_walks`` random walks run side by side (``vmap`` of
a ``lax.scan``); each step moves the player to a uniformly chosen free neighbour (never into a wall,
so no step is wasted), pulling the box behind it if there is one. The walks draw their choices
from a counter-based hash of the key (``envs_jax.hashing.hash_uniform``): generation on CPU is
several times faster than with ``jax.random.uniform`` (docs/benchmarks.md, "Environments"). A
walk is as long as the DFS is deep, ``search_depth - 2``, capped at ``MAX_WALK_LENGTH``;
``num_walks`` spends ``WALK_STEP_BUDGET`` steps in all (at least ``NUM_WALKS`` walks), so shallow
searches get more walks. Measured difficulty (mean optimal solution length by BFS,
``envs_jax.solvers``; keys from ``split(PRNGKey(0), n)``):

| variant | ``reset(key)`` (keys) | RAGEN's generator (seeds) |
|---|---|---|
| SimpleSokoban | 4.08, 76.7 % within 5 (2048) | 4.08, 76.0 % within 5 (0..4095) |
| SokobanDifferentGridVocab | 3.99 (1024) | 4.06 (0..4095) |
| LargerSokoban | 5.80, 43 % within 5 (1024) | 5.79, 46 % within 5 (1000..2023) |

(RAGEN's validation seeds 123..378 of SimpleSokoban happen to be a little easier: mean 3.95.)

``tests/envs/test_sokoban_generation.py`` asserts that 64 generated SimpleSokoban levels are all
solvable with mean optimal length in ``DIFFICULTY_BAND`` (RAGEN's mean 4.08 ± 3 standard errors of
a 64-level mean).

Departures from RAGEN, documented:

- ``reset(key)`` draws from a distribution close to RAGEN's but is not seed-compatible with it (see
  above); ``reset_from_seed`` is.
- Levels from ``state_from_text`` must be enclosed by walls (the whole outer border is wall), as
  generated levels always are. gym_sokoban indexes with Python's wrap-around at the top and left
  edges, so open levels would behave oddly there; enclosed levels keep the player on the grid and
  let the token renderer assume wall borders. Their number of boxes may differ from the env's
  ``num_boxes``: success and the box count always come from the state's own targets.
- ``boxes_on_target`` starts at the level's actual count (gym_sokoban starts it at 0, which only
  differs for a custom level with a box already on a target, where gym_sokoban would pay a spurious
  +1 on the first step).
- [quirk 2, fixed] RAGEN's seed fallback is deterministic here (see ``sokoban_reference``).
- [quirk 1, replicated] The prompt legend names the default glyphs (``legend_symbols``), as
  RAGEN's config class does, so SokobanDifferentGridVocab's legend explains ``# _ O √ X P S`` while
  its grid shows ``W . G C B A @``; the rollout's ``legend_from_env_symbols`` explains the glyphs
  the grid uses.
"""

from __future__ import annotations

from functools import cached_property

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jumanji import specs

from envs_jax import sokoban_reference
from envs_jax.base import GridEnv, first_timestep, make_timestep, parse_grid_text, step_extras
from envs_jax.bitboards import cell_bit, count_cells, flat_cells, pack_cells, toggle_cell, unpack_cells
from envs_jax.hashing import hash_uniform

# Cell codes of room_state (room_fixed uses WALL, FLOOR, TARGET); PLAYER_ON_TARGET only renders.
WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER_ON_TARGET = range(7)

ACTION_NAMES = ("Up", "Down", "Left", "Right")
DEFAULT_GRID_SYMBOLS = ("#", "_", "O", "√", "X", "P", "S")

INSTRUCTION = (
    "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to "
    "targets. When you are right next to a box, you can push it by moving in the same direction. "
    "You cannot push a box through a wall, and you cannot pull a box. The answer should be a "
    "sequence of actions, like <answer>Right || Right || Up</answer>"
)
SYMBOL_MEANINGS = ("wall", "empty", "target", "box on target", "box", "player", "player on target")

# Per-step rewards: the penalty, +1 / -1 for a box on / off a target, +10 for solving.
STEP_PENALTY, BOX_ON_REWARD, BOX_OFF_REWARD, FINISHED_REWARD = -0.1, 1.0, -1.0, 10.0

#: RAGEN's topology walk: direction change probability and the five 3x3 floor masks.
P_CHANGE_DIRECTION = 0.35
MASKS = np.array(sokoban_reference.MASKS, np.int8)

#: Reverse-play search of ``reset`` (chosen by measuring difficulty; see the module docstring).
NUM_WALKS = 16
MAX_WALK_LENGTH = 100
WALK_STEP_BUDGET = 3200
#: Candidates drawn per round of the retry loop (RAGEN makes up to 4 tries per seed).
CANDIDATES_PER_ROUND = 2
#: Band for the mean optimal solution length of 64 generated SimpleSokoban levels.
DIFFICULTY_BAND = (3.3, 4.9)


class SokobanState(struct.PyTreeNode):
    """A Sokoban state as bitboards: bit ``i % 32`` of word ``i // 32`` stands for cell ``i`` of the
    row-major grid. The step reads and writes a few bits instead of a grid of cells (see
    ``push_or_move``); ``room_fixed``, ``room_state`` and ``player`` give the grid view."""

    walls: tuple[jnp.ndarray, ...]  # uint32 words: wall cells
    targets: tuple[jnp.ndarray, ...]  # uint32 words: target cells
    boxes: tuple[jnp.ndarray, ...]  # uint32 words: cells holding a box
    player_cell: jnp.ndarray  # int32[]: row * cols + col of the player
    step_count: jnp.ndarray  # int32[] actions taken this episode
    boxes_on_target: jnp.ndarray  # int32[]: counted by make_state, then updated by each push
    dim_room: tuple[int, int] = struct.field(pytree_node=False)

    def symbols(self):
        """int8[..., rows, cols]: cell codes, PLAYER_ON_TARGET where the player is on a target."""
        walls, targets, boxes = (
            unpack_cells(words, self.dim_room) for words in (self.walls, self.targets, self.boxes)
        )
        player = flat_cells(self.dim_room) == self.player_cell[..., None, None]
        codes = _fixed_codes(walls, targets)
        codes = jnp.where(boxes, jnp.where(targets, BOX_ON_TARGET, BOX), codes)
        codes = jnp.where(player, jnp.where(targets, PLAYER_ON_TARGET, PLAYER), codes)
        return codes.astype(jnp.int8)

    @property
    def room_fixed(self):
        """int8[..., rows, cols]: WALL / FLOOR / TARGET."""
        walls, targets = (unpack_cells(words, self.dim_room) for words in (self.walls, self.targets))
        return _fixed_codes(walls, targets).astype(jnp.int8)

    @property
    def room_state(self):
        """int8[..., rows, cols]: cell codes 0..5 (the player hides the target under it)."""
        codes = self.symbols()
        return jnp.where(codes == PLAYER_ON_TARGET, jnp.int8(PLAYER), codes)

    @property
    def player(self):
        """int32[..., 2]: the player's (row, col)."""
        return jnp.stack(jnp.divmod(self.player_cell, self.dim_room[1]), axis=-1)


def _fixed_codes(walls, targets):
    """WALL / TARGET / FLOOR per cell from the wall and target masks."""
    return jnp.where(walls, WALL, jnp.where(targets, TARGET, FLOOR))


class Sokoban(GridEnv):
    instruction = INSTRUCTION
    symbol_meanings = SYMBOL_MEANINGS
    success_meaning = "every box on a target"
    border_symbol = WALL  # levels are enclosed by walls (``state_from_text`` enforces it)
    legend_symbols = DEFAULT_GRID_SYMBOLS  # quirk 1
    # Each value built in gym_sokoban's order of additions (penalty, box change, bonus): the
    # reward message prints the exact double.
    step_reward_values = (
        STEP_PENALTY,
        STEP_PENALTY + BOX_ON_REWARD,
        STEP_PENALTY + BOX_OFF_REWARD,
        STEP_PENALTY + BOX_ON_REWARD + FINISHED_REWARD,
    )

    def __init__(
        self,
        dim_room: tuple[int, int] = (6, 6),
        num_boxes: int = 1,
        search_depth: int = 300,
        max_steps: int = 100,
        grid_symbols: tuple[str, ...] = DEFAULT_GRID_SYMBOLS,
    ):
        room = tuple(int(d) for d in dim_room)
        if len(room) != 2 or min(room) < 3:
            raise ValueError(
                f"Sokoban dim_room must be (rows, cols), each at least 3, got {room}."
            )
        if num_boxes < 1:
            raise ValueError(f"Sokoban num_boxes must be at least 1, got {num_boxes}.")
        if search_depth < 3:
            raise ValueError(
                f"Sokoban search_depth must be at least 3 (it bounds reverse play), got {search_depth}."
            )
        if len(grid_symbols) != 7 or len(set(grid_symbols)) != 7:
            raise ValueError(
                "Sokoban grid_symbols must be 7 distinct glyphs (wall, empty, target, box on target, "
                f"box, player, player on target), got {grid_symbols!r}."
            )
        self.dim_room = (room[0], room[1])
        self.num_boxes = int(num_boxes)
        self.search_depth = int(search_depth)
        self.max_steps = int(max_steps)
        self.grid_symbols = tuple(grid_symbols)
        self.walk_length = min(self.search_depth - 2, MAX_WALK_LENGTH)
        self.num_walks = max(NUM_WALKS, WALK_STEP_BUDGET // self.walk_length)
        super().__init__()

    def __repr__(self) -> str:
        return (
            f"Sokoban(dim_room={self.dim_room}, num_boxes={self.num_boxes}, "
            f"search_depth={self.search_depth}, max_steps={self.max_steps})"
        )

    # ---- jumanji API -------------------------------------------------------------------------

    def reset(self, key):
        """A fresh solvable level generated in JAX (see the module docstring)."""
        room_fixed, room_state = generate_level(
            key, self.dim_room, self.num_boxes, self.walk_length, self.num_walks,
            CANDIDATES_PER_ROUND,
        )
        state = make_state(room_fixed, room_state)
        return state, first_timestep(self.render_symbols(state))

    def step(self, state: SokobanState, action):
        """gym_sokoban's push action (see ``push_or_move``) and its reward."""
        boxes, player_cell, moved, change = push_or_move(state, action)
        boxes_on_target = state.boxes_on_target + change
        solved = boxes_on_target == count_cells(state.targets)
        reward = STEP_PENALTY + change.astype(jnp.float32) + jnp.where(solved, FINISHED_REWARD, 0.0)
        step_count = state.step_count + 1
        state = state.replace(
            boxes=boxes,
            player_cell=player_cell,
            step_count=step_count,
            boxes_on_target=boxes_on_target,
        )
        timestep = make_timestep(
            self.render_symbols(state),
            reward=reward,
            terminated=solved,
            truncated=(step_count >= self.max_steps) & ~solved,
            extras=step_extras(success=solved, effective=moved),
        )
        return state, timestep

    @cached_property
    def observation_spec(self):
        return specs.BoundedArray(self.dim_room, jnp.int32, minimum=0, maximum=6, name="grid")

    # ---- text --------------------------------------------------------------------------------

    @property
    def action_names(self) -> tuple[str, ...]:
        return ACTION_NAMES

    @property
    def grid_shape(self) -> tuple[int, int]:
        return self.dim_room

    def render_symbols(self, state: SokobanState):
        """Jittable ``int32[rows, cols]`` symbol ids: cell codes, 6 where the player is on a target."""
        return state.symbols().astype(jnp.int32)

    def state_from_text(self, text: str) -> SokobanState:
        """A state from a rendered level in this env's symbols.

        The level must be ``dim_room`` in size, enclosed by walls (every border cell a wall, so the
        player can never leave the grid), with exactly one player and as many boxes as targets
        (at least one). Its box count may differ from ``num_boxes``.
        """
        sym = np.array(parse_grid_text(text, self.symbols, "Sokoban"), np.int8)
        rows, cols = self.dim_room
        if sym.shape != self.dim_room:
            raise ValueError(
                f"Sokoban level is {sym.shape[0]}x{sym.shape[1]} but this env is {rows}x{cols}; "
                f"pass a {rows}x{cols} grid or build the env with dim_room={sym.shape}."
            )
        border = np.concatenate([sym[0], sym[-1], sym[:, 0], sym[:, -1]])
        if np.any(border != WALL):
            raise ValueError(
                f"Sokoban level is not enclosed: every border cell must be a wall "
                f"({self.symbols[WALL]!r})."
            )
        players = np.count_nonzero((sym == PLAYER) | (sym == PLAYER_ON_TARGET))
        if players != 1:
            raise ValueError(
                f"Sokoban level must have exactly one player ({self.symbols[PLAYER]!r} or "
                f"{self.symbols[PLAYER_ON_TARGET]!r}), found {players}."
            )
        boxes = np.count_nonzero((sym == BOX) | (sym == BOX_ON_TARGET))
        targets = np.count_nonzero(np.isin(sym, [TARGET, BOX_ON_TARGET, PLAYER_ON_TARGET]))
        if boxes != targets or boxes == 0:
            raise ValueError(
                f"Sokoban level must have as many boxes as targets, at least one; found {boxes} "
                f"boxes and {targets} targets."
            )
        #                        wall  floor target box@t box  player player@t
        fixed_of_symbol = np.array([WALL, FLOOR, TARGET, TARGET, FLOOR, FLOOR, TARGET], np.int8)
        state_of_symbol = np.array([WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER, PLAYER], np.int8)
        return make_state(fixed_of_symbol[sym], state_of_symbol[sym])

    # ---- RAGEN seeds -------------------------------------------------------------------------

    def reset_from_seed(self, seed: int) -> SokobanState:
        """RAGEN's level for ``seed`` (host reference generator, deterministic seed fallback)."""
        room_fixed, room_state = sokoban_reference.ragen_level(
            seed, self.dim_room, self.num_boxes, self.search_depth
        )
        return make_state(room_fixed, room_state)


def make_state(room_fixed, room_state) -> SokobanState:
    """The state at the start of an episode on this level (``room_fixed`` / ``room_state`` grids)."""
    room_fixed = jnp.asarray(room_fixed, jnp.int8)
    room_state = jnp.asarray(room_state, jnp.int8)
    return SokobanState(
        walls=pack_cells(room_fixed == WALL),
        targets=pack_cells(room_fixed == TARGET),
        boxes=pack_cells(_is_box(room_state)),
        player_cell=jnp.argmax((room_state == PLAYER).ravel()).astype(jnp.int32),
        step_count=jnp.zeros((), jnp.int32),
        boxes_on_target=jnp.sum(room_state == BOX_ON_TARGET, dtype=jnp.int32),
        dim_room=tuple(room_state.shape),
    )


# --------------------------------------------------------------------------- dynamics


def flat_deltas(cols: int):
    """int32[4]: the flat-index step of actions Up, Down, Left, Right on a grid ``cols`` wide."""
    return jnp.array([-cols, cols, -1, 1], jnp.int32)


def _pick(values, index):
    """``values[index]`` for a short vector, as selects: a gather costs more under ``vmap``."""
    return jnp.sum(jnp.where(jnp.arange(values.shape[0]) == index, values, 0))


def push_or_move(state: SokobanState, action):
    """gym_sokoban's push action: (boxes, player_cell, moved, change in boxes on targets).

    Reads and flips a few bits of the bitboards. Levels are enclosed by walls, so the cell ahead is
    always on the grid; the cell beyond it only matters when a box is ahead, and then it is on the
    grid too.
    """
    cols = state.dim_room[1]
    delta = _pick(flat_deltas(cols), action)
    ahead, beyond = state.player_cell + delta, state.player_cell + 2 * delta
    box_ahead = cell_bit(state.boxes, ahead)
    free_ahead = ~cell_bit(state.walls, ahead) & ~box_ahead
    push = box_ahead & ~cell_bit(state.walls, beyond) & ~cell_bit(state.boxes, beyond)
    moved = push | free_ahead

    boxes = toggle_cell(toggle_cell(state.boxes, ahead, push), beyond, push)
    on_target = cell_bit(state.targets, beyond).astype(jnp.int32) - cell_bit(state.targets, ahead)
    change = jnp.where(push, on_target, 0)
    return boxes, jnp.where(moved, ahead, state.player_cell), moved, change


def _is_box(cell):
    return (cell == BOX) | (cell == BOX_ON_TARGET)


# --------------------------------------------------------------------------- level generation


def generate_level(key, dim_room, num_boxes, walk_length, num_walks, candidates_per_round):
    """Jittable: (room_fixed, room_state) of a solvable level, redrawn until one is valid."""

    def draw_round(carry):
        round_, _, _, _ = carry
        keys = jax.random.split(jax.random.fold_in(key, round_), candidates_per_round)
        fixed, state, valid = jax.vmap(
            lambda k: generate_candidate(k, dim_room, num_boxes, walk_length, num_walks)
        )(keys)
        first = jnp.argmax(valid)
        return round_ + 1, fixed[first], state[first], valid[first]

    empty = jnp.zeros(dim_room, jnp.int8)
    _, room_fixed, room_state, _ = jax.lax.while_loop(
        lambda carry: ~carry[3], draw_round, (jnp.int32(0), empty, empty, jnp.bool_(False))
    )
    return room_fixed, room_state


def generate_candidate(key, dim_room, num_boxes, walk_length, num_walks):
    """One attempt of RAGEN's recipe: (room_fixed, room_state, valid).

    Cells are row-major indices from placement on; the level is enclosed by walls, so a cell's four
    neighbours are ``cell + flat_deltas(cols)`` without leaving the grid.
    """
    k_topology, k_place, k_reverse, k_shuffle = jax.random.split(key, 4)
    floor = carve_topology(k_topology, dim_room, sokoban_reference.num_gen_steps(dim_room))
    player, targets, enough_floor = place_player_and_targets(k_place, floor, num_boxes)
    floor_bits = pack_cells(floor)
    player, boxes, score, displacement = reverse_play(
        k_reverse, floor_bits, dim_room[1], player, targets, walk_length, num_walks
    )
    player = shuffle_player(k_shuffle, floor_bits, dim_room[1], player, boxes, displacement)

    cells = flat_cells(dim_room)
    room_fixed = jnp.where(floor, FLOOR, WALL)
    room_fixed = jnp.where(jnp.any(_marks(cells, targets), axis=-1), TARGET, room_fixed).astype(jnp.int8)
    room_state = jnp.where(jnp.any(_marks(cells, boxes), axis=-1), BOX, room_fixed)  # none on a target
    room_state = jnp.where(cells == player, PLAYER, room_state).astype(jnp.int8)
    return room_fixed, room_state, enough_floor & (score > 0)


def carve_topology(key, dim_room, num_steps):
    """bool[rows, cols] floor carved by RAGEN's random walk stamping random 3x3 masks."""
    k_dir, k_start, k_change, k_new_dir, k_mask = jax.random.split(key, 5)
    walk_dirs = jnp.array(sokoban_reference.WALK_DIRECTIONS, jnp.int32)
    size = jnp.array(dim_room, jnp.int32)
    start = jax.random.randint(k_start, (2,), 1, size)  # RAGEN: randint(1, dim - 1), inclusive
    change = jax.random.uniform(k_change, (num_steps,)) < P_CHANGE_DIRECTION
    new_dirs = jax.random.randint(k_new_dir, (num_steps,), 0, 4)
    masks = jnp.asarray(MASKS)[jax.random.randint(k_mask, (num_steps,), 0, len(MASKS))]

    def walk(carry, step):
        level, pos, direction = carry
        change, new_dir, mask = step
        direction = jnp.where(change, new_dir, direction)
        pos = jnp.clip(pos + walk_dirs[direction], 1, size - 2)
        window = jax.lax.dynamic_slice(level, pos - 1, (3, 3))
        level = jax.lax.dynamic_update_slice(level, window | mask, pos - 1)
        return (level, pos, direction), None

    level = jnp.zeros(dim_room, jnp.int8)
    direction = jax.random.randint(k_dir, (), 0, 4)
    (level, _, _), _ = jax.lax.scan(walk, (level, start, direction), (change, new_dirs, masks))
    border = cell_border(dim_room)
    return (level > 0) & ~border


def cell_border(dim_room):
    rows = jnp.arange(dim_room[0])[:, None]
    cols = jnp.arange(dim_room[1])[None, :]
    return (rows == 0) | (rows == dim_room[0] - 1) | (cols == 0) | (cols == dim_room[1] - 1)


def place_player_and_targets(key, floor, num_boxes):
    """Player, then each target, on distinct uniform floor cells (flat indices); and whether the
    floor sufficed."""
    keys = jax.random.split(key, num_boxes + 1)
    free = floor.ravel()
    cells = []
    for k in keys:
        cell = jax.random.categorical(k, jnp.where(free, 0.0, -jnp.inf)).astype(jnp.int32)
        free = free & (jnp.arange(free.size) != cell)
        cells.append(cell)
    enough_floor = jnp.sum(floor) > num_boxes + 1
    return cells[0], jnp.stack(cells[1:]), enough_floor


def reverse_play(key, floor_bits, cols, player, targets, walk_length, num_walks):
    """Best state of ``num_walks`` random reverse-play walks: (player, boxes, score, displacement).

    Boxes start on their own targets. Each step the player moves to a uniformly chosen free
    neighbour and, if a box is right behind it, pulls that box into its old cell. A state scores
    ``box_swaps * displacement`` (``box_swaps`` counts changes of the pulled box, the first pull
    included; ``displacement`` sums the boxes' Manhattan distances from their targets) when neither
    a box nor the player covers a target, else 0. Within a walk and across walks the first best
    state wins, as in RAGEN's DFS. Cells are flat indices; ``floor_bits`` is the floor's bitboard.
    The walks' choices come from ``hash_uniform`` (``jax.random.uniform`` cost two thirds of the
    generation time on CPU).
    """
    target_rows, target_cols = jnp.divmod(targets, cols)

    def step(carry, noise):
        player, boxes, last_pull, swaps, best = carry
        neighbours, free = free_neighbours(floor_bits, cols, player, boxes)
        action = jnp.argmax(jnp.where(free, noise, -1.0))  # uniform among free neighbours
        moves = jnp.any(free)  # False only when the player is boxed in
        ahead = _pick(neighbours, action)
        pulled = moves & (boxes == 2 * player - ahead)  # the box behind the player
        boxes = jnp.where(pulled, player, boxes)
        player = jnp.where(moves, ahead, player)
        pull = jnp.where(jnp.any(pulled), jnp.argmax(pulled), last_pull)
        swaps = swaps + (pull != last_pull)

        box_rows, box_cols = jnp.divmod(boxes, cols)
        displacement = jnp.sum(jnp.abs(box_rows - target_rows) + jnp.abs(box_cols - target_cols))
        covered = jnp.any(_marks(boxes, targets)) | jnp.any(targets == player)
        score = jnp.where(covered, 0, swaps * displacement)
        better = score > best[2]
        best = jax.tree.map(
            lambda new, old: jnp.where(better, new, old), (player, boxes, score, displacement), best
        )
        return (player, boxes, pull, swaps, best), None

    def walk(noise):
        start = (player, targets, jnp.int32(0), jnp.int32(0))  # score 0, like RAGEN's root state
        carry = (player, targets, jnp.int32(-1), jnp.int32(0), start)
        return jax.lax.scan(step, carry, noise)[0][-1]

    noise = hash_uniform(key, (num_walks, walk_length, 4))
    players, boxes, scores, displacements = jax.vmap(walk)(noise)
    i = jnp.argmax(scores)
    return players[i], boxes[i], scores[i], displacements[i]


def shuffle_player(key, floor_bits, cols, player, boxes, displacement):
    """RAGEN's random player shuffle: with probability 0.8 (displacement 1) or 0.5, walk 1 to 3 steps.

    Each step goes to a uniformly chosen free neighbour not visited before; after each step the walk
    goes on with probability 0.5.
    """
    k_move, k_steps = jax.random.split(key)
    moving = jax.random.uniform(k_move) <= jnp.where(displacement == 1, 0.8, 0.5)

    def step(carry, key):
        player, visited, moving = carry
        k_choice, k_go_on = jax.random.split(key)
        neighbours, free = free_neighbours(floor_bits, cols, player, boxes)
        allowed = free & ~jnp.any(_marks(neighbours, visited), axis=-1)
        moving = moving & jnp.any(allowed)
        choice = jax.random.categorical(k_choice, jnp.where(allowed, 0.0, -jnp.inf))
        player = jnp.where(moving, _pick(neighbours, choice), player)
        visited = jnp.concatenate([visited[1:], player[None]])
        moving = moving & (jax.random.uniform(k_go_on) <= 0.5)
        return (player, visited, moving), None

    visited = jnp.full((4,), player)  # the start plus up to 3 cells walked; start fills the rest
    (player, _, _), _ = jax.lax.scan(step, (player, visited, moving), jax.random.split(k_steps, 3))
    return player


def free_neighbours(floor_bits, cols, player, boxes):
    """The 4 cells around ``player`` in action order, and which of them are floor without a box."""
    neighbours = player + flat_deltas(cols)
    free = cell_bit(floor_bits, neighbours)
    return neighbours, free & ~jnp.any(_marks(neighbours, boxes), axis=-1)


def _marks(cells, marked):
    """bool[..., len(marked)]: whether each of ``cells`` equals each of ``marked`` (flat indices)."""
    return cells[..., None] == marked
