"""Random numbers inside an env's ``step``: a counter-based hash of a key the state carries.

FrozenLake's slips and Bandit's payouts come from ``draw_bits``, not ``jax.random``. ``reset`` still uses
``jax.random``. Why: under ``vmap`` on CPU, ``jax.random.split`` + ``uniform`` per row and step
costs three threefry blocks, more than the rest of the step, where the hash is a few integer
operations; ``jax.random``'s other key implementations (``rbg``, ``unsafe_rbg``) are slower still
on CPU under ``vmap``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

#: Added to the key's second word at every draw: an odd constant (2**32 / golden ratio), so the
#: keys ``(s, k)`` and ``(s, k + 1)`` (e.g. ``PRNGKey`` of consecutive seeds) do not reuse each
#: other's draws for about 2**32 / episode length steps.
KEY_INCREMENT = 0x9E3779B9


def mix32(x):
    """A bijective hash of ``uint32`` values (Wellons' "lowbias32"): each input bit flips about
    half of the output bits, so nearby inputs give unrelated outputs."""
    x = jnp.asarray(x, jnp.uint32)
    x = (x ^ (x >> 16)) * jnp.uint32(0x7FEB352D)
    x = (x ^ (x >> 15)) * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def hash_words(a, b):
    """32 random-looking bits from two ``uint32`` words (broadcasting): ``mix32(a ^ mix32(b))``."""
    return mix32(jnp.asarray(a, jnp.uint32) ^ mix32(b))


def key_words(key):
    """The ``uint32`` words of a raw (``jax.random.PRNGKey``) or typed (``jax.random.key``) key."""
    return jax.random.key_data(key) if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) else key


def draw_bits(key):
    """``(next_key, bits)``: 32 random bits from a PRNG key, and the key to draw from next time.

    The bits hash the key's first two words; the next key adds ``KEY_INCREMENT`` to its second
    word. Same key, same bits. ``key`` is a raw ``uint32`` key (``jax.random.PRNGKey``) or a typed
    one (``jax.random.key``); the next key has the same form.
    """
    words = key_words(key)
    bits = hash_words(words[0], words[1])
    words = jnp.concatenate([words[:1], words[1:2] + jnp.uint32(KEY_INCREMENT), words[2:]])
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    next_key = jax.random.wrap_key_data(words, impl=jax.random.key_impl(key)) if typed else words
    return next_key, bits


def hash_uniform(key, shape):
    """float32 uniforms in [0, 1) of ``shape``: each element hashes the key with its own index.

    Counter-based like ``draw_bits`` (one ``mix32`` per number, far cheaper than
    ``jax.random.uniform`` under ``vmap`` on CPU). Same key, same numbers.
    """
    words = key_words(key)
    index = jnp.arange(math.prod(shape), dtype=jnp.uint32).reshape(shape)
    return bits_to_uniform(hash_words(index, hash_words(words[0], words[1])))


def bits_to_uniform(bits):
    """float32 in [0, 1) from 32 random bits (their top 24, exactly representable)."""
    return (bits >> 8).astype(jnp.float32) * jnp.float32(2.0**-24)
