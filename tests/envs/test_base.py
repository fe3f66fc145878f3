"""The step-time random numbers (``draw_bits``) and the grid helpers shared by the envs."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from envs_jax.bitboards import cell_bit, count_cells, num_words, pack_cells, toggle_cell, unpack_cells
from envs_jax.hashing import bits_to_uniform, draw_bits, hash_uniform, hash_words, mix32


@partial(jax.jit, static_argnums=1)
def stream(key, n):
    """The first ``n`` draws of one key, as uniforms."""

    def body(key, _):
        key, bits = draw_bits(key)
        return key, bits_to_uniform(bits)

    return jax.lax.scan(body, key, None, length=n)[1]


def chi_square_uniform(u, bins=16):
    counts = np.histogram(u, bins=bins, range=(0, 1))[0]
    expected = len(u) / bins
    return ((counts - expected) ** 2 / expected).sum()


# 16 bins, 15 degrees of freedom: P(chi2 > 37.7) = 0.001.
CHI2_LIMIT = 37.7


def test_same_key_same_bits_and_the_key_advances():
    key = jax.random.PRNGKey(3)
    (next_a, bits_a), (next_b, bits_b) = draw_bits(key), draw_bits(key)
    assert int(bits_a) == int(bits_b)
    np.testing.assert_array_equal(next_a, next_b)
    assert next_a.dtype == key.dtype and next_a.shape == key.shape
    assert not np.array_equal(next_a, key) and int(draw_bits(next_a)[1]) != int(bits_a)


def test_typed_keys_draw_like_their_raw_data():
    typed = jax.random.key(5)
    next_typed, bits = draw_bits(typed)
    next_raw, raw_bits = draw_bits(jax.random.key_data(typed))
    assert int(bits) == int(raw_bits)
    assert jax.dtypes.issubdtype(next_typed.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(jax.random.key_data(next_typed), next_raw)


def test_draws_across_keys_are_uniform():
    keys = jax.random.split(jax.random.PRNGKey(0), 1 << 14)
    u = np.asarray(jax.vmap(lambda k: bits_to_uniform(draw_bits(k)[1]))(keys))
    assert u.min() >= 0 and u.max() < 1
    assert chi_square_uniform(u) < CHI2_LIMIT


@pytest.mark.parametrize("key", [jax.random.PRNGKey(0), jax.random.PRNGKey(123)])
def test_draws_along_one_key_are_uniform_and_uncorrelated(key):
    u = np.asarray(stream(key, 1 << 14))
    assert chi_square_uniform(u) < CHI2_LIMIT
    lag1 = np.corrcoef(u[:-1], u[1:])[0, 1]
    assert abs(lag1) < 5 / np.sqrt(len(u))


def test_consecutive_seeds_do_not_share_draws():
    # PRNGKey(s) is (0, s): with a plain +1 counter, seed s after one draw would replay seed s + 1.
    seeds = jnp.arange(50, dtype=jnp.uint32)
    draws = np.asarray(jax.vmap(lambda s: stream(jax.random.PRNGKey(s), 100))(seeds))
    later_of_each, start_of_next = draws[:-1, 1:], draws[1:, :-1]
    assert not np.any(later_of_each == start_of_next)
    assert len(np.unique(draws)) > 0.99 * draws.size


def test_mix32_is_a_bijection_that_spreads_bits():
    x = jnp.arange(1 << 16, dtype=jnp.uint32)
    assert len(np.unique(np.asarray(mix32(x)))) == len(x)
    # Flipping one input bit flips about half of the 32 output bits.
    flips = np.unpackbits(np.asarray(mix32(x) ^ mix32(x ^ 1)).view(np.uint8)).reshape(len(x), 32)
    assert abs(flips.sum(axis=1).mean() - 16) < 0.5
    assert int(hash_words(1, 2)) != int(hash_words(2, 1))


@pytest.mark.parametrize("shape", [(4, 4), (6, 6), (3, 11), (8, 8), (9, 9)])
def test_bitboards_read_write_and_count_the_cells_of_a_mask(shape):
    rng = np.random.default_rng(shape[0] * 100 + shape[1])
    masks = rng.random((5,) + shape) < 0.4  # a batch of 5 grids
    words = pack_cells(masks)
    assert len(words) == num_words(shape) == -(-shape[0] * shape[1] // 32)
    assert all(w.dtype == jnp.uint32 and w.shape == (5,) for w in words)
    np.testing.assert_array_equal(unpack_cells(words, shape), masks)
    np.testing.assert_array_equal(count_cells(words), masks.sum(axis=(1, 2)))

    flat = masks.reshape(5, -1)
    cells = np.arange(flat.shape[1])
    read = jax.vmap(jax.vmap(cell_bit, in_axes=(None, 0)), in_axes=(0, None))(words, jnp.asarray(cells))
    np.testing.assert_array_equal(read, flat)

    cell = jnp.asarray(rng.integers(0, flat.shape[1], 5), jnp.int32)
    on = jnp.array([True, False, True, True, False])
    toggled = unpack_cells(jax.vmap(toggle_cell)(words, cell, on), shape).reshape(5, -1)
    expected = flat.copy()
    for row in np.flatnonzero(on):
        expected[row, cell[row]] ^= True
    np.testing.assert_array_equal(toggled, expected)


def test_hash_uniform_is_uniform_deterministic_and_keyed():
    key = jax.random.PRNGKey(3)
    u = np.asarray(hash_uniform(key, (64, 100, 4)))
    assert u.shape == (64, 100, 4) and u.dtype == np.float32 and 0 <= u.min() and u.max() < 1
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    expected = u.size / 10
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))
    flat = u.ravel()
    assert abs(np.corrcoef(flat[:-1], flat[1:])[0, 1]) < 0.02  # neighbouring counters unrelated
    np.testing.assert_array_equal(u, hash_uniform(key, (64, 100, 4)))
    np.testing.assert_array_equal(u, hash_uniform(jax.random.wrap_key_data(key), (64, 100, 4)))
    other = np.asarray(hash_uniform(jax.random.PRNGKey(4), (64, 100, 4)))
    assert abs(np.corrcoef(flat, other.ravel())[0, 1]) < 0.02
