"""Observation piece tables: an observation rendered from table pieces (grid rows) equals the
tokenizer's encoding of its text."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import envs_jax
from envs_jax.base import symbols_to_text
from starpo_jax.rollout.prompts import TAIL_START, observation_budget
from starpo_jax.rollout.tokens import PAD_ID, PieceTable, pack_runs, render_pieces

render_batch = jax.jit(jax.vmap(render_pieces, in_axes=(None, 0)))


def random_walk_grids(env, states, steps: int, seed: int):
    """Symbol grids along random action sequences from a batch of states: int32[B * steps, r, c]."""
    num_actions = env.action_spec.num_values

    def walk(state, key):
        def body(state, key):
            state, ts = env.step(state, jax.random.randint(key, (), 0, num_actions))
            return state, ts.observation

        return jax.lax.scan(body, state, jax.random.split(key, steps))[1]

    batch = jax.tree.leaves(states)[0].shape[0]
    grids = jax.jit(jax.vmap(walk))(states, jax.random.split(jax.random.PRNGKey(seed), batch))
    return np.asarray(grids).reshape((-1,) + env.grid_shape)


def ragen_level_grids(env, seeds, steps: int = 8):
    """RAGEN's levels for ``seeds`` and the states along random walks from them."""
    states = [env.reset_from_seed(s) for s in seeds]
    batch = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
    start = np.stack([np.asarray(env.render_symbols(s)) for s in states])
    return np.concatenate([start, random_walk_grids(env, batch, steps, seed=seeds[0])])


def reset_grids(env, batch: int, steps: int = 8):
    """``env.reset`` with vmapped keys, then random walks."""
    states, ts = jax.jit(jax.vmap(env.reset))(jax.random.split(jax.random.PRNGKey(3), batch))
    return np.concatenate([np.asarray(ts.observation), random_walk_grids(env, states, steps, seed=4)])


def random_grids(env, batch: int, walled: bool, seed: int = 0):
    """Uniformly random symbol grids (every symbol in every cell), optionally with a wall border."""
    grids = np.random.default_rng(seed).integers(0, len(env.symbols), (batch,) + env.grid_shape)
    if walled:
        grids[:, [0, -1], :] = 0
        grids[:, :, [0, -1]] = 0
    return grids.astype(np.int32)


@pytest.fixture(scope="module")
def sokoban_grids():
    """Sokoban symbol grids by room size (the symbol ids do not depend on the variant's glyphs)."""
    simple, larger = envs_jax.make("SimpleSokoban"), envs_jax.make("LargerSokoban")
    return {
        (6, 6): np.concatenate(
            [ragen_level_grids(simple, list(range(10000, 10016))), random_grids(simple, 64, walled=True)]
        ),
        (8, 8): np.concatenate(
            [ragen_level_grids(larger, list(range(123, 139))), random_grids(larger, 64, walled=True)]
        ),
    }


@pytest.fixture(scope="module")
def frozen_lake_grids():
    env = envs_jax.make("FrozenLake")
    return np.concatenate([reset_grids(env, 16), random_grids(env, 64, walled=False)])


def assert_rendered_tokens_match(tokenizer, env, grids):
    table = PieceTable.build(tokenizer, env.piece_texts, observation_budget(env), TAIL_START)
    pieces = jax.vmap(env.grid_pieces)(jnp.asarray(grids))
    ids, lengths = map(np.asarray, render_batch(table, pieces))
    assert ids.shape == (len(grids), table.max_len)
    texts = [symbols_to_text(g, env.symbols) + "\n" for g in grids]
    expected = tokenizer(texts)["input_ids"]
    for i, want in enumerate(expected):
        assert ids[i, : lengths[i]].tolist() == want, texts[i]
        assert np.all(ids[i, lengths[i] :] == PAD_ID)


@pytest.mark.parametrize("name", ["SimpleSokoban", "LargerSokoban", "SokobanDifferentGridVocab"])
@pytest.mark.parametrize("which", ["qwen", "smollm2"])
def test_sokoban_grid_tokens_equal_tokenizer(name, which, sokoban_grids, request):
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    env = envs_jax.make(name)
    assert_rendered_tokens_match(tokenizer, env, sokoban_grids[env.grid_shape])


@pytest.mark.parametrize("which", ["qwen", "smollm2"])
def test_frozen_lake_grid_tokens_equal_tokenizer(which, frozen_lake_grids, request):
    tokenizer = request.getfixturevalue(f"{which}_tokenizer")
    assert_rendered_tokens_match(tokenizer, envs_jax.make("FrozenLake"), frozen_lake_grids)


def test_grid_pieces_key_every_row_and_walls_are_implicit(qwen_tokenizer):
    env = envs_jax.make("SimpleSokoban")  # symbols # _ O √ X P S, wall border
    table = PieceTable.build(qwen_tokenizer, env.piece_texts, observation_budget(env), TAIL_START)
    assert table.ids.shape[0] == 7**4 and table.lengths.shape == (7**4,) and table.num_pieces == 6
    # Row "#_XP##\n" has interior ids (1, 4, 5, 0) -> key 1*343 + 4*49 + 5*7 + 0.
    key = 1 * 343 + 4 * 49 + 5 * 7
    assert env.piece_texts[key] == "#_XP##\n"
    assert table.ids[key, : table.lengths[key]].tolist() == qwen_tokenizer("#_XP##\n")["input_ids"]
    grid = np.zeros((6, 6), np.int32)
    grid[2, 1:5] = [1, 4, 5, 0]
    assert env.grid_pieces(grid).tolist() == [0, 0, key, 0, 0, 0]
    assert len(envs_jax.make("FrozenLake").piece_texts) == 6**4  # no fixed border: every cell varies


def test_absent_pieces_render_nothing(qwen_tokenizer):
    table = PieceTable.build(qwen_tokenizer, ("Target: 3\n", "a", "b"), num_pieces=3, followed_by=TAIL_START)
    ids, length = render_pieces(table, jnp.asarray([0, -1, -1]))
    assert np.asarray(ids)[: int(length)].tolist() == qwen_tokenizer("Target: 3\n")["input_ids"]


def test_pack_runs_concatenates_valid_prefixes():
    rng = np.random.default_rng(0)
    stack = rng.integers(1, 100, (5, 4))
    stack_lengths = np.array([0, 4, 2, 1, 3])
    single = rng.integers(1, 100, (1, 7))
    out, length = pack_runs([(single, np.array([6])), (stack, stack_lengths)], out_len=30)
    expected = list(single[0, :6]) + [t for row, n in zip(stack, stack_lengths) for t in row[:n]]
    assert int(length) == len(expected) == 16
    assert np.asarray(out).tolist() == expected + [PAD_ID] * (30 - len(expected))
