"""GGUF loading against transformers' own GGUF loader (the oracle): the bundled SmolLM2 file, and
tiny files written here the way llama.cpp's converter writes them, in every common tensor type."""

from __future__ import annotations

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from starpo_jax.models import bundled
from starpo_jax.models.config import ModelConfig, preset
from starpo_jax.models.decoder import ModelState
from starpo_jax.models.gguf_reader import read_gguf
from starpo_jax.models.hf_tensors import decoder_from_hf_tensors, decoder_to_hf_tensors
from starpo_jax.models.loading import ModelLoadError, load_model, save_model, source_dtype
from starpo_jax.rollout.sampling import generate

# On a shared 2-core machine torch's second intra-op thread mostly spins: one thread runs the
# reference model up to 15x faster.
torch.set_num_threads(1)

# hidden/intermediate are multiples of 256 so that K-quant blocks fit every row.
TINY = dict(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, rope_theta=10000.0, rms_norm_eps=1e-5, max_position_embeddings=128)
# Types gguf can both write and read, and types it only reads (written here as random blocks).
QUANTISABLE = [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]
READ_ONLY = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS]


def tiny_hf_model(model_type: str, tie: bool):
    """A random transformers model; norms and biases randomised too, so a misplaced tensor shows."""
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, tie_word_embeddings=tie, **TINY)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.05)
    return model


def llama_cpp_permute(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py ``LlamaModel.permute``: interleave each head's rotary halves."""
    return (weights.reshape(n_heads, 2, weights.shape[0] // n_heads // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def write_gguf(path, model, qtypes, seed=0, arch=None, overrides=None):
    """Convert ``model`` like llama.cpp: gguf's own name map, Q/K permuted for llama, 1-D tensors F32,
    the i-th matrix stored as ``qtypes[i % len(qtypes)]``. ``overrides`` {gguf name: array} replaces
    or adds tensors (their type follows the numpy dtype). Returns {gguf name: type}."""
    overrides = dict(overrides or {})
    config = model.config
    arch = arch or config.model_type
    rng = np.random.default_rng(seed)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN2,
                                        config.num_hidden_layers)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(TINY["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    types, n_matrices = {}, 0
    for hf_name, tensor in model.state_dict().items():
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = f"{name_map.get_name(base)}.{suffix}"
        weights = tensor.numpy()
        if arch == "llama" and ".attn_q." in name:
            weights = llama_cpp_permute(weights, config.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            weights = llama_cpp_permute(weights, config.num_key_value_heads)
        qtype = Q.F32
        if weights.ndim == 2:
            qtype, n_matrices = qtypes[n_matrices % len(qtypes)], n_matrices + 1
        if qtype in READ_ONLY:  # random blocks; bytes < 0x3C keep every fp16 scale finite and below 1
            data = rng.integers(0, 0x3C, gguf.quant_shape_to_byte_shape(weights.shape, qtype), dtype=np.uint8)
        else:
            data = gguf.quants.quantize(weights, qtype)
        if name in overrides:
            writer.add_tensor(name, overrides.pop(name))
            continue
        writer.add_tensor(name, data, raw_dtype=qtype)
        types[name] = qtype
    for name, data in overrides.items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return types


def transformers_gguf(path):
    """transformers' reading of a GGUF file: (model, {hf name: tensor}). This is what
    ``from_pretrained(gguf_file=...)`` does, minus its need for the ``accelerate`` package."""
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} and (not missing or config.tie_word_embeddings)
    return model, {name: t.numpy() for name, t in tensors.items()}


def assert_same_config(hf_config: dict, reference) -> None:
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings"):
        assert hf_config[key] == getattr(reference, key), key
    # GGUF stores floats as float32.
    assert np.float32(hf_config["rms_norm_eps"]) == np.float32(reference.rms_norm_eps)
    assert np.float32(hf_config["rope_theta"]) == np.float32(reference.rope_parameters["rope_theta"])
    default_head_dim = reference.hidden_size // reference.num_attention_heads
    assert hf_config["head_dim"] == getattr(reference, "head_dim", default_head_dim)


# --- tiny files -------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,tie", [("llama", False), ("qwen2", True)])
def test_f32_file_gives_back_the_original_weights_exactly(tmp_path, model_type, tie):
    model = tiny_hf_model(model_type, tie)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, model, [Q.F32])
    hf_config, tensors = read_gguf(path)
    expected = {k: v.numpy() for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert tensors.keys() == expected.keys()
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
    assert hf_config["model_type"] == model_type
    assert_same_config(hf_config, model.config)
    assert hf_config["rms_norm_eps"] == model.config.rms_norm_eps == 1e-5  # the decimal, not float32's 9.99999974738e-06
    assert hf_config["attention_bias"] == (model_type == "qwen2")


def test_source_dtype_is_the_files_float_type_or_bfloat16_when_quantised(tmp_path, mixed_type_file):
    for qtype, dtype in ((Q.F32, "float32"), (Q.F16, "float16")):
        write_gguf(tmp_path / f"{dtype}.gguf", tiny_hf_model("qwen2", True), [qtype])
        assert source_dtype(tmp_path / f"{dtype}.gguf") == dtype
    assert source_dtype(mixed_type_file[0]) == "bfloat16" == source_dtype(bundled.SMOLLM2_NAME)


@pytest.fixture(scope="module")
def mixed_type_file(tmp_path_factory):
    """A llama file whose matrices cycle through every common type (real files mix types too)."""
    path = tmp_path_factory.mktemp("gguf") / "mixed.gguf"
    model = tiny_hf_model("llama", tie=False)
    types = write_gguf(path, model, QUANTISABLE + READ_ONLY)
    return path, model, types


def test_every_common_type_matches_transformers_exactly(mixed_type_file):
    path, _, types = mixed_type_file
    assert set(types.values()) >= set(QUANTISABLE + READ_ONLY)
    hf_config, tensors = read_gguf(path)
    _, reference = transformers_gguf(path)
    assert tensors.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)
        assert tensors[name].dtype == np.float32


def test_quantised_weights_stay_close_to_the_originals(mixed_type_file):
    # Catches a wrong row order (Q/K permutation) that an equality test against another reader
    # sharing the same mistake would miss: misplaced rows give a relative error near 1.4.
    path, model, types = mixed_type_file
    _, tensors = read_gguf(path)
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, model.config.num_hidden_layers)
    checked = 0
    for hf_name, original in model.state_dict().items():
        base, suffix = hf_name.rsplit(".", 1)
        if types[f"{name_map.get_name(base)}.{suffix}"] in QUANTISABLE:
            original = original.numpy()
            error = np.linalg.norm(tensors[hf_name] - original) / np.linalg.norm(original)
            assert error < 0.2, (hf_name, error)
            checked += 1
    assert checked >= 8


def test_tiny_gguf_logits_match_transformers(mixed_type_file):
    path, _, _ = mixed_type_file
    hf_config, tensors = read_gguf(path)
    model = decoder_from_hf_tensors(ModelConfig.from_hf_config(hf_config), tensors)
    reference, _ = transformers_gguf(path)
    tokens = np.random.default_rng(1).integers(0, int(TINY["vocab_size"]), (2, 9))
    with torch.no_grad():
        expected = reference(torch.as_tensor(tokens)).logits.numpy()
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions))), expected, atol=1e-4, rtol=0)


# --- bad files --------------------------------------------------------------------------------


def test_missing_gguf_file_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_gguf(tmp_path / "nope.gguf")


@pytest.mark.parametrize("damage", ["truncated", "not_gguf"])
def test_damaged_gguf_file_is_a_clear_error(tmp_path, damage):
    path = tmp_path / "tiny.gguf"
    write_gguf(path, tiny_hf_model("qwen2", tie=True), [Q.Q8_0])
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"PK\x03\x04" + data[4:])
    with pytest.raises(ModelLoadError, match="not a readable GGUF file") as info:
        read_gguf(path)
    assert str(path) in str(info.value)


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = tmp_path / "gpt2.gguf"
    write_gguf(path, tiny_hf_model("qwen2", tie=True), [Q.F16], arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"'gpt2' model; only \['llama', 'qwen2'\]"):
        read_gguf(path)


def test_unsupported_tensor_type_names_the_tensor_and_type(tmp_path):
    path = tmp_path / "f64.gguf"
    write_gguf(path, tiny_hf_model("qwen2", tie=True), [Q.F16],
               overrides={"output_norm.weight": np.ones(TINY["hidden_size"], np.float64)})
    with pytest.raises(ModelLoadError, match=r"'output_norm.weight' .* has type F64"):
        read_gguf(path)


def test_unknown_tensor_is_a_clear_error(tmp_path):
    path = tmp_path / "rope_freqs.gguf"
    write_gguf(path, tiny_hf_model("llama", tie=True), [Q.F16],
               overrides={"rope_freqs.weight": np.ones(32, np.float32)})
    with pytest.raises(ModelLoadError, match="'rope_freqs.weight' that a Llama/Qwen2 decoder has no place for"):
        read_gguf(path)


def test_gguf_without_tokenizer_metadata_is_a_clear_error(tmp_path):
    path = tmp_path / "no_tokenizer.gguf"
    write_gguf(path, tiny_hf_model("llama", tie=True), [Q.Q8_0])
    with pytest.raises(ModelLoadError, match="Could not load a tokenizer from .*no_tokenizer.gguf"):
        load_model(path)


# --- the bundled SmolLM2 file -----------------------------------------------------------------

CHAT = [{"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Write a short poem about the sea."}]


@pytest.fixture(scope="module")
def smollm2():
    return load_model(bundled.SMOLLM2_NAME)


@pytest.fixture(scope="module")
def smollm2_reference():
    return transformers_gguf(bundled.smollm2_gguf_path())


def prompt_tokens(tokenizer, kind: str) -> np.ndarray:
    if kind == "chat":
        text = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    else:
        text = "The capital of France is"
    return np.asarray([tokenizer(text)["input_ids"]])


def test_bundled_model_has_the_presets_config(smollm2):
    """The memory planner plans the bundled model from its preset; with an equal config the loaded
    model's structure is the planned one, so a run calls the programs its memory check compiled."""
    model, _ = smollm2
    c = model.config
    assert c == preset("smollm2-135m-instruct", dtype=c.dtype, param_dtype=c.param_dtype, remat=c.remat)


def test_bundled_model_holds_exactly_the_tensors_transformers_reads(smollm2, smollm2_reference):
    model, _ = smollm2
    reference_model, reference = smollm2_reference
    assert_same_config(model.config.to_hf_config(), reference_model.config)
    tensors = decoder_to_hf_tensors(model)
    assert tensors.keys() == reference.keys()
    for name, value in reference.items():
        np.testing.assert_array_equal(tensors[name], value, err_msg=name)


@pytest.mark.parametrize("kind", ["plain", "chat"])
def test_bundled_logits_match_transformers(smollm2, smollm2_reference, kind):
    (model, tokenizer), (reference, _) = smollm2, smollm2_reference
    tokens = prompt_tokens(tokenizer, kind)
    assert kind == "plain" or tokens.shape[1] > 20
    positions = np.arange(tokens.shape[1])[None]
    with torch.no_grad():
        expected = reference(torch.as_tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(np.asarray(model(tokens, positions)), expected, atol=1e-3, rtol=0)


def test_bundled_greedy_generation_matches_transformers(smollm2, smollm2_reference):
    (model, tokenizer), (reference, _) = smollm2, smollm2_reference
    tokens = prompt_tokens(tokenizer, "chat")
    out = generate(ModelState.split(model), tokens, np.asarray([tokens.shape[1]]), jax.random.key(0),
                   max_new_tokens=32, temperature=0.0, stop_tokens=np.asarray([tokenizer.eos_token_id]))
    ours = np.asarray(out.tokens[0, : int(out.lengths[0])]).tolist()
    with torch.no_grad():
        theirs = reference.generate(torch.as_tensor(tokens), max_new_tokens=32, do_sample=False,
                                    eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    assert len(ours) == 32  # the poem runs past the budget, so all 32 steps are compared
    assert ours == theirs[0, tokens.shape[1]:].tolist()


def test_bundled_model_saves_a_folder_transformers_loads(tmp_path, smollm2, smollm2_reference):
    (model, tokenizer), (reference, _) = smollm2, smollm2_reference
    folder = save_model(model, tokenizer, tmp_path / "smollm2")
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reloaded_tokenizer = AutoTokenizer.from_pretrained(folder)
    tokens = prompt_tokens(tokenizer, "chat")
    with torch.no_grad():
        np.testing.assert_allclose(reloaded(torch.as_tensor(tokens)).logits.numpy(),
                                   reference(torch.as_tensor(tokens)).logits.numpy(), atol=1e-5, rtol=0)
    assert np.array_equal(prompt_tokens(reloaded_tokenizer, "chat"), tokens)
    assert reloaded_tokenizer.eos_token_id == tokenizer.eos_token_id == reloaded.config.eos_token_id
