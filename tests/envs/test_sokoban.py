"""Sokoban: RAGEN golden vectors, gym_sokoban push semantics, rewards, text round trips."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jumanji.types import StepType

import envs_jax
from envs_jax import sokoban_reference as ref
from envs_jax.sokoban import Sokoban

UP, DOWN, LEFT, RIGHT = range(4)


def grid(text_with_slashes: str) -> str:
    return text_with_slashes.replace("/", "\n")


@pytest.fixture(scope="module")
def env():
    return envs_jax.make("SimpleSokoban")


@pytest.fixture(scope="module")
def step(env):
    return jax.jit(env.step)


def play(env, step, text, actions):
    state = env.state_from_text(grid(text))
    timesteps = []
    for a in actions:
        state, ts = step(state, a)
        timesteps.append(ts)
    return state, timesteps


# ---- golden vectors (ragen-reference.md §1.6) ----------------------------------------------------


@pytest.mark.parametrize(
    "variant, seed, expected",
    [
        ("SimpleSokoban", 10000, "######/#O####/#__###/#X_###/#_P_##/######"),
        ("SimpleSokoban", 10001, "######/#____#/#_OX_#/#_#P_#/######/######"),
        ("SimpleSokoban", 123, "######/######/#O####/#XP###/#__###/######"),
        ("LargerSokoban", 123,
         "########/#_____##/#__O__##/#_X#__##/#XP___##/#O___###/#_##_###/########"),
        ("SokobanDifferentGridVocab", 123, "WWWWWW/WWWWWW/WGWWWW/WBAWWW/W..WWW/WWWWWW"),
    ],
)
def test_reset_from_seed_matches_ragen(variant, seed, expected):
    env = envs_jax.make(variant)
    assert env.render_text(env.reset_from_seed(seed)) == grid(expected)


def test_seed_10000_moves_without_reward(env, step):
    state = env.reset_from_seed(10000)
    positions = [tuple(np.asarray(state.player))]
    for action in (UP, DOWN, LEFT, RIGHT):
        state, ts = step(state, action)
        positions.append(tuple(np.asarray(state.player)))
        assert float(ts.reward) == pytest.approx(-0.1)
        assert ts.step_type == StepType.MID
    assert positions == [(4, 2), (3, 2), (4, 2), (4, 1), (4, 2)]


def test_seed_10001_is_solved_by_right_up_left(env, step):
    state = env.reset_from_seed(10001)
    rewards, last = [], []
    for action in (RIGHT, UP, LEFT):
        state, ts = step(state, action)
        rewards.append(float(ts.reward))
        last.append(bool(ts.last()))
    assert rewards == pytest.approx([-0.1, -0.1, 10.9])
    assert last == [False, False, True]
    assert float(ts.discount) == 0.0  # terminated, not truncated
    assert bool(ts.extras["success"])
    assert env.render_text(state) == grid("######/#____#/#_√P_#/#_#__#/######/######")


def test_reference_generator_leaves_global_rngs_alone():
    random.seed(7)
    np.random.seed(7)
    before = random.random(), np.random.rand()
    random.seed(7)
    np.random.seed(7)
    ref.ragen_level(10000)
    assert (random.random(), np.random.rand()) == before


def test_failed_seed_falls_back_to_deterministic_hash():
    # LargerSokoban seed 105 fails all 4 tries (displacement 0), like ~14 % of its seeds.
    with pytest.raises(ref.GenerationFailed):
        ref.generate_room(random.Random(105), np.random.RandomState(105), dim=(8, 8),
                          num_steps=27, num_boxes=2, search_depth=10)
    fixed, state = ref.ragen_level(105, (8, 8), 2, 10)
    again = ref.ragen_level(ref.fallback_seed(105), (8, 8), 2, 10)
    np.testing.assert_array_equal(fixed, again[0])
    np.testing.assert_array_equal(state, again[1])
    assert np.count_nonzero(state == ref.BOX) == 2


# ---- step semantics --------------------------------------------------------------------------------

LEVEL_PUSH = "######/#____#/#_PX_#/#____#/#__O_#/######"


def test_push_moves_box_and_player(env, step):
    state, (ts,) = play(env, step, LEVEL_PUSH, [RIGHT])
    assert env.render_text(state) == grid("######/#____#/#__PX#/#____#/#__O_#/######")
    assert float(ts.reward) == pytest.approx(-0.1)
    assert bool(ts.extras["action_is_effective"]) and bool(ts.extras["action_is_valid"])
    assert tuple(np.asarray(state.player)) == (2, 3)


@pytest.mark.parametrize(
    "text",
    [
        "######/#__PX#/#____#/#_O__#/#____#/######",  # box against a wall
        "######/#PXX_#/#____#/#O_O_#/#____#/######",  # box against a box
    ],
)
def test_blocked_push_changes_nothing(env, step, text):
    state, (ts,) = play(env, step, text, [RIGHT])
    assert env.render_text(state) == grid(text)
    assert float(ts.reward) == pytest.approx(-0.1)
    assert not bool(ts.extras["action_is_effective"])
    assert int(state.step_count) == 1


def test_walking_into_a_wall_costs_a_step(env, step):
    state = env.reset_from_seed(10000)
    after, ts = step(state, DOWN)
    np.testing.assert_array_equal(after.room_state, state.room_state)
    assert float(ts.reward) == pytest.approx(-0.1)
    assert not bool(ts.extras["action_is_effective"])
    assert bool(ts.extras["action_is_valid"])


def test_box_onto_and_off_a_target(env, step):
    text = "######/#PXO_#/#____#/#_XO_#/#____#/######"  # two boxes, two targets
    state, (on, off) = play(env, step, text, [RIGHT, RIGHT])
    assert float(on.reward) == pytest.approx(0.9)
    assert float(off.reward) == pytest.approx(-1.1)
    assert not bool(on.extras["success"]) and on.step_type == StepType.MID
    assert int(state.boxes_on_target) == 0
    assert env.render_text(state) == grid("######/#__SX#/#____#/#_XO_#/#____#/######")


def test_player_on_target_does_not_count_as_box(env, step):
    text = "######/#P_O_#/#____#/#_X__#/#____#/######"
    state, (ts1, ts2) = play(env, step, text, [RIGHT, RIGHT])
    assert env.render_text(state) == grid("######/#__S_#/#____#/#_X__#/#____#/######")
    assert [float(ts1.reward), float(ts2.reward)] == pytest.approx([-0.1, -0.1])
    assert int(state.boxes_on_target) == 0 and not bool(ts2.extras["success"])


def test_max_steps_truncates_without_terminating():
    env = envs_jax.make("SimpleSokoban", max_steps=3)
    state = env.reset_from_seed(10000)
    step_types, discounts = [], []
    for _ in range(3):
        state, ts = env.step(state, DOWN)
        step_types.append(int(ts.step_type))
        discounts.append(float(ts.discount))
    assert step_types == [StepType.MID, StepType.MID, StepType.LAST]
    assert discounts == [1.0, 1.0, 1.0]
    assert not bool(ts.extras["success"])


@pytest.mark.parametrize("variant, num_levels", [("SimpleSokoban", 16), ("LargerSokoban", 4)])
def test_jax_step_matches_gym_sokoban_step_on_random_play(variant, num_levels):
    """vmap(scan(step)) over RAGEN levels and 40 random actions, against the NumPy mirror (6x6 and
    8x8 rooms: 36 and 64 cells, two bitboard words each)."""
    env = envs_jax.make(variant)
    seeds = range(200, 200 + num_levels)
    levels = [env.reset_from_seed(s) for s in seeds]
    batch = jax.tree.map(lambda *xs: jnp.stack(xs), *levels)
    actions = np.random.default_rng(0).integers(0, 4, size=(len(levels), 40))

    def rollout(state, actions):
        def body(state, action):
            state, ts = env.step(state, action)
            return state, (ts.reward, ts.extras["success"], env.render_symbols(state))
        return jax.lax.scan(body, state, actions)[1]

    rewards, solved, symbols = jax.jit(jax.vmap(rollout))(batch, jnp.asarray(actions))
    for i, level in enumerate(levels):
        room = np.array(level.room_state)
        fixed = np.array(level.room_fixed)
        for t, action in enumerate(actions[i]):
            room, reward, done = ref.numpy_step(room, fixed, int(action))
            assert float(rewards[i, t]) == pytest.approx(reward, abs=1e-5)
            assert bool(solved[i, t]) == done
            expected = np.where((room == ref.PLAYER) & (fixed == ref.TARGET), 6, room)
            np.testing.assert_array_equal(symbols[i, t], expected)


# ---- text ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variant, text",
    [
        ("SimpleSokoban", "######/#S_X_#/#__X_#/#√_O_#/#____#/######"),
        ("SokobanDifferentGridVocab", "WWWWWW/W@.B.W/W..B.W/WC.G.W/W....W/WWWWWW"),
    ],
)
def test_state_from_text_round_trip(variant, text):
    env = envs_jax.make(variant)
    state = env.state_from_text(grid(text))
    assert env.render_text(state) == grid(text)
    assert tuple(np.asarray(state.player)) == (1, 1)
    assert int(state.boxes_on_target) == 1 and int(state.step_count) == 0
    np.testing.assert_array_equal(
        np.asarray(state.room_fixed)[1:4, 1:4], [[2, 1, 1], [1, 1, 1], [2, 1, 2]]
    )


def test_custom_level_with_more_boxes_than_the_env(env, step):
    text = "######/#PXO_#/#____#/#_X__#/#_O__#/######"  # 2 boxes in a 1-box env
    state, (ts,) = play(env, step, text, [RIGHT])
    assert float(ts.reward) == pytest.approx(0.9)  # one of two: not solved
    assert not bool(ts.extras["success"])


@pytest.mark.parametrize(
    "text, message",
    [
        ("######/#P_X#/#_O__#/#____#/#____#/######", "ragged rows"),
        ("######/#P_X_#/#_O?_#/#____#/#____#/######", "unknown symbol"),
        ("######/#__X_#/#_O__#/#____#/#____#/######", "exactly one player.*found 0"),
        ("######/#P_X_#/#_O__#/#__P_#/#____#/######", "exactly one player.*found 2"),
        ("######/#P_X_#/#_O__#/#__X_#/#____#/######", "2 boxes and 1 targets"),
        ("######/#P___#/#____#/#____#/#____#/######", "at least one"),
        ("######/#P_X__/#_O__#/#____#/#____#/######", "not enclosed"),
        ("#####/#PXO#/#####", "this env is 6x6"),
    ],
)
def test_state_from_text_rejects_malformed_levels(env, text, message):
    with pytest.raises(ValueError, match=message):
        env.state_from_text(grid(text))


def test_constructor_rejects_bad_symbols():
    with pytest.raises(ValueError, match="7 distinct glyphs"):
        Sokoban(grid_symbols=("#", "_", "O"))
