"""Host-side NumPy port of RAGEN's Sokoban level generator and of gym_sokoban's step.

``generate_room`` reproduces ``ragen/env/sokoban/utils.py::generate_room`` (itself adapted from
gym_sokoban) call for call, so that ``ragen_level(seed, ...)`` returns exactly the level RAGEN's
``SokobanEnv.reset(seed)`` shows for that seed. What bit-exact parity needs, and is kept:

- the RNG streams and their call order: Python ``random`` (direction, start, walk, masks, player
  shuffle) and legacy ``np.random`` (player and target placement), both seeded with the seed;
- the recursive reverse-play DFS with one explored set shared across the whole search (keyed on the
  bytes of ``room_state``), its 300000-state cap, the ``ttl`` that is decremented on entry and passed
  on unchanged to all four children, and the ``box_swaps * displacement`` score that only counts
  states where every target is uncovered;
- up to ``tries=4`` attempts per seed, then the random player shuffle.

Departures, on purpose:

- RAGEN seeds the *global* ``random`` / ``np.random`` and restores them afterwards (``all_seed``);
  we draw from private ``random.Random(seed)`` / ``np.random.RandomState(seed)`` instances, which
  produce the same streams and leave the global generators untouched.
- [quirk 2, fixed] RAGEN retries a failed seed with ``abs(hash(str(seed))) % 2**32``; Python's string
  hash is salted per process, so those levels differ from run to run. We retry with the
  deterministic ``fallback_seed`` (first 4 bytes of SHA-256 of ``str(seed)``, little-endian) until a
  level is generated. Seeds that succeed on the first round (all of 0..199 for SimpleSokoban) are
  unaffected; about 14 % of LargerSokoban seeds (8x8, 2 boxes, depth 10) take the fallback and so
  differ from any particular RAGEN run.

``numpy_step`` mirrors gym_sokoban's ``SokobanEnv.step`` for one push action (the NumPy baseline of
the environment benchmarks and an oracle for the JAX step).
"""

from __future__ import annotations

import hashlib
import random as _random

import numpy as np

# Cell codes of room_state (room_fixed uses only WALL, FLOOR, TARGET).
WALL, FLOOR, TARGET, BOX_ON_TARGET, BOX, PLAYER = 0, 1, 2, 3, 4, 5

#: (row, col) deltas of actions 0..3 = Up, Down, Left, Right (gym_sokoban's CHANGE_COORDINATES).
CHANGE_COORDINATES = ((-1, 0), (1, 0), (0, -1), (0, 1))

#: The five 3x3 floor masks of the topology random walk, in gym_sokoban's order.
MASKS = (
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)
WALK_DIRECTIONS = ((1, 0), (0, 1), (-1, 0), (0, -1))

MAX_EXPLORED_STATES = 300_000


class GenerationFailed(RuntimeError):
    """A seed gave a room with too few floor cells or a level with zero box displacement."""


def num_gen_steps(dim_room: tuple[int, int]) -> int:
    """gym_sokoban's default length of the topology random walk."""
    return int(1.7 * (dim_room[0] + dim_room[1]))


# --------------------------------------------------------------------------- level generation


def room_topology_generation(rng, dim, p_change_directions=0.35, num_steps=15):
    """Floor (1) / wall (0) layout carved by a random walk that stamps random 3x3 masks."""
    dim_x, dim_y = dim
    direction = rng.sample(WALK_DIRECTIONS, 1)[0]
    position = np.array([rng.randint(1, dim_x - 1), rng.randint(1, dim_y - 1)])
    level = np.zeros(dim, dtype=int)
    for _ in range(num_steps):
        if rng.random() < p_change_directions:
            direction = rng.sample(WALK_DIRECTIONS, 1)[0]
        position = position + direction
        position[0] = max(min(position[0], dim_x - 2), 1)
        position[1] = max(min(position[1], dim_y - 2), 1)
        mask = rng.sample(MASKS, 1)[0]
        start = position - 1
        level[start[0] : start[0] + 3, start[1] : start[1] + 3] += mask
    level[level > 0] = 1
    level[:, [0, dim_y - 1]] = 0
    level[[0, dim_x - 1], :] = 0
    return level


def place_boxes_and_player(np_rng, room, num_boxes):
    """Player (5) and then each box target (2) on a uniformly drawn free floor cell."""
    free = np.where(room == FLOOR)
    if free[0].shape[0] <= num_boxes + 1:
        raise GenerationFailed(
            f"Not enough free spots (#{free[0].shape[0]}) for 1 player and {num_boxes} boxes."
        )
    ind = np_rng.randint(free[0].shape[0])
    room[free[0][ind], free[1][ind]] = PLAYER
    for _ in range(num_boxes):
        free = np.where(room == FLOOR)
        ind = np_rng.randint(free[0].shape[0])
        room[free[0][ind], free[1][ind]] = TARGET
    return room


def box_displacement_score(box_mapping) -> int:
    """Sum over boxes of the Manhattan distance between the box and its own target."""
    return int(sum(abs(b[0] - t[0]) + abs(b[1] - t[1]) for t, b in box_mapping.items()))


def reverse_move(room_state, room_structure, box_mapping, last_pull, action):
    """The player steps into a free neighbour and pulls the box behind it along (in place)."""
    player = np.argwhere(room_state == PLAYER)[0]
    change = CHANGE_COORDINATES[action]
    nxt = player + change
    if room_state[nxt[0], nxt[1]] in (FLOOR, TARGET):
        room_state[player[0], player[1]] = room_structure[player[0], player[1]]
        room_state[nxt[0], nxt[1]] = PLAYER
        behind = player - change
        if room_state[behind[0], behind[1]] in (BOX_ON_TARGET, BOX):
            room_state[player[0], player[1]] = BOX_ON_TARGET  # gym_sokoban marks every pulled box 3
            room_state[behind[0], behind[1]] = room_structure[behind[0], behind[1]]
            for target in box_mapping:
                if box_mapping[target] == (behind[0], behind[1]):
                    box_mapping[target] = (player[0], player[1])
                    last_pull = target
    return room_state, box_mapping, last_pull


class _ReverseSearch:
    """gym_sokoban's reverse-play DFS; its module globals become attributes here."""

    def __init__(self, room_structure, num_boxes):
        self.room_structure = room_structure
        self.num_boxes = num_boxes
        self.explored: set[bytes] = set()
        self.best_score = -1
        self.best_room = None
        self.best_mapping = None

    def dfs(self, room_state, box_mapping, box_swaps, last_pull, ttl):
        ttl -= 1
        if ttl <= 0 or len(self.explored) >= MAX_EXPLORED_STATES:
            return
        key = room_state.tobytes()
        if key in self.explored:
            return
        score = box_swaps * box_displacement_score(box_mapping)
        if np.count_nonzero(room_state == TARGET) != self.num_boxes:
            score = 0  # a box (or the player) still covers a target
        if score > self.best_score:
            self.best_room, self.best_score = room_state.copy(), score
            self.best_mapping = dict(box_mapping)
        self.explored.add(key)
        for action in range(4):
            nxt, mapping, pull = reverse_move(
                room_state.copy(), self.room_structure, dict(box_mapping), last_pull, action
            )
            swaps = box_swaps + (pull != last_pull)
            self.dfs(nxt, mapping, swaps, pull, ttl)


def reverse_playing(room_state, room_structure, search_depth=100):
    """Best-scoring state reachable by pulling the boxes away from their targets."""
    targets = np.where(room_structure == TARGET)
    box_mapping = {(t0, t1): (t0, t1) for t0, t1 in zip(*targets)}
    search = _ReverseSearch(room_structure, num_boxes=len(targets[0]))
    search.best_mapping = box_mapping
    search.dfs(room_state, box_mapping, 0, (-1, -1), search_depth)
    return search.best_room, search.best_mapping


def add_random_player_movement(rng, room_state, room_structure, move_probability=0.5,
                               continue_probability=0.5, max_steps=3):
    """Walk the player up to 3 steps without revisiting cells, so it is not always next to a box."""
    if rng.random() > move_probability:
        return room_state
    player = np.argwhere(room_state == PLAYER)[0]
    visited = [tuple(player)]
    steps = 0
    while steps < max_steps:
        moves = []
        for action in range(4):
            nxt = player + CHANGE_COORDINATES[action]
            if room_state[nxt[0], nxt[1]] in (FLOOR, TARGET) and tuple(nxt) not in visited:
                moves.append(nxt)
        if not moves:
            break
        nxt = rng.choice(moves)
        room_state[player[0], player[1]] = room_structure[player[0], player[1]]
        room_state[nxt[0], nxt[1]] = PLAYER
        player = nxt
        visited.append(tuple(player))
        steps += 1
        if steps >= max_steps or rng.random() > continue_probability:
            break
    return room_state


def generate_room(rng, np_rng, dim=(13, 13), p_change_directions=0.35, num_steps=25, num_boxes=3,
                  tries=4, search_depth=100):
    """RAGEN's ``generate_room`` with explicit generators: (room_fixed, room_state, box_mapping)."""
    for _ in range(tries):
        room = room_topology_generation(rng, dim, p_change_directions, num_steps)
        room = place_boxes_and_player(np_rng, room, num_boxes)
        room_structure = room.copy()
        room_structure[room_structure == PLAYER] = FLOOR
        room_state = room.copy()
        room_state[room_state == TARGET] = BOX  # every box starts on its own target
        room_state, box_mapping = reverse_playing(room_state, room_structure, search_depth)
        room_state[room_state == BOX_ON_TARGET] = BOX
        if box_displacement_score(box_mapping) > 0:
            break
    score = box_displacement_score(box_mapping)
    if score == 0:
        raise GenerationFailed("Generated a level with box displacement 0.")
    move_probability = 0.8 if score == 1 else 0.5
    room_state = add_random_player_movement(rng, room_state, room_structure, move_probability)
    return room_structure, room_state, box_mapping


def fallback_seed(seed: int) -> int:
    """Deterministic stand-in for RAGEN's per-process ``abs(hash(str(seed))) % 2**32``."""
    return int.from_bytes(hashlib.sha256(str(seed).encode()).digest()[:4], "little")


def ragen_level(seed: int, dim_room=(6, 6), num_boxes=1, search_depth=300):
    """The level RAGEN's ``SokobanEnv.reset(seed)`` generates: (room_fixed, room_state) as int8."""
    while True:
        try:
            rng, np_rng = _random.Random(seed), np.random.RandomState(seed)
            fixed, state, _ = generate_room(
                rng, np_rng, dim=tuple(dim_room), num_steps=num_gen_steps(dim_room),
                num_boxes=num_boxes, search_depth=search_depth,
            )
            return fixed.astype(np.int8), state.astype(np.int8)
        except GenerationFailed:
            seed = fallback_seed(seed)


# --------------------------------------------------------------------------- gym_sokoban step


def numpy_step(room_state, room_fixed, action):
    """gym_sokoban's ``step`` for push action ``action`` (0..3 = Up, Down, Left, Right).

    Returns ``(room_state, reward, done)``; ``room_state`` is updated in place. The previous count
    of boxes on targets is read from ``room_state`` itself, and ``done`` means solved (the step cap
    lives with the caller).
    """
    num_boxes = np.count_nonzero(room_fixed == TARGET)
    before = num_boxes - _uncovered_targets(room_state, room_fixed)
    player = np.argwhere(room_state == PLAYER)[0]
    change = CHANGE_COORDINATES[action]
    nxt, beyond = player + change, player + 2 * np.asarray(change)
    if beyond[0] >= room_state.shape[0] or beyond[1] >= room_state.shape[1]:
        pass  # gym_sokoban gives up (no move either) when the push would leave the grid
    elif (room_state[nxt[0], nxt[1]] in (BOX_ON_TARGET, BOX)
            and room_state[beyond[0], beyond[1]] in (FLOOR, TARGET)):
        on_target = room_fixed[beyond[0], beyond[1]] == TARGET
        room_state[beyond[0], beyond[1]] = BOX_ON_TARGET if on_target else BOX
        _move_player(room_state, room_fixed, player, nxt)
    elif room_state[nxt[0], nxt[1]] in (FLOOR, TARGET):
        _move_player(room_state, room_fixed, player, nxt)
    after = num_boxes - _uncovered_targets(room_state, room_fixed)
    solved = after == num_boxes
    reward = -0.1 + (after > before) - (after < before) + 10.0 * solved
    return room_state, reward, bool(solved)


def _uncovered_targets(room_state, room_fixed) -> int:
    player_on_target = (room_fixed == TARGET) & (room_state == PLAYER)
    return int(np.count_nonzero((room_state == TARGET) | player_on_target))


def _move_player(room_state, room_fixed, player, nxt):
    room_state[nxt[0], nxt[1]] = PLAYER
    room_state[player[0], player[1]] = room_fixed[player[0], player[1]]
