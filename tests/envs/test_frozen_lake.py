import copy
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gymnasium.envs.toy_text.frozen_lake import FrozenLakeEnv as GymFrozenLake

import envs_jax
from envs_jax.bitboards import cell_bit
from envs_jax.frozen_lake import (
    DIRECTION_DELTAS,
    FrozenLake,
    board_letters,
    generate_random_map,
    goal_reachable,
    neighbour_cell,
)
from envs_jax.solvers.frozen_lake_dp import (
    _best,
    _each,
    _turns,
    all_answers,
    best_first_answer,
    first_answer_share,
    optimal_success_probability,
    random_answer_probabilities,
    random_answers_success,
    same_answer_success,
    turn_limited_success,
)

LEFT, DOWN, RIGHT, UP = range(4)
OPEN_BOARD = "____\n_P__\n____\n___G"  # no holes, player at (1, 1)


@pytest.fixture(scope="module")
def env():
    return envs_jax.make("FrozenLake")


@pytest.fixture(scope="module")
def step_in_direction(env):
    return jax.jit(env.step_in_direction)


def pos(state):
    return tuple(int(x) for x in state.pos)


# ---- golden vectors (ragen-reference.md §1.6) --------------------------------------------------


@pytest.mark.parametrize(
    "seed, text", [(123, "____\n_OOP\nGO__\nO___"), (124, "O__G\n_O__\n____\n_O_P")]
)
def test_golden_maps(env, seed, text):
    assert env.render_text(env.reset_from_seed(seed)) == text


def test_golden_slips_of_seed_123(env, step_in_direction):
    # RAGEN: Left slips up, Down slips left, Right slips down into the hole at (1, 2).
    s = env.reset_from_seed(123)
    for action, realised, expected in [(LEFT, UP, (0, 3)), (DOWN, LEFT, (0, 2)), (RIGHT, DOWN, (1, 2))]:
        assert realised in {(action - 1) % 4, action, (action + 1) % 4}
        s, ts = step_in_direction(s, realised)
        assert pos(s) == expected and float(ts.reward) == 0.0
    assert env.render_text(s) == "____\n_OX_\nGO__\nO___"
    assert bool(ts.last()) and float(ts.discount) == 0.0 and not bool(ts.extras["success"])


def test_transitions_match_gymnasium(env, step_in_direction):
    """Replay gymnasium's own draws (peeked from its RNG) through our slip rule and transition."""
    actions = np.random.default_rng(0).integers(4, size=(4, 12))
    for seed, episode in zip(range(200, 204), actions):
        gym = GymFrozenLake(desc=generate_random_map(4, 0.8, seed), is_slippery=True)
        gym.reset(seed=seed)
        s = env.reset_from_seed(seed)
        assert pos(s) == divmod(gym.s, 4)
        for a in episode:
            u = copy.deepcopy(gym.np_random).random()
            slip = int(np.argmax(np.cumsum([1 / 3] * 3) > u))  # gymnasium's categorical_sample
            direction = env.realised_direction(a, u)
            assert int(direction) == (a - 1 + slip) % 4
            _, reward, terminated, _, _ = gym.step(int(a))
            s, ts = step_in_direction(s, direction)
            assert pos(s) == divmod(gym.s, 4)
            assert float(ts.reward) == reward and bool(ts.discount == 0) == terminated


def test_generate_random_map_is_valid_for_many_seeds():
    for seed in range(300, 340):
        rows = generate_random_map(4, 0.8, seed)
        assert sum(r.count("S") for r in rows) == 1 and sum(r.count("G") for r in rows) == 1
        assert host_goal_reachable(rows)


# ---- dynamics -----------------------------------------------------------------------------------


def test_neighbour_cell_stays_on_grid():
    corner = jnp.int32(0)  # (0, 0) of a 4x4 map
    assert int(neighbour_cell(corner, LEFT, 4)) == 0 and int(neighbour_cell(corner, UP, 4)) == 0
    assert int(neighbour_cell(corner, DOWN, 4)) == 4 and int(neighbour_cell(corner, RIGHT, 4)) == 1


@pytest.mark.parametrize("size", [4, 5])
def test_neighbour_cell_is_a_clipped_move_on_flat_indices(size):
    cells = np.arange(size * size)
    rows_cols = np.stack(np.divmod(cells, size), axis=1)
    for direction in range(4):
        expected = np.clip(rows_cols + DIRECTION_DELTAS[direction], 0, size - 1) @ [size, 1]
        np.testing.assert_array_equal(neighbour_cell(jnp.asarray(cells), direction, size), expected)


def test_goal_reward_termination_and_absorption(env, step_in_direction):
    s = env.state_from_text("___P\n___G\n____\n____")
    s, ts = step_in_direction(s, DOWN)
    assert float(ts.reward) == 1.0 and bool(ts.extras["success"]) and bool(ts.last())
    assert float(ts.discount) == 0.0 and env.render_text(s) == "____\n___√\n____\n____"
    s2, ts2 = step_in_direction(s, UP)  # gymnasium: terminal cells are absorbing, reward 0
    assert pos(s2) == pos(s) and float(ts2.reward) == 0.0 and bool(ts2.last())
    assert not bool(ts2.extras["action_is_effective"])


def test_wall_bump_is_ineffective_and_truncation():
    env = FrozenLake(max_steps=3)
    s = env.state_from_text("P___\n____\n____\n___G")
    step_in_direction = jax.jit(env.step_in_direction)
    for t in range(3):
        s, ts = step_in_direction(s, LEFT)
        assert bool(ts.last()) == (t == 2)
        assert pos(s) == (0, 0) and not bool(ts.extras["action_is_effective"])
        assert bool(ts.extras["action_is_valid"])
    assert bool(ts.last()) and float(ts.discount) == 1.0  # truncated, not terminated


def test_slip_frequencies_vmapped(env):
    n = 30_000
    s = env.state_from_text(OPEN_BOARD)
    states = jax.vmap(lambda k: s.replace(key=k))(jax.random.split(jax.random.PRNGKey(3), n))
    new, ts = jax.jit(jax.vmap(env.step, in_axes=(0, None)))(states, DOWN)
    landed = [tuple(p) for p in np.asarray(new.pos)]
    counts = {cell: landed.count(cell) / n for cell in set(landed)}
    # Down slips left or right, each direction 1/3; never up.
    assert set(counts) == {(2, 1), (1, 0), (1, 2)}
    sigma = np.sqrt((1 / 3) * (2 / 3) / n)
    for share in counts.values():
        assert abs(share - 1 / 3) < 5 * sigma
    assert np.asarray(ts.extras["action_is_effective"]).all()


def test_not_slippery_goes_where_told():
    env = FrozenLake(is_slippery=False)
    s = env.state_from_text(OPEN_BOARD)
    states = jax.vmap(lambda k: s.replace(key=k))(jax.random.split(jax.random.PRNGKey(4), 64))
    new, _ = jax.vmap(env.step, in_axes=(0, None))(states, RIGHT)
    assert (np.asarray(new.pos) == [1, 2]).all()


def test_step_is_deterministic_per_key(env):
    s = env.state_from_text(OPEN_BOARD).replace(key=jax.random.PRNGKey(5))
    paths = []
    for _ in range(2):
        t, path = s, []
        for a in (DOWN, RIGHT, DOWN, RIGHT):
            t, _ = env.step(t, a)
            path.append(pos(t))
        paths.append(path)
    assert paths[0] == paths[1]


# ---- jitted reset ---------------------------------------------------------------------------------


def host_goal_reachable(rows) -> bool:
    """Breadth-first search over non-hole cells from S (independent of the env's flood fill)."""
    size = len(rows)
    start = next((r, c) for r in range(size) for c in range(size) if rows[r][c] == "S")
    queue, seen = deque([start]), {start}
    while queue:
        r, c = queue.popleft()
        if rows[r][c] == "G":
            return True
        for nr, nc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= nr < size and 0 <= nc < size and (nr, nc) not in seen and rows[nr][nc] != "H":
                seen.add((nr, nc))
                queue.append((nr, nc))
    return False


def test_goal_reachable_agrees_with_host_bfs():
    # Random boards with many holes, so that about half are unsolvable.
    rng = np.random.default_rng(7)
    boards = []
    for _ in range(400):
        board = rng.choice(np.array(["F", "H"]), (5, 5), p=[0.55, 0.45])
        start, goal = rng.choice(25, size=2, replace=False)
        board.flat[start], board.flat[goal] = "S", "G"
        boards.append(["".join(row) for row in board])
    codes = jnp.array([[["FHSG".index(ch) for ch in row] for row in b] for b in boards], jnp.int8)
    ours = np.asarray(jax.jit(jax.vmap(goal_reachable))(codes))
    truth = np.array([host_goal_reachable(b) for b in boards])
    assert 0.2 < truth.mean() < 0.8
    np.testing.assert_array_equal(ours, truth)


def test_reset_vmapped_maps_are_solvable_and_deterministic(env):
    keys = jax.random.split(jax.random.PRNGKey(6), 500)
    reset = jax.jit(jax.vmap(env.reset))
    states, ts = reset(keys)
    boards = np.asarray(states.board)
    letters = [board_letters(jax.tree.map(lambda x: x[i], states)) for i in range(len(keys))]
    for i, rows in enumerate(letters):
        assert "".join(rows).count("S") == 1 and "".join(rows).count("G") == 1
        assert rows[int(states.pos[i, 0])][int(states.pos[i, 1])] == "S"
        assert host_goal_reachable(rows), rows
    assert len({"".join(rows) for rows in letters}) > 450  # diverse maps
    holes = (boards == 1).mean()  # ~0.2 before conditioning on solvability, a bit less after
    assert 0.1 < holes < 0.2
    assert (np.asarray(ts.observation) == 0).sum(axis=(1, 2)).tolist() == [1] * len(keys)
    again, _ = reset(keys)
    np.testing.assert_array_equal(boards, np.asarray(again.board))
    np.testing.assert_array_equal(np.asarray(states.pos), np.asarray(again.pos))


# ---- text -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["____\n_OOP\nGO__\nO___", "____\n_OX_\nGO__\nO___", "_O__\n√___\n__O_\n____"])
def test_state_from_text_round_trips(env, text):
    assert env.render_text(env.state_from_text(text)) == text


def test_state_from_text_keeps_cell_kinds(env):
    s = env.state_from_text("____\n_OX_\nGO__\nO___")
    assert board_letters(s) == ["FFFF", "FHHF", "GHFF", "HFFF"] and pos(s) == (1, 2)


@pytest.mark.parametrize(
    "text, problem",
    [
        ("____\n_OP\nGO__\nO___", "ragged rows"),
        ("____\n_OZP\nGO__\nO___", "unknown symbol 'Z'"),
        ("___P\n_O_P\nGO__\nO___", "exactly one player cell"),
        ("____\n_O__\nGO__\nO___", "exactly one player cell"),
        ("____\n_O_P\n_O__\nO___", "no goal"),
        ("___\n_PG\n___", "is 3x3 but this env is 4x4"),
    ],
)
def test_state_from_text_errors(env, text, problem):
    with pytest.raises(ValueError, match=problem):
        env.state_from_text(text)


def test_action_names_and_symbols(env):
    assert env.action_names == ("Left", "Down", "Right", "Up")
    assert env.symbols == ("P", "_", "O", "G", "X", "√") and env.grid_shape == (4, 4)


# ---- exact DP solver ----------------------------------------------------------------------------------


def test_solver_reference_points_on_validation_maps():
    maps = [generate_random_map(4, 0.8, seed) for seed in range(123, 379)]
    assert np.mean([optimal_success_probability(m, 5) for m in maps]) == pytest.approx(0.290, abs=5e-4)
    assert np.mean([optimal_success_probability(m, 10) for m in maps]) == pytest.approx(0.483, abs=5e-4)


def test_solver_by_hand(env):
    # From S next to G: one slippery action reaches G with 1/3 (two of the three directions bump
    # or go sideways); without slips, surely.
    assert optimal_success_probability(["SG", "FF"], 0) == 0.0
    assert optimal_success_probability(["SG", "FF"], 1) == pytest.approx(1 / 3)
    assert optimal_success_probability(["SG", "FF"], 1, is_slippery=False) == 1.0
    # A hole-free map with the goal 6 moves away: impossible in 5 actions, then growing towards 1.
    values = [optimal_success_probability("SFFF\nFFFF\nFFFF\nFFFG", h) for h in (5, 6, 10, 100)]
    assert values[0] == 0.0 and 0 < values[1] < values[2] < values[3] and values[3] > 0.999
    # A state is solved from the player's position.
    state = env.reset_from_seed(123)
    assert optimal_success_probability(state, 7) == optimal_success_probability(
        generate_random_map(4, 0.8, 123), 7
    )
    with pytest.raises(ValueError, match="F/H/S/G"):
        optimal_success_probability(["SX", "FG"], 3)


# ---- turn-limited DP and board-blind baselines ----------------------------------------------------


def test_one_action_per_turn_is_the_closed_loop_optimum():
    # Seeing the board before every action is what the closed-loop DP assumes: same values.
    for seed in range(123, 131):
        board = generate_random_map(4, 0.8, seed)
        for horizon in (3, 6):
            assert turn_limited_success(board, horizon, 1, horizon) == pytest.approx(
                optimal_success_probability(board, horizon), abs=1e-12)


def test_blind_policies_score_below_board_reading_ones():
    for seed in range(123, 127):
        board = generate_random_map(4, 0.8, seed)
        closed = optimal_success_probability(board, 10)
        turns = turn_limited_success(board, 3, 5, 10)
        same = same_answer_success(board, 3, 5, 10)
        assert random_answers_success(board, 3, 5, 10) <= same.max() + 1e-12
        assert same.max() <= turns + 1e-12 and turns <= closed + 1e-12


def test_answers_are_cut_to_the_budget_left():
    ids, lengths = all_answers(3)
    right3 = int(np.flatnonzero((lengths == 3) & (ids == RIGHT).all(axis=1))[0])
    right1 = int(np.flatnonzero((lengths == 1) & (ids[:, 0] == RIGHT))[0])
    assert same_answer_success(["SFG"], 1, 3, 2, is_slippery=False)[right3] == 1.0  # two steps suffice
    assert same_answer_success(["SFG"], 1, 3, 1, is_slippery=False)[right3] == 0.0  # one is left
    assert same_answer_success(["SFG"], 2, 3, 2, is_slippery=False)[right1] == 1.0  # one a turn, two turns
    assert same_answer_success(["SFG"], 1, 3, 5, is_slippery=False)[right1] == 0.0


def test_random_answers_by_hand():
    # From S beside G: Right, Down and Up each slip onto G with 1/3; Left never does.
    assert random_answers_success(["SG", "FF"], 1, 1, 1) == pytest.approx(0.25)
    # Two actions drawn: the count is 1 or 2 (1/2 each), and every action is uniform.
    probabilities = random_answer_probabilities(all_answers(2)[1])
    assert probabilities.sum() == pytest.approx(1.0) and probabilities[0] == pytest.approx(1 / 8)


def test_the_dp_matches_the_env_s_own_slips(env):
    # The prompt's example every turn, played by the env's step 4000 times on seed 125's map: the
    # DP's probability lies within 4.5 binomial standard deviations of the sampled rate.
    state = env.reset_from_seed(125)
    answer, turns, budget, episodes = (LEFT, UP), 3, 10, 4000
    ids, lengths = all_answers(5)
    row = int(np.flatnonzero((lengths == 2) & (ids[:, 0] == LEFT) & (ids[:, 1] == UP))[0])
    exact = same_answer_success(state, turns, 5, budget)[row]

    def episode(key):
        s = state.replace(key=key)
        for i in range(min(turns * len(answer), budget)):
            s, _ = env.step(s, answer[i % len(answer)])
        return cell_bit(s.goals, s.player_cell)

    wins = jax.jit(jax.vmap(episode))(jax.random.split(jax.random.PRNGKey(0), episodes))
    sigma = np.sqrt(exact * (1 - exact) / episodes)
    assert 0.05 < exact < 0.95 and abs(float(wins.mean()) - exact) < 4.5 * sigma


def test_first_answer_share_by_hand():
    # Without slips the one answer decides everything; with them Right, Down and Up each reach G with
    # 1/3: q = (0, 1/3, 1/3, 1/3), p = 1/4, Var q = 1/48 of p (1 - p) = 3/16, a share of 1/9.
    assert first_answer_share(["SG", "FF"], 1, 1, 1, is_slippery=False) == pytest.approx(1.0)
    assert first_answer_share(["SG", "FF"], 1, 1, 1) == pytest.approx(1 / 9)
    assert 0 < first_answer_share(generate_random_map(4, 0.8, 123), 3, 5, 10) < 1


def test_best_first_answer_reaches_the_turn_limited_optimum():
    board = generate_random_map(4, 0.8, 124)
    first = best_first_answer(board, 3, 5, 10)
    ids, lengths = all_answers(5)
    row = int(np.flatnonzero((lengths == len(first)) & (ids[:, :len(first)] == first).all(axis=1))[0])
    # Its value, with the best play after it, is the optimum itself.
    after = _turns(board, 5, 10, True, [_best, _best, _each])
    assert after[row] == pytest.approx(turn_limited_success(board, 3, 5, 10), abs=1e-12)
    assert best_first_answer(["SFG"], 1, 3, 3, is_slippery=False) == (RIGHT, RIGHT)
