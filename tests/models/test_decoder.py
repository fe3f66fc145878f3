"""The decoder against transformers (PyTorch, CPU) on tiny random Qwen2 and Llama checkpoints."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from starpo_jax.models import (
    PRESETS,
    Decoder,
    KVCache,
    ModelConfig,
    ModelState,
    decoder_from_hf_tensors,
    decoder_to_hf_tensors,
    preset,
)


def tiny_hf_model(name: str, seed: int = 0):
    """A transformers model of a tiny preset with every weight random (biases and norms included),
    large enough that logits spread over O(1) and greedy decoding does not repeat one token."""
    config = preset(name)
    torch.manual_seed(seed)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_config())
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in param_name else p.normal_(0.0, 0.2)
    return config, model


# One jitted forward for every test: modules of the same config and dtype share its compilation.
forward = jax.jit(lambda model, tokens, positions, mask: model(tokens, positions, mask))


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module", params=["tiny-qwen2", "tiny-llama"])
def pair(request):
    config, hf = tiny_hf_model(request.param)
    return config, hf, decoder_from_hf_tensors(config, state_dict_numpy(hf))


def ragged_batch(vocab: int):
    """Three rows of 12 slots: full, right-padded to 7, left-padded to 5 (RAGEN's layout)."""
    T = 12
    tokens = np.random.default_rng(1).integers(0, vocab, (3, T))
    mask = np.ones((3, T), np.int64)
    mask[1, 7:] = 0
    mask[2, :7] = 0
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    return tokens, positions, mask


def test_logits_match_transformers_on_a_padded_batch(pair):
    config, hf, model = pair
    tokens, positions, mask = ragged_batch(config.vocab_size)
    with torch.no_grad():
        expected = hf(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask), position_ids=torch.tensor(positions)
        ).logits.numpy()
    logits = np.asarray(forward(model, tokens, positions, mask))
    real = mask.astype(bool)
    assert np.abs(expected).max() > 1.0  # the comparison is not between near-zero logits
    np.testing.assert_allclose(logits[real], expected[real], atol=1e-4, rtol=0)
    assert np.isfinite(logits).all()  # padding rows stay finite


def test_cached_extend_matches_full_forward(pair):
    """Prefill two ragged chunks into a cache: hidden states equal the full-sequence forward."""
    config, _, model = pair
    tokens = np.random.default_rng(2).integers(0, config.vocab_size, (2, 10))
    first = np.array([6, 3])  # row 0: 6 + 4 tokens, row 1: 3 + 7 tokens
    chunk1 = np.where(np.arange(7)[None] < first[:, None], tokens[:, :7], 0)
    chunk2 = np.stack([np.pad(tokens[b, first[b] :], (0, first[b] - 3)) for b in range(2)])
    positions = np.broadcast_to(np.arange(10), (2, 10))
    full = jax.jit(lambda m: m.hidden_states(tokens, positions))(model)

    extend = jax.jit(lambda m, tokens, num_new, cache: m.extend(tokens, num_new, cache))
    cache = KVCache.init(config, 2, 16)
    h1, cache = extend(model, chunk1, first, cache)
    h2, cache = extend(model, chunk2, 10 - first, cache)
    np.testing.assert_array_equal(cache.lengths, [10, 10])
    for b in range(2):
        np.testing.assert_allclose(h1[b, : first[b]], full[b, : first[b]], atol=1e-5)
        np.testing.assert_allclose(h2[b, : 10 - first[b]], full[b, first[b] :], atol=1e-5)


def test_a_prefix_shared_by_its_rows_gives_the_whole_rows_hidden_states(pair):
    """Two prefixes shared by six rows in no order, each prefix computed once, in the rows' own pass
    (``hidden_states_sharing_prefix``): 7 slots, 5 and 6 of them real (the rest junk tokens); their
    14 positions are not a multiple of the six rows that carry them. Every row's hidden states are
    those of the whole row, its own prefix's real tokens and then its own."""
    config, _, model = pair
    G, B, P, T = 2, 6, 7, 4
    rng = np.random.default_rng(3)
    prefix = rng.integers(1, config.vocab_size, (G, P))
    length = np.array([5, 6])
    rows = rng.integers(1, config.vocab_size, (B, T))
    group = np.array([1, 0, 0, 1, 1, 0])
    positions = length[group][:, None] + np.arange(T)[None]
    whole = np.zeros((B, P + T), np.int64)
    for b, g in enumerate(group):
        whole[b, : length[g] + T] = np.concatenate([prefix[g, : length[g]], rows[b]])
    full = jax.jit(lambda m: m.hidden_states(whole, np.broadcast_to(np.arange(P + T), whole.shape),
                                             (whole != 0).astype(np.int32)))(model)
    shared = jax.jit(lambda m: m.hidden_states_sharing_prefix(prefix, length, group, rows, positions))(model)
    assert shared.shape == (B, T, config.hidden_size)
    for b, g in enumerate(group):
        np.testing.assert_allclose(shared[b], full[b, length[g] : length[g] + T], atol=1e-5)


def test_hf_tensors_round_trip(pair):
    config, hf, model = pair
    tensors = state_dict_numpy(hf)
    back = decoder_to_hf_tensors(model)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight")  # the embedding under a second name
    assert set(back) == set(tensors)
    for name, value in tensors.items():
        assert back[name].dtype == np.float32
        np.testing.assert_array_equal(back[name], value, err_msg=name)


def test_loading_errors_name_the_tensor():
    config, hf = tiny_hf_model("tiny-qwen2")
    tensors = state_dict_numpy(hf)
    missing = dict(tensors)
    del missing["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias.*missing"):
        decoder_from_hf_tensors(config, missing)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*shape \(128, 64\).*expects \(96, 64\)"):
        decoder_from_hf_tensors(dataclasses.replace(config, intermediate_size=96), tensors)
    with pytest.raises(ValueError, match=r"does not use \(model\.layers\.0\.self_attn\.k_proj\.bias"):
        decoder_from_hf_tensors(dataclasses.replace(config, qkv_bias=False), tensors)


def test_bf16_forward_is_close_to_fp32(pair):
    config, hf, model = pair
    bf16 = decoder_from_hf_tensors(
        dataclasses.replace(config, dtype="bfloat16", param_dtype="bfloat16"), state_dict_numpy(hf)
    )
    assert bf16.layers.q_proj[...].dtype == jnp.bfloat16
    tokens, positions, mask = ragged_batch(config.vocab_size)
    ref, out = np.asarray(forward(model, tokens, positions, mask)), forward(bf16, tokens, positions, mask)
    assert out.dtype == jnp.float32
    real = mask.astype(bool)
    err = np.abs(np.asarray(out) - ref)[real]
    assert err.max() < 0.15 * np.abs(ref).max() and err.mean() < 0.05 * np.abs(ref).mean()


def test_weights_carry_logical_axis_names():
    model = nnx.eval_shape(lambda: Decoder(preset("tiny-qwen2"), rngs=nnx.Rngs(0)))
    specs = nnx.get_partition_spec(nnx.state(model))
    assert tuple(specs["layers"]["q_proj"].value) == ("layers", "embed", "heads", "kv")
    assert tuple(specs["layers"]["k_bias"].value) == ("layers", "kv_heads", "kv")
    assert tuple(specs["layers"]["down_proj"].value) == ("layers", "mlp", "embed")
    assert tuple(specs["embed"].value) == ("vocab", "embed")
    assert model.layers.q_proj.shape == (2, 64, 4, 16)  # layers stacked for lax.scan


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama", "smollm2-135m-instruct", "qwen2.5-7b"])
def test_config_round_trips_through_transformers(name):
    config = preset(name)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_config())
    assert hf_config.model_type == ("qwen2" if config.qkv_bias else "llama")
    assert hf_config.rope_parameters["rope_theta"] == config.rope_theta
    assert ModelConfig.from_hf_config(hf_config.to_dict()) == config
    assert ModelConfig.from_hf_config(config.to_hf_config()) == config


def test_from_hf_config_reads_a_qwen25_config_json():
    # Qwen2.5-0.5B-Instruct's config.json (older transformers: rope_theta at the top level).
    d = {
        "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 896,
        "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21,
        "model_type": "qwen2", "num_attention_heads": 14, "num_hidden_layers": 24,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
        "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
        "use_sliding_window": False, "vocab_size": 151936,
    }  # fmt: skip
    assert ModelConfig.from_hf_config(d) == preset("qwen2.5-0.5b-instruct")
    assert ModelConfig.from_hf_config(d, dtype="bfloat16").dtype == "bfloat16"


def test_presets_and_config_errors():
    smol = preset("smollm2-135m-instruct")
    assert (smol.num_layers, smol.hidden_size, smol.num_heads, smol.num_kv_heads) == (30, 576, 9, 3)
    assert (smol.intermediate_size, smol.vocab_size, smol.rope_theta) == (1536, 49152, 100000.0)
    assert smol.tie_word_embeddings and not smol.qkv_bias and smol.rms_norm_eps == 1e-5
    assert preset("qwen2.5-0.5b", dtype="bfloat16").dtype == "bfloat16"
    assert {"qwen2.5-0.5b", "qwen2.5-1.5b-instruct", "qwen2.5-3b", "qwen2.5-7b-instruct"} <= set(PRESETS)
    with pytest.raises(ValueError, match="Unknown model preset 'qwen3'.*qwen2.5-0.5b"):
        preset("qwen3")
    with pytest.raises(ValueError, match="Unsupported model_type 'mistral'"):
        ModelConfig.from_hf_config({**preset("tiny-llama").to_hf_config(), "model_type": "mistral"})
    with pytest.raises(ValueError, match="RoPE scaling"):
        ModelConfig.from_hf_config({**preset("tiny-llama").to_hf_config(), "rope_scaling": {"rope_type": "llama3"}})
    with pytest.raises(ValueError, match="dtype='float16'"):
        preset("tiny-llama", dtype="float16")


@pytest.mark.parametrize("segments", [[[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 2, 2]], [[1, 1, 1, 1, 1], [0, 1, 1, 2, 2]]])
def test_fused_attention_call_matches_dense_attention(segments, monkeypatch):
    """The jax.nn.dot_product_attention call used on GPU (run here with XLA) agrees with ours, its
    gradients too, and is handed only even lengths (cuDNN's masked backward refuses odd ones)."""
    from starpo_jax.models.decoder import attend, fused_attention, sequence_mask

    lengths: list[int] = []
    call = jax.nn.dot_product_attention

    def counted(q, *a, **kw):
        lengths.append(q.shape[1])
        return call(q, *a, **kw)

    monkeypatch.setattr(jax.nn, "dot_product_attention", counted)
    T = len(segments[0])
    keys = jax.random.split(jax.random.key(T), 4)
    q = jax.random.normal(keys[0], (2, T, 4, 16))
    k, v = (jax.random.normal(key, (2, T, 2, 16)) for key in keys[1:3])
    weight = jax.random.normal(keys[3], q.shape)
    allowed = sequence_mask(jnp.array(segments))

    def dense(q, k, v):
        return attend(q, [(k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3), allowed)])

    def fused(q, k, v):
        return fused_attention(q, k, v, allowed, "xla")

    np.testing.assert_allclose(fused(q, k, v), dense(q, k, v), atol=1e-5)
    grads = [jax.grad(lambda *x, f=f: (f(*x) * weight).sum(), argnums=(0, 1, 2))(q, k, v) for f in (fused, dense)]
    for got, want in zip(*grads):
        np.testing.assert_allclose(got, want, atol=1e-5)
    assert lengths and all(n % 2 == 0 for n in lengths), lengths


def test_joint_attention_over_blocks_equals_attention_over_their_concatenation():
    """The cached path's attention (a cache block and a new block, normalised after the value
    products) is softmax(scores) @ values over the concatenation, up to float32 rounding."""
    from starpo_jax.models.decoder import _MASKED, _joint_attention

    rng = np.random.default_rng(0)
    scores = [rng.normal(size=(2, 3, 5, n)).astype(np.float32) * 10 for n in (7, 1)]
    values = [rng.normal(size=(2, 3, n, 4)).astype(np.float32) for n in (7, 1)]
    scores[0][0, 0, 0] = _MASKED  # a row with every cached key masked: all its weight on the new key
    scores[1][0, 0, 1] = _MASKED  # and one that sees only cached keys
    whole = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1) @ jnp.concatenate(values, axis=-2)
    got = _joint_attention([jnp.asarray(s) for s in scores], [jnp.asarray(v) for v in values])
    # Convex combinations of the values, each weight and product rounded apart: a few ulps of the
    # largest value per slot summed over.
    slots = sum(v.shape[-2] for v in values)
    np.testing.assert_allclose(got, whole, rtol=0, atol=4 * slots * np.finfo(np.float32).eps * np.abs(values[0]).max())
    np.testing.assert_allclose(got[0, 0, 0], values[1][0, 0, 0], rtol=1e-6)
    assert not np.allclose(got[0, 0, 1], values[1][0, 0, 0])


@pytest.mark.parametrize("T", [1, 3])
def test_decode_size_scores_computed_keys_first_agree_and_stay_keys_first(T, monkeypatch):
    """On CPU a few queries per kv head (a decode step) take their scores as keys @ queries^T: the
    same attention up to the order of float32 sums, over a cached block and a new block, a fully
    masked cache row included; and the compiled program keeps the product keys-first (XLA would
    fold the transpose back into a queries-first product, the slow one, without the barrier)."""
    from starpo_jax.models import decoder

    B, H, kv, D, S = 2, 4, 2, 16, 24
    keys = jax.random.split(jax.random.key(T), 5)
    q = jax.random.normal(keys[0], (B, T, H, D))
    cached = [jax.random.normal(key, (B, kv, S, D)) for key in keys[1:3]]
    new = [jax.random.normal(key, (B, kv, T, D)) for key in keys[3:5]]
    allowed_cached = jnp.arange(S)[None, None, :] < jnp.array([0, 17])[:, None, None]  # row 0: empty cache
    allowed_cached = jnp.broadcast_to(allowed_cached, (B, T, S))
    allowed_new = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))

    def run(q, ck, cv, nk, nv):
        return decoder.attend(q, [(ck, cv, allowed_cached), (nk, nv, allowed_new)])

    assert decoder._keys_lead_the_product(T * H // kv)
    program = jax.jit(run).lower(q, *cached, *new).compile().as_text()
    assert program is not None
    keys_first = f"f32[{B},{kv},{S},{T * H // kv}]"
    assert any(keys_first in line and " dot(" in line or keys_first in line and "dot_general" in line
               for line in program.splitlines()), "the scores' product is not keys-first"
    got = run(q, *cached, *new)
    monkeypatch.setattr(decoder, "KEYS_LEAD_MAX_QUERIES", 0)
    assert not decoder._keys_lead_the_product(T * H // kv)
    want = run(q, *cached, *new)
    # scores are sums of 16 float32 products in another order: ~16 eps relative; outputs are O(1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("x_shape, w_shape", [
    ((2, 5, 8), (8, 12)),  # gate, up, down
    ((2, 5, 8), (8, 3, 4)),  # q, k, v: [embed, heads, kv]
    ((2, 5, 3, 4), (3, 4, 8)),  # o: [heads, kv, embed]
])
def test_weight_product_and_its_backward_equal_jaxs_own(x_shape, w_shape):
    """``weight_product`` writes its backward out (the weight's gradient as x^T g): the same
    products as jax's transpose of the einsum, in another order, so equal to float32 rounding."""
    from starpo_jax.models.decoder import weight_product

    kx, kw, kg = jax.random.split(jax.random.PRNGKey(0), 3)
    x, w = jax.random.normal(kx, x_shape), jax.random.normal(kw, w_shape)
    n_in = len(x_shape) - 2
    letters = "hijk"
    spec = f"bt{letters[:n_in]},{letters[:len(w_shape)]}->bt{letters[n_in:len(w_shape)]}"
    reference = lambda x, w: jnp.einsum(spec, x, w)  # noqa: E731
    weight = jax.random.normal(kg, reference(x, w).shape)
    got, want = (jax.value_and_grad(lambda x, w, f=f: (f(x, w) * weight).sum(), argnums=(0, 1))(x, w)
                 for f in (weight_product, reference))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_swiglu_and_its_backward_equal_jaxs_own():
    """``swiglu`` recomputes the sigmoid in its backward, in jax's order of operations: the same
    elementwise float32 maths, compiled in another program (a few ulps where XLA contracts a
    product and a sum differently)."""
    from starpo_jax.models.decoder import swiglu

    kg, ku, kw = jax.random.split(jax.random.PRNGKey(0), 3)
    gate, up = 4 * jax.random.normal(kg, (2, 5, 16)), jax.random.normal(ku, (2, 5, 16))
    weight = jax.random.normal(kw, (2, 5, 16))
    got, want = (jax.jit(jax.value_and_grad(lambda g, u, f=f: (f(g, u) * weight).sum(), argnums=(0, 1)))(gate, up)
                 for f in (swiglu, lambda g, u: jax.nn.silu(g) * u))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6 * float(jnp.max(jnp.abs(b))))


def test_swiglu_keeps_less_for_the_backward_of_a_layer_scan():
    """The compiled gradient of a scan over layers of x + swiglu(x a, x b) c keeps, per layer, gate,
    up and the product c's gradient needs; differentiated as written it keeps the sigmoid, its
    derivative and silu as well: at least two [rows, mlp] arrays a layer more."""
    from starpo_jax.models.decoder import swiglu

    layers, rows, embed, mlp = 4, 256, 16, 64

    def temp_bytes(activation) -> int:
        def loss(weights, x):
            def block(x, w):
                a, b, c = w
                return x + activation(x @ a, x @ b) @ c, None
            return jnp.sum(jax.lax.scan(block, x, weights)[0] ** 2)

        weights = tuple(jax.ShapeDtypeStruct((layers, *shape), jnp.float32)
                        for shape in ((embed, mlp), (embed, mlp), (mlp, embed)))
        compiled = jax.jit(jax.grad(loss)).lower(weights, jax.ShapeDtypeStruct((rows, embed), jnp.float32)).compile()
        stats = compiled.memory_analysis()
        assert stats is not None  # the CPU backend reports one
        return stats.temp_size_in_bytes

    saved = temp_bytes(lambda g, u: jax.nn.silu(g) * u) - temp_bytes(swiglu)
    assert saved >= 2 * layers * rows * mlp * 4


def test_rows_per_pass_takes_the_most_rows_whose_scores_fit(monkeypatch):
    """On CPU: every row while the float32 scores fit the budget, else the largest divisor of the
    rows that fits (one row at the least); other backends always every row."""
    from starpo_jax.models import decoder

    monkeypatch.setattr(decoder, "CPU_SCORES_BYTES_PER_PASS", 1000)
    per_row = 2 * 3 * 10 * 4  # kv heads × queries × keys × 4 bytes = 240: 4 rows fit in 1000 bytes
    assert decoder.rows_per_pass(4, 2, 3, 10) == 4
    assert decoder.rows_per_pass(12, 2, 3, 10) == 4
    assert decoder.rows_per_pass(9, 2, 3, 10) == 3  # 4 does not divide 9
    assert decoder.rows_per_pass(7, 2, 3, 10) == 1
    assert decoder.rows_per_pass(8, 2, 3, 100) == 1  # one row is over the budget: still one row a pass
    assert 4 * per_row <= 1000 < 5 * per_row
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert decoder.rows_per_pass(12, 2, 3, 100) == 12


@pytest.mark.parametrize("blocks", [1, 2])
def test_attention_in_row_passes_equals_one_pass(blocks, monkeypatch):
    """Scores over the budget, with in_row_passes, are computed a few rows per pass, in a loop: the same attention and
    the same gradient as every row at once (one sequence as in training, or a cache and new tokens
    with a mask shared by every row), up to the order of float32 sums."""
    from starpo_jax.models import decoder

    B, T, H, kv, D, S = 6, 5, 4, 2, 16, 9
    keys = jax.random.split(jax.random.key(blocks), 5)
    q = jax.random.normal(keys[0], (B, T, H, D))
    causal = jnp.tril(jnp.ones((T, T), bool))[None]  # [1, T, T]: broadcast over the rows
    new = (jax.random.normal(keys[1], (B, kv, T, D)), jax.random.normal(keys[2], (B, kv, T, D)), causal)
    visible = jnp.arange(S)[None, None, :] < jnp.array([0, 3, 9, 5, 1, 7])[:, None, None]  # row 0: empty cache
    cached = (jax.random.normal(keys[3], (B, kv, S, D)), jax.random.normal(keys[4], (B, kv, S, D)), visible)
    key_blocks = [new] if blocks == 1 else [cached, new]

    masks = [allowed for _, _, allowed in key_blocks]

    def loss(q, keys_values):
        return jnp.sum(jnp.sin(decoder.attend(q, [(k, v, m) for (k, v), m in zip(keys_values, masks)])))

    keys_values = [(k, v) for k, v, _ in key_blocks]
    whole, whole_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(q, keys_values)
    queries, slots = T * H // kv, sum(k.shape[2] for k, _, _ in key_blocks)
    monkeypatch.setattr(decoder, "CPU_SCORES_BYTES_PER_PASS", 2 * kv * queries * slots * 4)  # two rows' scores
    assert decoder.rows_per_pass(B, kv, queries, slots) == 2
    one_pass = str(jax.jit(lambda q, b: decoder.attend(q, b)).lower(q, key_blocks).compile().as_text())
    assert " while(" not in one_pass  # without in_row_passes: every row at once, whatever the budget
    in_passes_attend = functools.partial(decoder.attend, in_row_passes=True)
    program = str(jax.jit(in_passes_attend).lower(q, key_blocks).compile().as_text())
    assert " while(" in program  # a loop over the row passes
    monkeypatch.setattr(decoder, "attend", in_passes_attend)
    in_passes, passes_grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(q, keys_values)
    # sums of 16 float32 products and softmaxes over ≤ 14 keys in another order: ~16 eps relative
    np.testing.assert_allclose(in_passes, whole, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(passes_grad), jax.tree.leaves(whole_grad)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_the_rollouts_prompt_blocks_take_row_passes_and_the_update_and_decode_do_not(pair, monkeypatch):
    """``sampling.append`` (the rollout's prefill and appends) attends in row passes; the decode
    step, the update's forward over a shared prefix (``hidden_states_sharing_prefix``), the
    continuation of a prefix's keys and values (``hidden_states_after``) and full sequences do not."""
    from starpo_jax.models import cpu_kernels, decoder
    from starpo_jax.rollout import sampling

    config, _, model = pair
    seen: list[tuple[str, bool]] = []
    attend = decoder.attend

    def recorded(q, blocks, in_row_passes=False):
        seen.append((caller, in_row_passes))
        return attend(q, blocks, in_row_passes)

    monkeypatch.setattr(decoder, "attend", recorded)
    B, T, S = 2, 3, 8
    tokens = jnp.ones((B, T), jnp.int32)
    state = ModelState.split(model)
    cache = KVCache.init(config, B, S)
    caller = "append"
    unjitted_append = sampling.append.__wrapped__  # type: ignore[attr-defined]  # traced anew, not from jit's cache
    with cpu_kernels.xla_only():  # on a CPU both would take the kernel, which has no passes
        jax.eval_shape(lambda m, c: unjitted_append(m, c, tokens, jnp.full((B,), T)), state, cache)
        caller = "decode step"
        jax.eval_shape(lambda m, c: m.merge().extend(tokens[:, :1], jnp.ones((B,)), c), state, cache)
    caller = "hidden_states_after"
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    k = v = jnp.zeros((config.num_layers, B, config.num_kv_heads, S, config.head_dim))
    jax.eval_shape(lambda m: m.hidden_states_after(tokens, positions + S, k, v, jnp.full((B,), 4)), model)
    caller = "hidden_states_sharing_prefix"
    jax.eval_shape(lambda m: m.hidden_states_sharing_prefix(tokens[:1], jnp.full((1,), 4), jnp.zeros((B,), jnp.int32),
                                                            tokens, positions + 4), model)
    caller = "hidden_states"
    jax.eval_shape(lambda m: m.hidden_states(tokens, positions), model)
    assert set(seen) == {("append", True), ("decode step", False), ("hidden_states_after", False),
                         ("hidden_states_sharing_prefix", False), ("hidden_states", False)}
