"""The KV-cached sampler: parity with transformers' greedy generate, continuation, ragged rows, stops.

All decodes share one shape (batch 3, cache 32, 6 new tokens) so they share one compilation.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from helpers import AS_A_RUN_COMPILES, fake_decode_state, recording_step
from starpo_jax.models import ModelState, decoder_from_hf_tensors, preset
from starpo_jax.rollout import sampling

B, CACHE, NEW = 3, 32, 6


@pytest.fixture(scope="module")
def tiny():
    config = preset("tiny-qwen2")
    torch.manual_seed(0)
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config.to_hf_config()))
    hf.eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.2)
    tensors = {k: v.detach().numpy().copy() for k, v in hf.state_dict().items()}
    return config, hf, ModelState.split(decoder_from_hf_tensors(config, tensors))


def right_padded(rows: list[np.ndarray], width: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.zeros((len(rows), width), np.int32)
    for b, row in enumerate(rows):
        tokens[b, : len(row)] = row
    return tokens, np.array([len(r) for r in rows], np.int32)


def prefill(model, rows, width=8):
    tokens, lengths = right_padded(rows, width)
    return sampling.append(model, sampling.init_cache(model.merge().config, len(rows), CACHE), tokens, lengths)


def run(model, rows, key=0, **kwargs):
    cache, logits = prefill(model, rows)
    kwargs.setdefault("temperature", 1.0)
    return sampling.decode(model, cache, logits, jax.random.key(key), max_new_tokens=NEW, **kwargs)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, n) for n in (8, 5, 2)]


def test_greedy_decode_equals_transformers_generate(tiny, prompts):
    config, hf, model = tiny
    out = run(model, prompts, temperature=0.0)
    np.testing.assert_array_equal(out.lengths, [NEW] * B)
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor(prompt[None]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
        np.testing.assert_array_equal(out.tokens[b], expected[0, len(prompt) :].numpy())
        # Greedy log-probs are log_softmax(logits) of the chosen tokens.
        with torch.no_grad():
            logits = hf(expected).logits[0, len(prompt) - 1 : -1]
        expected_lp = torch.log_softmax(logits, -1).gather(-1, expected[0, len(prompt) :, None])[:, 0].numpy()
        np.testing.assert_allclose(out.logprobs[b], expected_lp, atol=1e-5)
    assert len(set(np.asarray(out.tokens).ravel())) > 6  # the tiny model does not just repeat itself


def test_ragged_rows_behave_like_rows_run_alone(tiny, prompts):
    _, _, model = tiny
    together = run(model, prompts, temperature=0.0)
    for b, prompt in enumerate(prompts):
        alone = run(model, [prompt] * B, temperature=0.0)  # same shapes, so the same compiled program
        np.testing.assert_array_equal(alone.tokens[0], together.tokens[b])
        np.testing.assert_allclose(alone.logprobs[0], together.logprobs[b], atol=1e-5)


def test_continuation_equals_decoding_the_concatenation_from_scratch(tiny, prompts):
    """prefill A, decode, append B, decode == prefill A + generated + B, decode (same key)."""
    _, _, model = tiny
    first = run(model, prompts, key=1)
    observation = [np.arange(n) + 100 for n in (3, 1, 4)]  # the next turn's ragged observation
    obs_tokens, obs_lengths = right_padded(observation, 4)
    cache, logits = sampling.append(model, first.cache, obs_tokens, obs_lengths)
    second = sampling.decode(model, cache, logits, jax.random.key(2), max_new_tokens=NEW, temperature=1.0)

    history = [np.concatenate([p, np.asarray(first.tokens[b]), observation[b]]) for b, p in enumerate(prompts)]
    tokens, lengths = right_padded(history, 18)
    cache, logits = sampling.append(model, sampling.init_cache(preset("tiny-qwen2"), B, CACHE), tokens, lengths)
    scratch = sampling.decode(model, cache, logits, jax.random.key(2), max_new_tokens=NEW, temperature=1.0)

    np.testing.assert_array_equal(second.cache.lengths, lengths + NEW)
    np.testing.assert_array_equal(second.tokens, scratch.tokens)
    np.testing.assert_allclose(second.logprobs, scratch.logprobs, atol=1e-5)


def test_same_key_same_tokens_and_top_k_one_is_greedy(tiny, prompts):
    _, _, model = tiny
    a, b, c = run(model, prompts, key=3), run(model, prompts, key=3), run(model, prompts, key=4)
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.logprobs, b.logprobs)
    assert not np.array_equal(a.tokens, c.tokens)
    greedy = run(model, prompts, temperature=0.0)
    top1 = run(model, prompts, key=5, temperature=0.7, top_k=1)
    np.testing.assert_array_equal(top1.tokens, greedy.tokens)


def test_stop_tokens_end_rows_and_inactive_rows_do_not_change(tiny, prompts):
    _, _, model = tiny
    free = run(model, prompts, temperature=0.0)
    stop = int(free.tokens[0, 2])  # row 0 stops at its third token; the other rows never emit -1
    stops = np.array([[stop, -1], [-1, -1], [-1, -1]], np.int32)
    cache, logits = prefill(model, prompts)
    out = sampling.decode(
        model, cache, logits, jax.random.key(0), max_new_tokens=NEW, temperature=0.0,
        stop_tokens=stops, active=np.array([True, True, False]), pad_id=7,
    )  # fmt: skip
    first_stop = int(np.argmax(np.asarray(free.tokens[0]) == stop)) + 1
    np.testing.assert_array_equal(out.lengths, [first_stop, NEW, 0])
    np.testing.assert_array_equal(out.tokens[0, :first_stop], free.tokens[0, :first_stop])
    assert (np.asarray(out.tokens[0, first_stop:]) == 7).all() and (np.asarray(out.logprobs[0, first_stop:]) == 0).all()
    np.testing.assert_array_equal(out.tokens[1], free.tokens[1])
    assert (np.asarray(out.tokens[2]) == 7).all()
    # The stop token is in the cache; the inactive row's cache is untouched.
    np.testing.assert_array_equal(out.cache.lengths, np.asarray(cache.lengths) + [first_stop, NEW, 0])
    np.testing.assert_array_equal(np.stack(out.cache.k)[:, 2], np.stack(cache.k)[:, 2])
    np.testing.assert_array_equal(out.last_logits[2], logits[2])


def test_budgets_end_each_row_at_its_own_length(tiny, prompts):
    _, _, model = tiny
    free = run(model, prompts, key=2)
    cache, _ = prefill(model, prompts)
    out = run(model, prompts, key=2, budgets=np.array([2, 0, NEW + 5], np.int32), pad_id=7)
    np.testing.assert_array_equal(out.lengths, [2, 0, NEW])  # a budget past max_new_tokens is capped
    np.testing.assert_array_equal(out.tokens[0, :2], free.tokens[0, :2])
    np.testing.assert_array_equal(out.tokens[2], free.tokens[2])
    assert (np.asarray(out.tokens[0, 2:]) == 7).all() and (np.asarray(out.tokens[1]) == 7).all()
    np.testing.assert_array_equal(out.cache.lengths, np.asarray(cache.lengths) + [2, 0, NEW])
    np.testing.assert_array_equal(np.stack(out.cache.k)[:, 1], np.stack(cache.k)[:, 1])


@pytest.mark.parametrize("shards", [1, 2])
def test_the_decode_loop_goes_on_with_the_rows_still_answering(shards):
    """The loop moves its live rows into half or a quarter of the batch once they fit it (per
    shard of the batch) with 4 steps of the budget left, and each row keeps its own state and
    per-row inputs through the moves; rows that ended are left as they were."""
    steps = 12
    budgets = np.array([12, 1, 2, 3, 12, 1, 1, 2, 12, 3, 3, 1, 2, 6, 2, 1])  # 16 rows
    sizes = tuple(n // shards for n in (16, 8, 4))
    out = jax.jit(lambda s: sampling.decode_loop(recording_step, s, jnp.arange(16.0) + 100, steps, sizes, shards))(
        fake_decode_state(budgets, steps))
    out = jax.device_get(out)
    np.testing.assert_array_equal(out.lengths, budgets)
    for row, budget in enumerate(budgets):  # stepped with its own input while live, never after
        np.testing.assert_array_equal(out.logprobs[row, :budget], 100 + row)
        assert (out.logprobs[row, budget:] <= 0).all()
    batch = out.tokens[np.argmax(budgets)]
    # live rows at the start of steps 0, 1, 2, 3: 16, 11, 7 (3 and 4 of each 8), 4 (2 and 2): a half
    # holds them from step 2 on, a quarter from step 3
    np.testing.assert_array_equal(batch, [16, 16, 8] + [4] * 9)


def test_the_decode_loop_does_not_move_rows_for_its_last_steps():
    steps = 12
    budgets = np.array([12, 12, 12, 12] + [10] * 12)  # 4 live rows from step 10, 2 steps before the end
    out = jax.device_get(jax.jit(lambda s: sampling.decode_loop(recording_step, s, jnp.arange(16.0), steps,
                                                                (16, 8, 4), 1))(fake_decode_state(budgets, steps)))
    np.testing.assert_array_equal(out.tokens[0], [16] * steps)


def test_decode_on_the_rows_still_answering_equals_the_whole_batch(tiny, prompts):
    """A decode whose rows end at different steps, once with its live rows moved into a half and a
    quarter of the batch and once without: the same tokens (each row draws its own noise), lengths
    and caches; the moved rows' products run in a smaller batch, so log-probs, logits and keys agree
    to float32 rounding."""
    _, _, model = tiny
    rows = [prompts[i % 3] for i in range(12)]
    budgets = np.array([NEW, 1, 2, NEW, 1, 1, NEW, 2, 1, 3, 2, 1], np.int32)
    temperature = np.linspace(0.5, 1.5, 12)  # one per row: moved with the rows
    cache, logits = prefill(model, rows)

    def decode(min_live_rows):
        return jax.device_get(sampling.decode(
            model, cache, logits, jax.random.key(3), max_new_tokens=NEW, temperature=temperature, budgets=budgets,
            active=np.arange(12) != 4, min_live_rows=min_live_rows))

    assert sampling.live_batch_sizes(12, 3) == (3, 6, 12)
    whole, moved = decode(13), decode(3)
    np.testing.assert_array_equal(moved.tokens, whole.tokens)
    np.testing.assert_array_equal(moved.lengths, whole.lengths)
    assert moved.lengths[4] == 0 and (moved.lengths[np.arange(12) != 4] == budgets[np.arange(12) != 4]).all()
    np.testing.assert_allclose(moved.logprobs, whole.logprobs, rtol=0, atol=1e-5)
    np.testing.assert_allclose(moved.last_logits, whole.last_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(moved.cache.lengths, whole.cache.lengths)
    for got, want in zip(moved.cache.k + moved.cache.v, whole.cache.k + whole.cache.v):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_rows_stop_when_their_cache_row_is_full(tiny, prompts):
    _, _, model = tiny
    long = np.random.default_rng(4).integers(0, 256, CACHE - 2)
    tokens, lengths = right_padded([long, prompts[1], prompts[2]], CACHE)
    cache, logits = sampling.append(model, sampling.init_cache(preset("tiny-qwen2"), B, CACHE), tokens, lengths)
    out = sampling.decode(model, cache, logits, jax.random.key(0), max_new_tokens=NEW)
    np.testing.assert_array_equal(out.lengths, [2, NEW, NEW])
    np.testing.assert_array_equal(out.cache.lengths, [CACHE, 5 + NEW, 2 + NEW])


def test_sample_logits_filters_and_logprobs():
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]] * 2000))
    keys = jax.random.key(0)
    sample = jax.jit(sampling.sample_logits, static_argnames=("top_k", "top_p"))
    support = lambda **kw: set(np.asarray(sample(logits, keys, 1.0, **kw)[0]).tolist())  # noqa: E731
    assert support() == {0, 1, 2, 3}
    assert support(top_k=2) == {0, 1}
    assert support(top_p=0.45) == {0}  # the top token alone reaches 0.45
    assert support(top_p=0.81) == {0, 1, 2}  # 0.5 + 0.3 < 0.81
    assert support(top_k=3, top_p=0.8) == {0, 1}  # top-p after top-k renormalises: (0.5 + 0.3) / 0.95 > 0.8
    tokens, logprobs = sample(logits[:2], keys, jnp.array([0.5, 0.0]))
    scaled = jax.nn.log_softmax(logits[0] / 0.5)
    np.testing.assert_allclose(logprobs[0], scaled[tokens[0]], atol=1e-6)
    assert tokens[1] == 0 and np.isclose(logprobs[1], np.log(0.5))  # greedy row: log_softmax(logits)


def test_the_unrolled_threefry_draws_jaxs_bits():
    """The sampler's noise is jax's threefry stream with the hash unrolled: the same bits as
    ``jax.random.bits`` and the same draws as ``jax.random.categorical``, typed or raw keys."""
    logits = jax.random.normal(jax.random.key(1), (3, 1000))
    for key in (jax.random.key(0), jax.random.fold_in(jax.random.key(3), 17), jax.random.PRNGKey(5)):
        for shape in ((3, 1000), (7,), (2, 3, 4)):
            bits = jax.jit(lambda k, shape=shape: jax.random.bits(sampling._unrolled(k), shape, jnp.uint32))(key)
            np.testing.assert_array_equal(bits, jax.random.bits(key, shape, jnp.uint32))
        draws = jax.jit(lambda k: jax.random.categorical(sampling._unrolled(k), logits))(key)
        np.testing.assert_array_equal(draws, jax.random.categorical(key, logits))
        # the sampler's own draw: categorical's noise and token, its argmax taken in blocks
        tokens, _ = jax.jit(sampling.sample_logits)(logits, key, 1.0)
        np.testing.assert_array_equal(tokens, jax.random.categorical(key, logits))


def test_first_argmax_is_jnps_argmax():
    """The first index of each row's maximum, as jnp.argmax: ties within a block and across blocks,
    -inf everywhere, a NaN (a row without +inf: jnp counts NaN highest), a width that is not a
    multiple of the block. Maxima and comparisons round nothing, so the two agree exactly."""
    block = sampling.ARGMAX_BLOCK
    for width in (1, block, 3 * block, 3 * block + 17):
        x = np.asarray(jax.random.randint(jax.random.key(width), (12, width), 0, 5), np.float32)
        x[1] = -np.inf
        x[2, -1] = np.nan
        x[3, [0, width - 1]] = 9.0  # the first and last column tie
        x[4, width // 2:] = 9.0
        x[5, :] = 1.0
        np.testing.assert_array_equal(jax.jit(sampling.first_argmax)(x), jnp.argmax(x, axis=-1))


def test_chunked_prefill_equals_one_block(tiny):
    _, _, model = tiny
    rows = [np.random.default_rng(5).integers(0, 256, n) for n in (17, 12, 3)]
    tokens, lengths = right_padded(rows, 30)  # the block wider than its longest row: the last chunks are skipped
    empty = sampling.init_cache(preset("tiny-qwen2"), B, CACHE)
    whole_cache, whole = sampling.append(model, empty, tokens, lengths)
    for chunk_size in (4, 7):  # 5 of 8 chunks of 4 run, some rows empty in them; 3 of 5 chunks of 6
        chunked_cache, chunked = sampling.append(model, empty, tokens, lengths, chunk_size=chunk_size)
        np.testing.assert_array_equal(chunked_cache.lengths, lengths)
        np.testing.assert_allclose(chunked, whole, atol=1e-5)
        for b, n in enumerate(lengths):
            np.testing.assert_allclose(np.stack(chunked_cache.k)[:, b, :, :n], np.stack(whole_cache.k)[:, b, :, :n],
                                       atol=1e-5)


def test_a_long_block_is_split_into_even_chunks():
    for most in (1, 4, 128):
        for width in range(1, 400):
            count, size = sampling.even_chunks(width, most)
            assert size <= most and count == -(-width // most)  # as few chunks as the bound allows
            assert width <= count * size < width + count  # padding under one token a chunk
    assert sampling.even_chunks(275, 128) == (3, 92)


def test_a_cpu_chunk_keeps_its_products_full():
    assert jax.default_backend() == "cpu"
    for rows in (1, 8, 63, 64, 512):
        size = sampling.chunk_tokens(rows, 128)
        assert size == 128 or rows * size >= sampling.CPU_CHUNK_POSITIONS  # enough positions for full-rate products
        assert size == sampling.CPU_CHUNK_TOKENS or rows * (size - 1) < sampling.CPU_CHUNK_POSITIONS  # and no more
    assert sampling.chunk_tokens(64, 128) == 16 and sampling.chunk_tokens(8, 128) == 128
    assert sampling.chunk_tokens(64, 8) == 8  # never above the caller's bound


def in_bfloat16(hf) -> ModelState:
    """The tiny model's weights, computing and stored in bfloat16."""
    tensors = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    return ModelState.split(
        decoder_from_hf_tensors(preset("tiny-qwen2", dtype="bfloat16", param_dtype="bfloat16"), tensors)
    )


def test_bfloat16_sampling_runs_and_follows_fp32(tiny, prompts):
    config, hf, model = tiny
    bf16 = in_bfloat16(hf)
    tokens, lengths = right_padded(prompts, 8)
    cache, logits = sampling.append(bf16, sampling.init_cache(bf16.merge().config, B, CACHE), tokens, lengths)
    # the cache keeps the compute dtype, except on CPU (float32: decoder.cache_dtype)
    assert cache.k[0].dtype == (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    assert logits.dtype == jnp.float32
    out = sampling.decode(bf16, cache, logits, jax.random.key(0), max_new_tokens=NEW, temperature=0.0)
    reference = run(model, prompts, temperature=0.0)
    np.testing.assert_array_equal(out.lengths, [NEW] * B)
    assert np.isfinite(np.asarray(out.logprobs)).all()
    np.testing.assert_array_equal(out.tokens[:, 0], reference.tokens[:, 0])  # first greedy token agrees


def test_decode_windows():
    assert sampling.decode_windows(320) == (320,)
    assert sampling.decode_windows(3600) == (384, 896, 1792, 3600)


@pytest.mark.parametrize("lengths", [(8, 5, 2), (300, 5, 2), (600, 5, 2)], ids=["window 128", "window 512", "whole"])
def test_windowed_decode_equals_decoding_in_the_whole_cache(tiny, lengths):
    """A long cache decodes in the smallest window holding the live rows; the third row is inactive
    and longer than any window, and is left exactly as it was."""
    _, _, model = tiny
    rng = np.random.default_rng(5)
    rows = [rng.integers(0, 256, n) for n in lengths[:2]] + [rng.integers(0, 256, 900)]
    tokens, prompt_lengths = right_padded(rows, 900)
    cache, logits = sampling.append(model, sampling.init_cache(preset("tiny-qwen2"), B, 1024), tokens, prompt_lengths)
    outs = [
        sampling.decode(model, cache, logits, jax.random.key(1), max_new_tokens=16, temperature=1.0,
                        active=np.array([True, True, False]), windowed=windowed)
        for windowed in (True, False)
    ]  # fmt: skip
    windowed, whole = outs
    np.testing.assert_array_equal(windowed.tokens, whole.tokens)
    np.testing.assert_array_equal(windowed.lengths, whole.lengths)
    np.testing.assert_allclose(windowed.logprobs, whole.logprobs, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(windowed.last_logits, whole.last_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(windowed.cache.lengths, whole.cache.lengths)
    np.testing.assert_allclose(windowed.cache.k, whole.cache.k, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.stack(windowed.cache.k)[:, 2], np.stack(cache.k)[:, 2])


@pytest.mark.parametrize("lengths", [(8, 5), (300, 5), (600, 5)], ids=["window 128", "window 512", "whole"])
def test_windowed_append_equals_appending_in_the_whole_cache(tiny, lengths):
    """A turn appended to a long cache runs in the smallest window holding the rows it writes; the
    third row gets nothing, is longer than any window, and is left exactly as it was."""
    _, _, model = tiny
    rng = np.random.default_rng(6)
    rows = [rng.integers(0, 256, n) for n in lengths] + [rng.integers(0, 256, 900)]
    tokens, prompt_lengths = right_padded(rows, 900)
    cache, _ = sampling.append(model, sampling.init_cache(preset("tiny-qwen2"), B, 1024), tokens, prompt_lengths,
                               windowed=False)
    turn, turn_lengths = right_padded([rng.integers(0, 256, 20), rng.integers(0, 256, 7), np.zeros(0, int)], 20)
    (windowed, windowed_logits), (whole, whole_logits) = (
        sampling.append(model, cache, turn, turn_lengths, windowed=windowed) for windowed in (True, False))
    np.testing.assert_array_equal(windowed.lengths, whole.lengths)
    np.testing.assert_array_equal(windowed.lengths, np.asarray(prompt_lengths) + np.asarray(turn_lengths))
    np.testing.assert_allclose(windowed.k, whole.k, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(windowed.v, whole.v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(windowed_logits[:2], whole_logits[:2], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.stack(windowed.k)[:, 2], np.stack(cache.k)[:, 2])


def _called(hlo: str) -> tuple[dict[str, list[str]], dict[str, set[str]]]:
    """An optimised HLO module's computations (name -> instruction lines) and what each calls."""
    computations: dict[str, list[str]] = {}
    name = None
    for line in hlo.splitlines():
        header = re.match(r"^(?:ENTRY )?%(\S+) \(.*\{$", line)
        if header:
            name = header.group(1)
            computations[name] = []
        elif name and line.strip() not in ("", "}"):
            computations[name].append(line)
    called = {
        comp: {c for line in lines for group in re.findall(r"(?:calls|body|condition|to_apply|branch_computations)="
                                                            r"(\{[^}]*\}|%[\w.-]+)", line)
               for c in re.findall(r"%([\w.-]+)", group)}
        for comp, lines in computations.items()
    }  # fmt: skip
    return computations, called


def _reachable(start: str, called: dict[str, set[str]]) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        comp = todo.pop()
        if comp not in seen:
            seen.add(comp)
            todo.extend(called.get(comp, ()))
    return seen


def _dims(shape: str) -> tuple[int, ...]:
    """An HLO array shape's dimensions without the 1s: ``f32[1,64,128]{2,1,0}`` -> (64, 128)."""
    return tuple(int(d) for d in _first_group(r"\[([\d,]*)\]", shape).split(",") if d and d != "1")


def _instruction(line: str) -> tuple[tuple[int, ...], str] | None:
    """An optimised HLO instruction line's result dimensions (``_dims``) and opcode, or None for
    any other line (a tuple-shaped result included)."""
    m = re.match(r"\s*(?:ROOT )?%\S+ = (\w+\[[\d,]*\])\S* ([\w-]+)\(", line)
    return (_dims(m.group(1)), m.group(2)) if m else None


def _first_group(pattern: str, text: str) -> str:
    """``pattern``'s first group in ``text``, which must match."""
    match = re.search(pattern, text)
    assert match is not None, (pattern, text)
    return match.group(1)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_decode_loop_reads_each_layers_cache_and_weights_in_place(tiny, prompts, dtype):
    """In the compiled decode loop (its body and everything it calls) nothing is sliced, gathered or
    copied to the shape of a layer's weights or cache, and every array of a layer's cache shape is
    that buffer updated in place (a scatter). Decoding through the layer scan dynamic-sliced (copied)
    each layer's cache and weights at every token; writing a layer's new keys after attention had
    read its buffer, in no order XLA could see, made it copy the buffer twice per layer.

    Nor does the loop carry anything of the logits' shape [B, V]: carried logits (sampled at the
    start of a step, rewritten at its end) were copied at every token, and the Gumbel noise's
    [B, V] counters, hoisted out of the loop by XLA, were read back at every token.

    In bfloat16 too: a bfloat16 cache on CPU made XLA convert each layer's whole cache to float32
    and back around every write (``decoder.cache_dtype``)."""
    config, hf, model = tiny
    model = model if dtype == "float32" else in_bfloat16(hf)
    cache, logits = prefill(model, prompts)
    hlo = sampling.decode.lower(model, cache, logits, jax.random.key(0), max_new_tokens=NEW).compile(AS_A_RUN_COMPILES).as_text()
    assert hlo is not None
    computations, called = _called(hlo)
    layer_cache = (B, config.num_kv_heads, CACHE, config.head_dim)
    weights = model.merge().layers.per_layer()[0].values()
    layer_shapes = {layer_cache} | {tuple(d for d in w.shape if d != 1) for w in weights}
    loops = [_first_group(r"body=%([\w.-]+)", line) for lines in computations.values() for line in lines
             if re.search(r" while\(", line)]  # fmt: skip
    body = max(loops, key=lambda b: len(_reachable(b, called)))  # the decode loop holds any other
    loop = next(line for lines in computations.values() for line in lines if f"body=%{body}," in line)
    carried = [_dims(shape) for shape in re.findall(r"\w+\[[\d,]*\]", loop.split(" while(")[0])]
    assert (B, config.vocab_size) not in carried, carried
    roots = {c: next(line for line in lines if "ROOT" in line) for c, lines in computations.items()}
    writes = 0
    for comp in _reachable(body, called):
        for line in computations[comp]:
            instruction = _instruction(line)
            if not instruction or instruction[1] in ("parameter", "get-tuple-element", "bitcast", "tuple"):
                continue
            shape, op = instruction
            assert not (op in ("dynamic-slice", "slice", "gather", "copy") and shape in layer_shapes), line
            if shape == layer_cache:
                fused = re.search(r"calls=%([\w.-]+)", line)
                assert " scatter(" in (roots[fused.group(1)] if fused else line), line
                writes += 1
    assert writes >= 2 * config.num_layers  # each layer's keys and values written in place


def compiled_turn(config, model, rows: int = B, min_live_rows: int = sampling.MIN_LIVE_ROWS) -> str:
    """The optimised HLO of a turn as the rollout runs it: an append, then a decode, on a cache the
    caller gives up (donated, as inside the rollout's program), compiled as a run compiles it."""

    def turn(model, cache, tokens, num_new, key):
        cache, logits = sampling.append(model, cache, tokens, num_new)
        return sampling.decode(model, cache, logits, key, max_new_tokens=NEW, min_live_rows=min_live_rows)

    tokens, lengths = right_padded([np.arange(1, 9), np.arange(1, 6), np.arange(1, 4), np.arange(1, 7)][:rows], 8)
    cache = sampling.init_cache(config, rows, CACHE)
    hlo = jax.jit(turn, donate_argnums=1).lower(model, cache, tokens, lengths, jax.random.key(0)).compile(
        AS_A_RUN_COMPILES).as_text()
    assert hlo is not None
    return hlo


@pytest.mark.parametrize("rows, min_live_rows", [(B, sampling.MIN_LIVE_ROWS), (4, 1)], ids=["whole batch", "rows moved"])
def test_a_turn_moves_no_layers_cache(tiny, rows, min_live_rows):
    """A turn as the rollout runs it, an append then a decode on a cache the caller gives up
    (donated, as inside the rollout's program): nothing in the compiled program copies, slices,
    gathers or concatenates a layer's cache; both calls write each layer's buffer in place. When the
    cache was held stacked between calls, each decode split it into per-layer buffers and stacked it
    back, copying the whole cache twice per turn; an append through the layer scan stacked it, sliced
    each layer out and split it back at every call. With the decode's live rows moved into a smaller
    batch (4 rows, then 2, then 1), only the moved rows are gathered and written back."""
    config, _, model = tiny
    hlo = compiled_turn(config, model, rows, min_live_rows)
    layer_cache = (rows, config.num_kv_heads, CACHE, config.head_dim)
    of_cache_shape = [(instruction[1], line.strip()) for line in hlo.splitlines()
                      if (instruction := _instruction(line))
                      and instruction[0] in (layer_cache, (1,) + layer_cache, (config.num_layers,) + layer_cache)]
    # the check reads the program: the append's and the decode's writes of each layer's buffer show
    assert sum(op in ("scatter", "fusion") for op, _ in of_cache_shape) >= 4 * config.num_layers, of_cache_shape[:4]
    moved = [line for op, line in of_cache_shape if op in ("copy", "slice", "dynamic-slice", "gather", "concatenate")]
    assert not moved, moved[:4]


def test_a_turn_computes_the_rotary_angles_once_a_call_not_in_every_layer(tiny):
    """The rotary angles' cos and sin are computed once per append and per decode step, as a table
    (``decoder.rotation_from_table``), whatever the number of layers. Computed inside each layer's
    rope, XLA fused them into every layer's rope loops of q and of k and recomputed them per element."""
    config, _, model = tiny
    hlo = compiled_turn(config, model)
    cosines = len(re.findall(r"= f32\[[0-9,]*\]\S* cosine\(", hlo))
    assert config.num_layers >= 2 and 1 <= cosines < 2 * config.num_layers, cosines
