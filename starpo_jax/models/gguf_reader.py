"""Read a llama.cpp GGUF file as a Hugging Face checkpoint: an HF ``config.json`` dict and
float32 tensors under transformers' names and ``[out, in]`` layouts.

The ``gguf`` package parses the file (``GGUFReader``) and dequantises every type it knows
(``gguf.quants.dequantize``: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, the K-quants, the
IQ types, ...). What is left to us is the naming, and undoing the one change llama.cpp's converter
makes to the weights: for the ``llama`` architecture it reorders the rows of each Q/K head so that
rotary pairs are adjacent. ``undo_llama_rope_permutation`` is the inverse, exactly as in
transformers' GGUF integration (``LlamaTensorProcessor``). ``qwen2`` files are not permuted.

The HF config is rebuilt from the ``{arch}.*`` metadata keys the way transformers does
(``GGUF_CONFIG_MAPPING``), with two choices of our own: ``vocab_size`` is the row count of
``token_embd`` (the size the weights really have; llama.cpp pads the token list to it) and
``head_dim`` comes from ``attention.key_length`` when present, else ``embedding_length / heads``.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from starpo_jax.models.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# llama.cpp tensor names -> transformers names (see gguf.constants.TENSOR_NAMES).
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def read_gguf(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """The HF config dict and the dequantised float32 tensors (HF names) of a GGUF file."""
    path = Path(path)
    reader = open_gguf(path)
    hf_config = hf_config_from_gguf(reader, path)
    permute = hf_config["model_type"] == "llama"
    tensors = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, path)
        weights = dequantize_tensor(tensor, path)
        if permute and name.endswith(("q_proj.weight", "q_proj.bias")):
            weights = undo_llama_rope_permutation(weights, hf_config["num_attention_heads"])
        elif permute and name.endswith(("k_proj.weight", "k_proj.bias")):
            weights = undo_llama_rope_permutation(weights, hf_config["num_key_value_heads"])
        tensors[name] = weights
    return hf_config, tensors


def open_gguf(path: Path):
    """A ``gguf.GGUFReader`` over the file; a missing, truncated or foreign file is one clear error."""
    if not path.is_file():
        raise ModelLoadError(f"GGUF file {path} does not exist.")
    try:
        return gguf.GGUFReader(path)
    except Exception as err:  # the reader raises ValueError, IndexError, struct errors ... on bad bytes
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(err).__name__}: {err}); "
                             "it may be truncated or corrupt, download it again.") from err


def hf_config_from_gguf(reader, path: Path) -> dict:
    """transformers-style config.json dict from the GGUF metadata (``general.*`` and ``{arch}.*``)."""
    arch = _metadata(reader, path, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{path} holds a {arch!r} model; only {sorted(SUPPORTED_ARCHITECTURES)} "
                             "GGUF files are supported.")
    scaling = _metadata(reader, path, f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", "linear") or _metadata(reader, path, f"{arch}.rope.scaling.factor", 1.0) != 1.0:
        raise ModelLoadError(f"{path} uses RoPE scaling ({scaling!r}), which the decoder does not implement.")

    def meta(key, default=...):
        return _metadata(reader, path, f"{arch}.{key}", default)

    shapes = {t.name: tuple(int(n) for n in reversed(t.shape)) for t in reader.tensors}  # numpy order
    if "token_embd.weight" not in shapes:
        raise ModelLoadError(f"{path} has no token_embd.weight tensor, so it is not a complete model.")
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": shapes["token_embd.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta("attention.head_count_kv", heads),
        "head_dim": meta("attention.key_length", hidden // heads),
        "hidden_act": "silu",
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon"),
        "rope_theta": meta("rope.freq_base", 10000.0),
        "max_position_embeddings": meta("context_length"),
        "tie_word_embeddings": "output.weight" not in shapes,
        "attention_bias": "blk.0.attn_q.bias" in shapes,
    }
    for key in ("bos", "eos", "padding"):
        token_id = _metadata(reader, path, f"tokenizer.ggml.{key}_token_id", None)
        if token_id is not None:
            config[f"{key.replace('padding', 'pad')}_token_id"] = token_id
    return config


def hf_tensor_name(gguf_name: str, path: Path) -> str:
    """transformers' name for a llama.cpp tensor name, e.g. ``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``."""
    stem, _, suffix = gguf_name.rpartition(".")
    parts = stem.split(".")
    if len(parts) == 1 and stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise ModelLoadError(f"{path} has a tensor {gguf_name!r} that a Llama/Qwen2 decoder has no place for.")


def dequantize_tensor(tensor, path: Path) -> np.ndarray:
    """A GGUF tensor as a float32 numpy array in numpy (= torch) dimension order, copied out of the
    memory map so the file can be closed or replaced."""
    try:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as err:
        raise ModelLoadError(f"Tensor {tensor.name!r} in {path} has type {tensor.tensor_type.name}, which "
                             "gguf cannot dequantise; use a file quantised to F32/F16/BF16/Q4_0..Q8_0 or a "
                             "K-quant.") from err
    return np.array(weights, dtype=np.float32)


def undo_llama_rope_permutation(weights: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of llama.cpp's ``LlamaModel.permute`` on Q/K rows.

    HF's rotary embedding pairs row ``i`` of a head with row ``i + head_dim/2`` (rotate_half);
    llama.cpp's kernel pairs rows ``2i`` and ``2i+1``, so its converter interleaves the two halves
    of every head: ``[n_heads, 2, half] -> [n_heads, half, 2]``. We swap those axes back.
    """
    half = weights.shape[0] // n_heads // 2
    return weights.reshape(n_heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


def _metadata(reader, path: Path, key: str, default=...):
    """One metadata value (ints, floats, strings, lists decoded by ``ReaderField.contents``). A
    float32 value as the shortest decimal that rounds to it, as config.json writes it: the file's
    1e-05 is float32 9.99999974738e-06, which would make the model's config unequal to the preset's
    (and its compiled programs another cache entry) while computing with the same float32."""
    field = reader.get_field(key)
    if field is None:
        if default is ...:
            raise ModelLoadError(f"{path} lacks the metadata key {key!r}, so its model shape is unknown.")
        return default
    if field.types == [gguf.GGUFValueType.FLOAT32]:
        return float(str(np.float32(field.contents())))
    return field.contents()
