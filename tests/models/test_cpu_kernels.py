"""The CPU kernels. The cached attention: XLA's sums to float32 rounding, only the held slots read,
used by the decode step and the prompt chunks where it is available, and XLA's attention where it
is not. The sampler: jax's Gumbel-max draw, the same tokens, used by ``sample_logits`` where it is
available and no filter is on."""

import contextlib
import ctypes
import functools
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starpo_jax.models import ModelState, cpu_kernels, decoder, preset
from starpo_jax.rollout import sampling

pytestmark = pytest.mark.skipif(not cpu_kernels.available(), reason="the kernel runs on a CPU with a C++ compiler")

B, KV_HEADS, GROUP, SLOTS, D = 5, 2, 3, 24, 16


def inputs(seed=0, dtype=jnp.float32, group=GROUP, d=D, tokens=1):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (B, tokens, KV_HEADS * group, d), dtype)
    k_new, v_new = (jax.random.normal(k, (B, tokens, KV_HEADS, d), dtype) for k in ks[1:3])
    k_cache, v_cache = (jax.random.normal(k, (B, KV_HEADS, SLOTS, d)) for k in ks[3:5])
    lengths = jnp.array([0, 1, 7, SLOTS - 1, SLOTS], jnp.int32)  # none held to all held
    return q, k_new, v_new, k_cache, v_cache, lengths, jnp.full((B,), tokens, jnp.int32)


def xla_attention(q, k_new, v_new, k_cache, v_cache, lengths, num_new):
    visible = (jnp.arange(k_cache.shape[2]) < lengths[:, None])[:, None, :]
    return decoder._attend_after(q, k_new, v_new, k_cache, v_cache, visible)


kernel = jax.jit(cpu_kernels.cached_attention)


# Both sum ≤ SLOTS + 1 float32 products of O(1) terms in other orders, and normalise once: a few
# ulps of the O(1) outputs.
ATOL = 1e-5


# The kernel's paths, in vectors of 16 floats (AVX-512) or 8: heads of 1, 2, 4 or 8 vectors (their
# keys' scores a tile of keys at a time), of 3 or 6 vectors (a key at a time), or of 12 floats, or 8
# where the vectors are 16 (one float at a time); queries per kv head in blocks of up to four (7 =
# 4 + 3, as Qwen2.5-0.5B's); one query. Rows hold 0 to 24 keys: no tile, a tile and the rest.
CASES = [(GROUP, D), (7, 64), (5, 8), (1, 16), (2, 12), (3, 32), (2, 48), (1, 128)]


@pytest.mark.parametrize("group, d", CASES)
def test_the_kernel_computes_xlas_attention_for_every_length(group, d):
    args = inputs(group=group, d=d)
    np.testing.assert_allclose(kernel(*args), jax.jit(xla_attention)(*args), atol=ATOL, rtol=0)


@functools.cache
def width_build(floats: int) -> str:
    """The kernels built with vectors of ``floats`` floats, registered under names of their own: the
    names' suffix."""
    library = ctypes.cdll.LoadLibrary(str(cpu_kernels.build(defines=(f"-DSTARPO_VECTOR_FLOATS={floats}",))))
    cpu_kernels.register(library, suffix=f"_{floats}")
    return f"_{floats}"


def width_kernel(floats: int):
    """The attention kernel built with vectors of ``floats`` floats."""
    return jax.jit(functools.partial(cpu_kernels.cached_attention, target=cpu_kernels.TARGET + width_build(floats)))


# Each vector width on every machine (the native build takes one of them): a decode step and a block.
@pytest.mark.parametrize("floats", [8, 16])
@pytest.mark.parametrize("group, d", [(GROUP, D), (7, 64), (2, 48), (5, 8)])
def test_both_vector_widths_compute_xlas_attention(floats, group, d):
    for tokens in (1, 8):
        args = inputs(group=group, d=d, tokens=tokens)
        np.testing.assert_allclose(width_kernel(floats)(*args), jax.jit(xla_attention)(*args), atol=ATOL, rtol=0)


# A block of 8 tokens: a token at a time (one real token; heads of 12), or the block's tiled products
# (3 x 8 = 24 queries of a kv head: three vectors; 7 x 8 = 56: three and a half; heads of 8, 16, 64).
@pytest.mark.parametrize("group, d", [(GROUP, D), (7, 64), (5, 8), (2, 12)])
def test_a_block_of_tokens_attends_causally_and_its_padding_comes_back_as_zeros(group, d):
    q, k_new, v_new, k_cache, v_cache, lengths, _ = inputs(group=group, d=d, tokens=8)
    num_new = jnp.array([8, 1, 0, 5, 2], jnp.int32)
    got = kernel(q, k_new, v_new, k_cache, v_cache, lengths, num_new)
    want = jax.jit(xla_attention)(q, k_new, v_new, k_cache, v_cache, lengths, num_new)
    real = (jnp.arange(8)[None, :] < num_new[:, None])[:, :, None, None]
    np.testing.assert_allclose(jnp.where(real, got, 0), jnp.where(real, want, 0), atol=ATOL, rtol=0)
    assert not np.any(np.where(real, 0, got))


def test_a_token_does_not_see_the_blocks_later_keys():
    q, k_new, v_new, k_cache, v_cache, lengths, num_new = inputs(tokens=6)
    later = (jnp.arange(6) >= 3)[None, :, None, None]
    moved = [jnp.where(later, x + 5.0, x) for x in (k_new, v_new)]
    got = kernel(q, *moved, k_cache, v_cache, lengths, num_new)
    want = kernel(q, k_new, v_new, k_cache, v_cache, lengths, num_new)
    np.testing.assert_array_equal(got[:, :3], want[:, :3])
    assert not np.array_equal(got[:, 3:], want[:, 3:])


def test_slots_past_a_rows_length_are_never_read():
    q, k_new, v_new, k_cache, v_cache, lengths, num_new = inputs(tokens=2)
    past = jnp.arange(SLOTS)[None, None, :, None] >= lengths[:, None, None, None]
    poisoned = [jnp.where(past, jnp.nan, c) for c in (k_cache, v_cache)]
    clean = kernel(q, k_new, v_new, k_cache, v_cache, lengths, num_new)
    assert np.array_equal(kernel(q, k_new, v_new, *poisoned, lengths, num_new), clean)


# Rows 0, 2, 3 one prefix group (row 0 the first), rows 1 and 4 alone; 21 shared slots: not whole
# tiles of 8 or 16 keys, so a tile holds shared slots and a row's own.
GROUPS, SHARED = jnp.array([7, 5, 7, 7, 9], jnp.int32), 21


def sharing(seed=0, tokens=1):
    """``inputs`` whose rows 2 and 3 hold row 0's first SHARED slots (their own after), all holding
    more than SHARED: what a group's copies of one prompt hold."""
    q, k_new, v_new, k_cache, v_cache, _, num_new = inputs(seed, tokens=tokens)
    copied = (jnp.arange(SLOTS) < SHARED)[None, None, :, None] & (GROUPS == 7)[:, None, None, None]
    k_cache, v_cache = (jnp.where(copied, c[:1], c) for c in (k_cache, v_cache))
    lengths = jnp.array([22, SLOTS, 23, SLOTS, 21], jnp.int32)
    return q, k_new, v_new, k_cache, v_cache, lengths, num_new


@pytest.mark.parametrize("floats", [None, 8, 16])
@pytest.mark.parametrize("tokens", [1, 8])
def test_a_prefix_groups_rows_attend_exactly_as_each_alone(floats, tokens):
    call = kernel if floats is None else width_kernel(floats)
    args = sharing(tokens=tokens)
    shared = jnp.full((B,), SHARED, jnp.int32)
    # each row's sums in the same order, over the same values: the same floats
    assert np.array_equal(call(*args, GROUPS, shared), call(*args))


def test_a_prefix_groups_shared_slots_are_read_from_its_first_row():
    q, k_new, v_new, k_cache, v_cache, lengths, num_new = sharing()
    shared = jnp.full((B,), 16, jnp.int32)  # whole tiles, at either width
    others = (jnp.arange(SLOTS) < 16)[None, None, :, None] & (jnp.arange(B) != 0)[:, None, None, None]
    poisoned = [jnp.where(others & (GROUPS == 7)[:, None, None, None], jnp.nan, c) for c in (k_cache, v_cache)]
    clean = kernel(q, k_new, v_new, k_cache, v_cache, lengths, num_new)
    assert np.array_equal(kernel(q, k_new, v_new, *poisoned, lengths, num_new, GROUPS, shared), clean)
    assert np.isnan(kernel(q, k_new, v_new, *poisoned, lengths, num_new)[2:4]).all()  # read where alone


def test_bfloat16_queries_come_back_in_bfloat16():
    args = inputs(dtype=jnp.bfloat16)
    got = kernel(*args)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(got.astype(jnp.float32), xla_attention(*args).astype(jnp.float32), atol=1e-2)


def test_vmapped_it_computes_each_member_alone():
    # the same prefix groups in both members, which hold different caches: a group is a member's own
    members = [(*sharing(seed, tokens=2), GROUPS, jnp.full((B,), SHARED, jnp.int32)) for seed in (1, 2)]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *members)
    got = jax.jit(jax.vmap(cpu_kernels.cached_attention))(*stacked)
    for i, args in enumerate(members):
        assert np.array_equal(got[i], kernel(*args))


def decode_hlo(model, config, kernel: bool, rows: int = 2):
    jax.clear_caches()  # decode is jitted: retrace with this choice
    lengths = jnp.array([3, 9] * (rows // 2), jnp.int32)
    cache = sampling.init_cache(config, rows, 16).replace(lengths=lengths)
    logits = jax.random.normal(jax.random.key(1), (rows, config.vocab_size))
    decode = jax.jit(lambda m, c, x: sampling.decode(m, c, x, jax.random.key(0), max_new_tokens=3, top_k=1))
    with contextlib.nullcontext() if kernel else cpu_kernels.xla_only():
        return decode.lower(model, cache, logits).as_text(), decode(model, cache, logits)


def test_the_decode_step_takes_the_kernel_where_available_and_decodes_the_same():
    config = preset("tiny-qwen2")
    model = ModelState.split(decoder.Decoder(config, rngs=nnx.Rngs(0)))
    with_kernel, kernel_out = decode_hlo(model, config, True)
    without, xla_out = decode_hlo(model, config, False)
    assert cpu_kernels.TARGET in with_kernel and cpu_kernels.TARGET not in without
    assert np.array_equal(kernel_out.tokens, xla_out.tokens)  # greedy, from an untrained model's clear margins
    np.testing.assert_allclose(kernel_out.logprobs, xla_out.logprobs, atol=1e-4)


def test_a_decode_step_of_a_few_rows_takes_the_products_kernel_and_decodes_the_same():
    """16 rows (the fewest that take it) and 2 (too few: XLA's products)."""
    config = preset("tiny-qwen2")
    model = ModelState.split(decoder.Decoder(config, rngs=nnx.Rngs(0)))
    with_kernel, kernel_out = decode_hlo(model, config, True, rows=decoder.KERNEL_PRODUCT_ROWS[0])
    without, xla_out = decode_hlo(model, config, False, rows=decoder.KERNEL_PRODUCT_ROWS[0])
    assert cpu_kernels.PRODUCT in with_kernel and cpu_kernels.PRODUCT not in without
    assert cpu_kernels.PRODUCT not in decode_hlo(model, config, True, rows=2)[0]
    assert np.array_equal(kernel_out.tokens, xla_out.tokens)  # greedy, from an untrained model's clear margins
    np.testing.assert_allclose(kernel_out.logprobs, xla_out.logprobs, atol=1e-4)


def test_a_decode_reads_a_prefix_groups_shared_slots_from_its_first_row():
    """A cache of copies of two prompts (``KVCache.copies``, the first turn's): each decode step
    reads a group's first 16 slots (whole tiles) from its first row, so NaN in the other rows'
    copies changes nothing (the same program, the same floats)."""
    config = preset("tiny-qwen2")
    model = ModelState.split(decoder.Decoder(config, rngs=nnx.Rngs(0)))
    prompts = jax.random.randint(jax.random.key(2), (2, 20), 0, config.vocab_size)
    once, logits = sampling.append(model, sampling.init_cache(config, 2, 32), prompts, jnp.array([20, 17]))
    source = jnp.array([0, 0, 1, 0, 1])
    cache = once.copies(source)
    copy = (jnp.arange(5) != jnp.array([0, 0, 2, 0, 2]))[:, None, None, None]  # not a group's first row
    poisoned = cache.replace(**{kv: tuple(jnp.where(copy & (jnp.arange(32) < 16)[:, None], jnp.nan, x)
                                          for x in getattr(cache, kv)) for kv in ("k", "v")})
    decode = jax.jit(lambda c: sampling.decode(model, c, logits[source], jax.random.key(0), max_new_tokens=4))
    clean, got = decode(cache), decode(poisoned)
    assert np.isfinite(got.logprobs).all()
    assert np.array_equal(got.tokens, clean.tokens) and np.array_equal(got.logprobs, clean.logprobs)


def append_with(model, config, kernel: bool):
    jax.clear_caches()  # append is jitted: retrace with this choice
    cache = sampling.init_cache(config, 2, 16).replace(lengths=jnp.array([3, 9], jnp.int32))
    tokens = jax.random.randint(jax.random.key(1), (2, 5), 0, config.vocab_size)
    num_new = jnp.array([5, 2], jnp.int32)
    with contextlib.nullcontext() if kernel else cpu_kernels.xla_only():
        return sampling.append.lower(model, cache, tokens, num_new).as_text(), sampling.append(model, cache, tokens, num_new)


def test_a_prompt_chunk_takes_the_kernel_where_available_and_appends_the_same():
    config = preset("tiny-qwen2")
    model = ModelState.split(decoder.Decoder(config, rngs=nnx.Rngs(0)))
    with_kernel, (kernel_cache, kernel_logits) = append_with(model, config, True)
    without, (xla_cache, xla_logits) = append_with(model, config, False)
    assert cpu_kernels.TARGET in with_kernel and cpu_kernels.TARGET not in without
    np.testing.assert_allclose(kernel_logits, xla_logits, atol=1e-4)
    np.testing.assert_array_equal(kernel_cache.lengths, xla_cache.lengths)
    for got, want in zip(kernel_cache.k + kernel_cache.v, xla_cache.k + xla_cache.v):
        np.testing.assert_allclose(got, want, atol=1e-4)


def test_xla_only_holds_its_kernels_off_until_its_outermost_block_ends():
    attention, sampler = cpu_kernels.TARGET, cpu_kernels.SAMPLER
    with cpu_kernels.xla_only():
        assert not cpu_kernels.available(cpu_kernels.PRODUCT)
        with cpu_kernels.xla_only(attention):
            assert not cpu_kernels.available(attention) and not cpu_kernels.available(sampler)
        assert not cpu_kernels.available(attention) and not cpu_kernels.available(sampler)
        with cpu_kernels.xla_only(sampler):
            pass
        assert not cpu_kernels.available(sampler)
    with cpu_kernels.xla_only(attention):
        assert not cpu_kernels.available(attention) and cpu_kernels.available(sampler)
    assert cpu_kernels.available(attention) and cpu_kernels.available(sampler)


def test_off_by_the_environment_variable(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    assert not cpu_kernels.enabled() and not cpu_kernels.available()
    monkeypatch.setenv(cpu_kernels.ENV, "")
    assert cpu_kernels.enabled()


def test_not_under_a_mesh_that_splits_the_batch():
    mesh = jax.sharding.AbstractMesh((2,), ("data",))
    with jax.sharding.use_abstract_mesh(mesh):
        assert not cpu_kernels.available()


def test_a_compiler_that_fails_is_one_warning_and_xlas_attention(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", "false")  # runs, prints no version, and fails every compile
    with pytest.raises(subprocess.SubprocessError):
        cpu_kernels.build(tmp_path)
    monkeypatch.setattr(cpu_kernels, "_registered", cpu_kernels._registered.__wrapped__)  # uncached
    monkeypatch.setenv("STARPO_JAX_CACHE", str(tmp_path))  # no library built before
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not cpu_kernels._registered()
    assert len(caught) == 1 and "could not build its CPU kernels" in str(caught[0].message)


def test_a_failed_build_names_the_compilers_error_not_its_warnings(monkeypatch, tmp_path):
    compiler = tmp_path / "cxx"
    compiler.write_text('#!/bin/sh\n[ "$1" = --version ] && echo fake 1 && exit 0\n'
                        'echo "row_product.cc:9:3: error: the reason it failed" >&2\n'
                        'for i in $(seq 100); do echo "ffi.h:772: warning: might not be inlinable" >&2; done\n'
                        "exit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    with pytest.raises(subprocess.SubprocessError, match="error: the reason it failed") as failed:
        cpu_kernels.build(tmp_path / "kernels")
    assert "warning" not in str(failed.value)


def test_each_kernel_call_says_the_library_could_not_be_built(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_registered", lambda: False)
    x, q = jnp.ones((2, 4)), jnp.ones((1, 1, 2, 4))
    calls = [lambda: cpu_kernels.row_products(x, [jnp.ones((4, 3))]),
             lambda: cpu_kernels.gumbel_sample(x, jnp.zeros((2, 2), jnp.uint32), jnp.arange(2), False),
             lambda: cpu_kernels.cached_attention(q, q[:, :, :1], q[:, :, :1], jnp.ones((1, 1, 8, 4)),
                                                  jnp.ones((1, 1, 8, 4)), jnp.ones(1, jnp.int32), jnp.ones(1, jnp.int32))]
    for call in calls:
        with pytest.raises(RuntimeError, match="could not be built"):
            call()


def test_a_build_is_found_again_not_recompiled(tmp_path):
    first = cpu_kernels.build(tmp_path)
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build(tmp_path) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no partial file left behind


# The weight products


# Rows: fewer than a tile, a tile and one, two tiles and one. Outputs: whole column blocks, a block
# and some vectors and floats (of 16 or 8), fewer floats than a vector.
@pytest.mark.parametrize("floats", [None, 8, 16])
@pytest.mark.parametrize("rows", [1, 7, 13])
def test_the_products_kernel_sums_each_output_over_its_inputs_in_order(floats, rows):
    """Each output sums its K products in order, one fused multiply-add at a time, so it is within
    K float32 roundings of the exact sum of those products' magnitudes (the textbook bound)."""
    K, outs = 40, (128, 64 + 16 + 8 + 5, 3)
    x = jax.random.normal(jax.random.key(0), (rows, K))
    weights = [jax.random.normal(jax.random.key(n), (K, n)) for n in outs]
    target = cpu_kernels.PRODUCT + (width_build(floats) if floats else "")
    got = jax.jit(functools.partial(cpu_kernels.row_products, target=target))(x, weights)
    x64 = np.asarray(x, np.float64)
    for y, w in zip(got, weights):
        w64 = np.asarray(w, np.float64)
        bound = K * np.finfo(np.float32).eps * (np.abs(x64) @ np.abs(w64))
        assert y.shape == (rows, w.shape[1]) and np.all(np.abs(np.asarray(y, np.float64) - x64 @ w64) <= bound)


def test_blocks_of_16_to_256_rows_in_float32_take_the_products_kernel():
    def takes(rows, tokens, dtype=jnp.float32, weight_dtype=jnp.float32):
        weights = [{"input_norm": jnp.ones((4,)), "q_proj": jnp.zeros((4, 2, 2), weight_dtype)}]
        return decoder.block_products(jnp.zeros((rows, tokens, 4), dtype), weights) is decoder.kernel_products

    assert takes(16, 1) and takes(64, 1) and takes(32, 8) and takes(256, 1)
    assert not takes(15, 1) and not takes(257, 1) and not takes(64, 16)
    assert not takes(64, 1, jnp.bfloat16) and not takes(64, 1, weight_dtype=jnp.bfloat16)
    with cpu_kernels.xla_only(cpu_kernels.PRODUCT):
        assert not takes(64, 1)


def test_vmapped_the_products_kernel_multiplies_each_member_by_its_own_weights():
    """A sweep's members (vmap) each have weights of their own: the same floats as each alone."""
    x = jax.random.normal(jax.random.key(0), (3, 7, 40))
    weights = [jax.random.normal(jax.random.key(n), (3, 40, n)) for n in (80, 5)]
    got = jax.jit(jax.vmap(cpu_kernels.row_products))(x, weights)
    for member in range(3):
        alone = jax.jit(cpu_kernels.row_products)(x[member], [w[member] for w in weights])
        for y, want in zip(got, alone):
            assert np.array_equal(y[member], want)


# The sampler

SAMPLE_ROWS, WORDS = 6, 1000 + 7  # words: not whole vectors, so the last few take the scalar path
TEMPERATURES = jnp.array([1.0, 0.7, 1.3, 0.0, 2.0, 1.0])  # row 3 greedy


def sampler_logits():
    logits = 4 * jax.random.normal(jax.random.key(7), (SAMPLE_ROWS, WORDS))
    logits = logits.at[2, :600].set(-jnp.inf)  # words a filter took out
    return logits.at[5, 300].set(jnp.nan)  # NaN counts as the largest, as jnp.argmax's


def categorical_reference(logits, key, temperature):
    """Tokens and log-probs from jax's own draw, op by op: categorical of the scaled logits, the
    argmax where greedy, log_softmax at the token."""
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), jax.random.categorical(key, scaled))
    return tokens, jnp.take_along_axis(jax.nn.log_softmax(scaled), tokens[:, None], axis=-1)[:, 0]


KEYS = [jax.random.key(0), jax.random.fold_in(jax.random.key(3), 17), jax.random.PRNGKey(5)]


@pytest.mark.parametrize("key", KEYS, ids=["typed", "folded", "raw"])
def test_the_sampler_draws_jaxs_categorical_tokens(key):
    """``sample_logits`` takes the kernel, and its tokens are ``jax.random.categorical``'s: the same
    noise bits, and logarithms within an ulp of XLA's (these logits leave no near tie). Log-probs
    agree to float32 rounding: an exp within 2 ulps, summed in another order, a few ulps of the result."""
    logits = sampler_logits()
    sample = jax.jit(sampling.sample_logits)
    assert cpu_kernels.SAMPLER in sample.lower(logits, key, TEMPERATURES).as_text()
    tokens, logprobs = sample(logits, key, TEMPERATURES)
    want_tokens, want_logprobs = categorical_reference(logits, key, TEMPERATURES)
    np.testing.assert_array_equal(tokens, want_tokens)
    assert tokens[5] == 300
    finite = np.isfinite(want_logprobs)
    np.testing.assert_allclose(logprobs[finite], want_logprobs[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("floats", [8, 16])
def test_the_sampler_at_each_vector_width(floats):
    logits, key = sampler_logits(), KEYS[1]
    greedy = TEMPERATURES <= 0
    scaled = logits / jnp.where(greedy, 1.0, TEMPERATURES)[:, None]
    call = jax.jit(functools.partial(cpu_kernels.gumbel_sample, target=cpu_kernels.SAMPLER + width_build(floats)))
    tokens, _ = call(scaled, jax.random.key_data(key), jnp.arange(SAMPLE_ROWS), greedy)
    np.testing.assert_array_equal(tokens, categorical_reference(logits, key, TEMPERATURES)[0])


def test_gathered_rows_draw_their_own_rows_noise_and_vmap_takes_each_key_alone():
    logits, key = sampler_logits(), KEYS[0]
    whole = jax.jit(sampling.sample_logits)(logits, key, TEMPERATURES)
    rows = jnp.array([4, 1, 5])
    part = jax.jit(sampling.sample_logits, static_argnames="of_rows")(
        logits[rows], key, TEMPERATURES[rows], rows=rows, of_rows=SAMPLE_ROWS)
    np.testing.assert_array_equal(part[0], whole[0][rows])
    np.testing.assert_array_equal(part[1], whole[1][rows])
    keys = jnp.stack([jax.random.key_data(k) for k in KEYS[:2]])
    stacked = jax.jit(jax.vmap(sampling.sample_logits, in_axes=(None, 0, None)))(logits, keys, TEMPERATURES)
    for i, k in enumerate(KEYS[:2]):
        np.testing.assert_array_equal(stacked[0][i], jax.jit(sampling.sample_logits)(logits, k, TEMPERATURES)[0])


def sampler_hlo(**filters) -> str:
    jax.clear_caches()
    return jax.jit(functools.partial(sampling.sample_logits, **filters)).lower(sampler_logits(), KEYS[0], 1.0).as_text()


def test_a_filter_or_xla_only_keeps_xlas_draw():
    assert cpu_kernels.SAMPLER not in sampler_hlo(top_k=5)
    assert cpu_kernels.SAMPLER not in sampler_hlo(top_p=0.9)
    with cpu_kernels.xla_only():
        assert cpu_kernels.SAMPLER not in sampler_hlo()
    assert cpu_kernels.SAMPLER in sampler_hlo()
