"""Optimal Sokoban solutions by breadth-first search (host side, plain Python).

The search runs over (player cell, set of box cells) with gym_sokoban's push semantics: a step into
a box pushes it if the cell beyond is free floor or target, a step into free floor moves, anything
else is a no-op (and so never shortens a solution). It plays the role of RAGEN's
``get_shortest_action_path``, returning our action ids (0..3 = Up, Down, Left, Right).
"""

from __future__ import annotations

from collections import deque

import numpy as np

_DELTAS = ((-1, 0), (1, 0), (0, -1), (0, 1))
_WALL, _TARGET, _BOX_ON_TARGET, _BOX, _PLAYER = 0, 2, 3, 4, 5


def shortest_solution(state, max_depth: int = 30) -> list[int] | None:
    """Shortest action sequence that puts every box on a target, or None if none within max_depth.

    ``state`` is a Sokoban state (anything with ``room_fixed`` and ``room_state`` grids, JAX or
    NumPy, unbatched). An already-solved state gives ``[]``.
    """
    fixed = np.asarray(state.room_fixed)
    room = np.asarray(state.room_state)
    if fixed.ndim != 2:
        raise ValueError(
            f"shortest_solution takes one unbatched state; got grids of shape {fixed.shape}."
        )
    rows, cols = fixed.shape
    free = {(r, c) for r in range(rows) for c in range(cols) if fixed[r, c] != _WALL}
    targets = frozenset(map(tuple, np.argwhere(fixed == _TARGET).tolist()))
    player = tuple(np.argwhere(room == _PLAYER)[0].tolist())
    boxes = frozenset(map(tuple, np.argwhere((room == _BOX) | (room == _BOX_ON_TARGET)).tolist()))

    start = (player, boxes)
    parent: dict = {start: None}
    frontier = deque([(start, 0)])
    while frontier:
        node, depth = frontier.popleft()
        if node[1] <= targets:
            return _actions_to(node, parent)
        if depth == max_depth:
            continue
        for action, child in _successors(node, free):
            if child not in parent:
                parent[child] = (node, action)
                frontier.append((child, depth + 1))
    return None


def _successors(node, free):
    (pr, pc), boxes = node
    for action, (dr, dc) in enumerate(_DELTAS):
        nxt = (pr + dr, pc + dc)
        if nxt not in free:
            continue
        if nxt in boxes:
            beyond = (nxt[0] + dr, nxt[1] + dc)
            if beyond not in free or beyond in boxes:
                continue
            yield action, (nxt, (boxes - {nxt}) | {beyond})
        else:
            yield action, (nxt, boxes)


def _actions_to(node, parent) -> list[int]:
    actions = []
    while parent[node] is not None:
        node, action = parent[node]
        actions.append(action)
    return actions[::-1]
