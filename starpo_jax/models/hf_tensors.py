"""Hugging Face tensors <-> ``Decoder``: transformers' ``Qwen2ForCausalLM`` / ``LlamaForCausalLM``
state_dict names and ``[out, in]`` layouts to the decoder's stacked ``[layers, in..., out...]``
weights (``decoder._top_weights`` / ``_layer_weights`` say where each goes) and back. Every model
source (``models.loading``: a folder, a GGUF file, the hub) arrives here as such tensors, so there
is one weight-mapping path for all of them."""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from starpo_jax.models.config import ModelConfig
from starpo_jax.models.decoder import Decoder, _layer_weights, _top_weights, _Weight


def _from_hf(array: np.ndarray, w: _Weight, name: str, dtype) -> np.ndarray:
    if array.shape != w.hf_shape:
        raise ValueError(
            f"Checkpoint tensor {name!r} has shape {tuple(array.shape)}, but the config expects {w.hf_shape}; "
            "check that the config matches the checkpoint."
        )
    return (array.T if w.linear else array).reshape(w.shape).astype(dtype)


def _to_hf(array: np.ndarray, w: _Weight) -> np.ndarray:
    if w.linear:
        return np.ascontiguousarray(array.reshape(w.hf_shape[::-1]).T)
    return np.ascontiguousarray(array.reshape(w.hf_shape))


def _ignorable(name: str, config: ModelConfig) -> bool:
    # Tied checkpoints may still list lm_head.weight (it is the embedding); old ones store RoPE tables.
    return (name == "lm_head.weight" and config.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")


def decoder_from_hf_tensors(config: ModelConfig, tensors: Mapping[str, np.ndarray]) -> Decoder:
    """Build a Decoder from tensors named and laid out as transformers' Qwen2/LlamaForCausalLM state_dict."""
    dtype = jnp.dtype(config.param_dtype)

    def read(name: str, w: _Weight) -> np.ndarray:
        if name not in tensors:
            raise ValueError(
                f"Checkpoint tensor {name!r} is missing; a {config.model_type} model with {config.num_layers} layers "
                f"and qkv_bias={config.qkv_bias} needs it."
            )
        return _from_hf(np.asarray(tensors[name]), w, name, dtype)

    top = {name: read(w.hf_name, w) for name, w in _top_weights(config).items()}
    layers = {
        name: np.stack([read(f"model.layers.{i}.{w.hf_name}", w) for i in range(config.num_layers)])
        for name, w in _layer_weights(config).items()
    }
    expected = {w.hf_name for w in _top_weights(config).values()} | {
        f"model.layers.{i}.{w.hf_name}" for w in _layer_weights(config).values() for i in range(config.num_layers)
    }
    unexpected = sorted(n for n in tensors if n not in expected and not _ignorable(n, config))
    if unexpected:
        raise ValueError(
            f"Checkpoint has tensors this config does not use ({', '.join(unexpected[:5])}"
            f"{', ...' if len(unexpected) > 5 else ''}); check num_layers, qkv_bias and tie_word_embeddings."
        )
    # Build the module abstractly (no random init of weights we are about to replace), then fill it.
    graphdef, state = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    values = jax.tree.map(jnp.asarray, {**top, "layers": layers})
    nnx.replace_by_pure_dict(state, values)
    return nnx.merge(graphdef, state)


def decoder_to_hf_tensors(model: Decoder) -> dict[str, np.ndarray]:
    """The inverse of ``decoder_from_hf_tensors``: HF names and layouts, float32 numpy arrays."""
    config = model.config
    out = {w.hf_name: _to_hf(np.asarray(getattr(model, name)[...], np.float32), w) for name, w in _top_weights(config).items()}
    for name, w in _layer_weights(config).items():
        stacked = np.asarray(getattr(model.layers, name)[...], np.float32)
        for i in range(config.num_layers):
            out[f"model.layers.{i}.{w.hf_name}"] = _to_hf(stacked[i], w)
    return out
