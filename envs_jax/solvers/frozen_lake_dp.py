"""Exact optimal success probability on a FrozenLake map (finite-horizon dynamic programming).

The policy is closed-loop: it sees the position after every action. ``V_0`` is 1 on a goal and 0
elsewhere; each further action takes the best expected value over the realised directions,

    V_h(s) = max_a  mean_{d in slips(a)} V_{h-1}(move(s, d)),

with goals absorbing at 1 and holes at 0. ``V_h(start)`` is the best probability of reaching the goal
within ``h`` actions: an upper bound for any agent with that action budget, e.g. RAGEN's 5 turns of
up to 5 open-loop actions sits between horizons 5 and 25. On RAGEN's 256 validation maps (seeds
123..378) the means are 0.290 at horizon 5 and 0.483 at horizon 10.

An LLM agent sees the board only when a turn starts; inside a turn its actions are a fixed (open-loop)
list. ``turn_limited_success`` is the best an agent can do under that structure (``turns`` turns of
1..``actions_per_turn`` actions, ``action_budget`` in all: the rollout's limits);
``random_answers_success`` and ``same_answer_success`` are what board-blind policies score (uniformly
random valid answers; one answer every turn, such as the prompt's example or a collapsed policy's):
the ceiling and the baselines a learning run is read against, exact expectations over the ice.
"""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from envs_jax.frozen_lake import DIRECTION_DELTAS, GOAL, HOLE, LETTERS, START, FrozenLakeState

Level = Union[FrozenLakeState, str, Sequence[str]]


def success_values(board: np.ndarray, horizon: int, is_slippery: bool = True) -> np.ndarray:
    """``float64[size, size]``: the best success probability from each cell within ``horizon`` actions."""
    board = np.asarray(board)
    rows, cols = np.indices(board.shape)
    # neighbour[d] = (row, col) index arrays of the cell reached by moving in direction d.
    neighbour = [
        (np.clip(rows + dr, 0, board.shape[0] - 1), np.clip(cols + dc, 0, board.shape[1] - 1))
        for dr, dc in DIRECTION_DELTAS
    ]
    slips = (-1, 0, 1) if is_slippery else (0,)
    goal, hole = board == GOAL, board == HOLE
    value = goal.astype(np.float64)
    for _ in range(horizon):
        after_move = np.stack([value[neighbour[d]] for d in range(4)])
        action_value = np.stack(
            [np.mean([after_move[(a + s) % 4] for s in slips], axis=0) for a in range(4)]
        )
        value = np.where(goal, 1.0, np.where(hole, 0.0, action_value.max(axis=0)))
    return value


def transition_matrices(board: np.ndarray, is_slippery: bool = True) -> np.ndarray:
    """``float64[4, n, n]`` (``n`` cells, row-major): action ``a`` takes cell ``i`` to cell ``j`` with
    ``[a, i, j]``. Goals and holes end the episode, so they stay put."""
    board = np.asarray(board)
    size = board.size
    rows, cols = np.divmod(np.arange(size), board.shape[1])
    slips = (-1, 0, 1) if is_slippery else (0,)
    ends = (board == GOAL) | (board == HOLE)
    matrices = np.zeros((4, size, size))
    for a in range(4):
        for s in slips:
            dr, dc = DIRECTION_DELTAS[(a + s) % 4]
            to = np.clip(rows + dr, 0, board.shape[0] - 1) * board.shape[1] + np.clip(cols + dc, 0, board.shape[1] - 1)
            matrices[a, np.arange(size), np.where(ends.ravel(), np.arange(size), to)] += 1 / len(slips)
    return matrices


def all_answers(actions_per_turn: int, num_actions: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Every answer of 1..``actions_per_turn`` actions, shortest first: ``int[A, actions_per_turn]``
    action ids (0 past an answer's end) and ``int[A]`` lengths."""
    lists = [actions for count in range(1, actions_per_turn + 1) for actions in np.ndindex(*(num_actions,) * count)]
    ids = np.zeros((len(lists), actions_per_turn), np.int64)
    for row, actions in enumerate(lists):
        ids[row, :len(actions)] = actions
    return ids, np.array([len(actions) for actions in lists])


def random_answer_probabilities(lengths: np.ndarray, num_actions: int = 4) -> np.ndarray:
    """``format_warmup.random_answers``' distribution over ``all_answers``: a count uniform in
    1..``actions_per_turn``, then that many actions uniform over the ``num_actions`` ids."""
    return 1.0 / lengths.max() / float(num_actions) ** lengths


def _after_answers(matrices: np.ndarray, ids: np.ndarray, lengths: np.ndarray, value: np.ndarray,
                   goal: np.ndarray) -> np.ndarray:
    """``float64[A, U, n]``: per answer and actions already spent (``U = budget + 1``), the expected
    value of playing the answer blind, cut to the budget left as the rollout cuts it, then going on
    with ``value`` (``[A or 1, U, n]``) at the actions spent by then. Once the budget is spent the
    episode is over: only a goal counts."""
    budget = value.shape[1] - 1
    answers = np.arange(len(ids))
    out = np.empty((len(ids),) + value.shape[1:])
    for used in range(budget + 1):
        played = np.minimum(lengths, budget - used)
        v = value[answers if len(value) > 1 else 0, used + played]
        for k in reversed(range(ids.shape[1])):  # prepend the k-th action where the answer has one
            v = np.where((k < played)[:, None], np.einsum("aij,aj->ai", matrices[ids[:, k]], v), v)
        out[:, used] = v if used < budget else goal
    return out


def _turns(level: Level, actions_per_turn: int, action_budget: int, is_slippery: bool, chooses):
    """Backward induction over one turn per entry of ``chooses`` (the last turn first), each of answers
    of up to ``actions_per_turn`` actions: ``choose(after)`` turns that turn's per-answer values
    (``_after_answers``) into the values the turn before it continues with. Returns the values from
    the level's start, one per row the first turn's ``choose`` keeps."""
    board, start = _board_and_start(level)
    matrices = transition_matrices(board, is_slippery)
    goal = (board == GOAL).ravel().astype(np.float64)
    ids, lengths = all_answers(actions_per_turn)
    value = np.tile(goal, (1, action_budget + 1, 1))  # after the last turn only a goal counts
    for choose in chooses:
        value = choose(_after_answers(matrices, ids, lengths, value, goal))
    return value[:, 0, np.ravel_multi_index(start, board.shape)]


def _best(after: np.ndarray) -> np.ndarray:
    return after.max(axis=0, keepdims=True)  # each cell's best answer


def _each(after: np.ndarray) -> np.ndarray:
    return after  # answer a at this turn continues with answer a's values


def _random(actions_per_turn: int):
    probabilities = random_answer_probabilities(all_answers(actions_per_turn)[1])
    return lambda after: np.tensordot(probabilities, after, 1)[None]


def turn_limited_success(level: Level, turns: int, actions_per_turn: int, action_budget: int,
                         is_slippery: bool = True) -> float:
    """Best probability of reaching the goal when the board is seen at each turn's start and each
    turn plays 1..``actions_per_turn`` actions blind, ``action_budget`` actions in all, ``turns``
    turns: the best an agent within the rollout's limits can do. Bounded above by
    ``optimal_success_probability`` at horizon ``action_budget``, which sees every step."""
    return float(_turns(level, actions_per_turn, action_budget, is_slippery, [_best] * turns)[0])


def random_answers_success(level: Level, turns: int, actions_per_turn: int, action_budget: int,
                           is_slippery: bool = True) -> float:
    """Success probability of uniformly random valid answers every turn (``random_answer_probabilities``),
    the board unread: the chance baseline that ``experiments.evaluate --policy random-valid`` samples."""
    return float(_turns(level, actions_per_turn, action_budget, is_slippery, [_random(actions_per_turn)] * turns)[0])


def same_answer_success(level: Level, turns: int, actions_per_turn: int, action_budget: int,
                        is_slippery: bool = True) -> np.ndarray:
    """``float64[A]``: the success probability of giving answer ``a`` of ``all_answers`` every turn,
    whatever the board (the prompt's example ``Left || Up`` is one; a collapsed policy plays one)."""
    return _turns(level, actions_per_turn, action_budget, is_slippery, [_each] * turns)


def best_first_answer(level: Level, turns: int, actions_per_turn: int, action_budget: int,
                      is_slippery: bool = True) -> tuple[int, ...]:
    """The first answer of a best turn-limited policy (``turn_limited_success``): its action ids
    (the shortest of equally good answers)."""
    q = _turns(level, actions_per_turn, action_budget, is_slippery, [_best] * (turns - 1) + [_each])
    ids, lengths = all_answers(actions_per_turn)
    best = int(np.argmax(q))
    return tuple(int(a) for a in ids[best, :lengths[best]])


def first_answer_share(level: Level, turns: int, actions_per_turn: int, action_budget: int,
                       is_slippery: bool = True) -> float:
    """How much of a group's success variance the first answer explains, under uniformly random valid
    answers (the policy a run starts near): ``Var_a q(a) / p (1 - p)``, with ``q(a)`` the success
    probability after first answer ``a`` and ``p`` its mean. The rest is the ice's and the later
    turns' luck, which a group-relative advantage passes on as noise (nan where ``p`` is 0 or 1)."""
    probabilities = random_answer_probabilities(all_answers(actions_per_turn)[1])
    chooses = [_random(actions_per_turn)] * (turns - 1) + [_each]
    q = _turns(level, actions_per_turn, action_budget, is_slippery, chooses)
    p = float(probabilities @ q)
    return float(probabilities @ (q - p) ** 2 / (p * (1 - p))) if 0 < p < 1 else float("nan")


def optimal_success_probability(level: Level, horizon: int, is_slippery: bool = True) -> float:
    """Best probability to reach the goal within ``horizon`` actions from the level's player/start.

    ``level`` is a ``FrozenLakeState`` (the player's position is the start) or a gymnasium map of
    F/H/S/G letters: a list of row strings (``generate_random_map``'s output) or one string of
    newline-separated rows.
    """
    if horizon < 0:
        raise ValueError(f"horizon must be a non-negative number of actions, got {horizon}.")
    board, start = _board_and_start(level)
    return float(success_values(board, horizon, is_slippery)[start])


def _board_and_start(level: Level) -> tuple[np.ndarray, tuple[int, int]]:
    if isinstance(level, FrozenLakeState):
        row, col = np.asarray(level.pos)
        return np.asarray(level.board), (int(row), int(col))
    rows = level.strip("\n").split("\n") if isinstance(level, str) else list(level)
    bad = sorted({ch for row in rows for ch in row} - set(LETTERS))
    if bad or len({len(row) for row in rows}) != 1:
        raise ValueError(
            "FrozenLake map must be equal-length rows of F/H/S/G letters"
            + (f"; found {' '.join(bad)}." if bad else "; the rows differ in length.")
        )
    board = np.array([[LETTERS.index(ch) for ch in row] for row in rows], np.int8)
    starts = np.argwhere(board == START)
    if len(starts) != 1:
        raise ValueError(f"FrozenLake map must have exactly one start 'S', found {len(starts)}.")
    row, col = starts[0]
    return board, (int(row), int(col))
