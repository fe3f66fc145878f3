"""Sokoban levels: the in-graph generator (valid, solvable, RAGEN-like difficulty, deterministic)
and the reference generator's difficulty on RAGEN's validation seeds (ragen-reference.md §1.3's table)."""

from collections import Counter

import jax
import numpy as np
import pytest
from jumanji.types import StepType

import envs_jax
from envs_jax import sokoban
from envs_jax.solvers.sokoban_bfs import shortest_solution

NUM_LEVELS = 64


def unbatch(states, i):
    return jax.tree.map(lambda x: np.asarray(x[i]), states)


@pytest.fixture(scope="module")
def simple():
    env = envs_jax.make("SimpleSokoban")
    reset = jax.jit(jax.vmap(env.reset))
    keys = jax.random.split(jax.random.PRNGKey(2024), NUM_LEVELS)
    states, timesteps = reset(keys)
    return env, reset, keys, states, timesteps


def assert_well_formed(env, state, num_boxes):
    fixed, room = state.room_fixed, state.room_state
    border = np.concatenate([room[0], room[-1], room[:, 0], room[:, -1]])
    assert np.all(border == sokoban.WALL)
    assert np.count_nonzero(room == sokoban.PLAYER) == 1
    assert tuple(np.argwhere(room == sokoban.PLAYER)[0]) == tuple(state.player)
    assert np.count_nonzero(room == sokoban.BOX) == num_boxes  # none starts on a target
    assert np.count_nonzero(fixed == sokoban.TARGET) == num_boxes
    assert np.all(room[fixed == sokoban.WALL] == sokoban.WALL)
    assert int(state.boxes_on_target) == 0 and int(state.step_count) == 0
    env.state_from_text(env.render_text(state))  # passes every level check


def test_generated_levels_are_well_formed(simple):
    env, _, _, states, timesteps = simple
    assert np.all(np.asarray(timesteps.step_type) == StepType.FIRST)
    for i in range(NUM_LEVELS):
        assert_well_formed(env, unbatch(states, i), num_boxes=1)
    np.testing.assert_array_equal(timesteps.observation[0], env.render_symbols(unbatch(states, 0)))


def test_generated_levels_are_solvable_with_ragen_difficulty(simple):
    env, _, _, states, _ = simple
    lengths = []
    for i in range(NUM_LEVELS):
        solution = shortest_solution(unbatch(states, i), max_depth=40)
        assert solution, f"level {i} has no solution:\n{env.render_text(unbatch(states, i))}"
        lengths.append(len(solution))
    low, high = sokoban.DIFFICULTY_BAND
    assert low <= np.mean(lengths) <= high
    # Levels are varied: several solution lengths, several distinct layouts.
    assert len(set(lengths)) >= 5
    assert len({env.render_text(unbatch(states, i)) for i in range(NUM_LEVELS)}) >= NUM_LEVELS - 2


def test_player_shuffle_moves_the_player_away_from_the_box(simple):
    # Right after reverse play the player touches the box it pulled; RAGEN's shuffle moves it in
    # about half the levels (43 % of validation levels end up with no box next to the player).
    _, _, _, states, _ = simple
    detached = 0
    for i in range(NUM_LEVELS):
        state = unbatch(states, i)
        boxes = np.argwhere(state.room_state == sokoban.BOX)
        detached += not np.any(np.abs(boxes - state.player).sum(axis=1) == 1)
    assert 0.2 * NUM_LEVELS <= detached <= 0.7 * NUM_LEVELS


def test_reset_is_deterministic_and_rows_are_independent(simple):
    _, reset, keys, states, _ = simple
    again, _ = reset(keys[::-1])  # same compiled function; the retry loop must not couple rows
    for field in ("room_fixed", "room_state", "player"):
        np.testing.assert_array_equal(getattr(again, field), getattr(states, field)[::-1])


def test_solution_replays_to_success_in_the_jax_env(simple):
    env, _, _, states, _ = simple
    state = unbatch(states, 0)
    solution = shortest_solution(state)
    assert solution is not None
    for action in solution:
        state, ts = env.step(state, action)
    assert bool(ts.extras["success"]) and ts.step_type == StepType.LAST
    assert float(ts.reward) == pytest.approx(10.9)


def test_larger_sokoban_generates_two_box_levels():
    env = envs_jax.make("LargerSokoban")
    states, _ = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(7), 8))
    for i in range(8):
        state = unbatch(states, i)
        assert_well_formed(env, state, num_boxes=2)
        assert shortest_solution(state, max_depth=40)


# ---- the reference generator and the BFS on RAGEN's validation seeds ----------------------------

# ragen-reference.md §1.3: optimal solution lengths of SimpleSokoban seeds 123..378 (RAGEN's validation set).
RAGEN_VALIDATION_LENGTHS = {1: 28, 2: 60, 3: 27, 4: 47, 5: 37, 6: 24, 7: 12, 8: 14, 9: 2, 10: 5}


def test_validation_seed_difficulty_matches_ragen():
    env = envs_jax.make("SimpleSokoban")
    solutions = [shortest_solution(env.reset_from_seed(s)) for s in range(123, 379)]
    assert all(s is not None for s in solutions)
    assert dict(Counter(len(s) for s in solutions if s is not None)) == RAGEN_VALIDATION_LENGTHS


def test_bfs_solution_lengths_and_limits():
    env = envs_jax.make("SimpleSokoban")
    level = env.reset_from_seed(10001)
    assert shortest_solution(level) == [3, 0, 2]  # Right, Up, Left
    assert shortest_solution(level, max_depth=2) is None
    solved = env.state_from_text("######\n#__√_#\n#_P__#\n#____#\n#____#\n######")
    assert shortest_solution(solved) == []
    stuck = env.state_from_text("######\n#X___#\n#_P__#\n#___O#\n#____#\n######")  # box in a corner
    assert shortest_solution(stuck) is None
