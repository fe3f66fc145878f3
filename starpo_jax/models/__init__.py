"""The policy model: one decoder for Qwen2 / Qwen2.5 and Llama-family checkpoints, with presets."""

from starpo_jax.models.config import PRESETS, ModelConfig, preset
from starpo_jax.models.decoder import Decoder, KVCache, ModelState
from starpo_jax.models.hf_tensors import decoder_from_hf_tensors, decoder_to_hf_tensors

__all__ = [
    "PRESETS",
    "Decoder",
    "KVCache",
    "ModelConfig",
    "ModelState",
    "decoder_from_hf_tensors",
    "decoder_to_hf_tensors",
    "preset",
]
