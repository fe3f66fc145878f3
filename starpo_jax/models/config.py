"""Model configuration for the one decoder that covers Qwen2 / Qwen2.5 and Llama-family checkpoints.

The two families differ only in what a config says: Qwen2 has biases on the q/k/v projections,
Llama has none. Everything else (GQA, RoPE, SwiGLU, RMSNorm, tied or untied embeddings) is shared,
so one frozen dataclass describes both, and ``to_hf_config`` picks the architecture from
``qkv_bias``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

_DTYPES = ("float32", "bfloat16")
# What the backward pass keeps of each block (starpo_jax.models.decoder.REMAT_POLICIES): "none"
# keeps every intermediate; "layer" only each block's input, recomputing the block's forward in the
# backward pass; "dots" also the weight projections' outputs (more memory, less recompute).
REMAT_MODES = ("none", "layer", "dots")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    max_position_embeddings: int
    dtype: str = "float32"  # compute dtype of activations
    param_dtype: str = "float32"  # storage dtype of the weights
    remat: str = "layer"  # rematerialisation of full-sequence passes under jax.grad (REMAT_MODES)

    def __post_init__(self):
        for field in ("dtype", "param_dtype"):
            if getattr(self, field) not in _DTYPES:
                raise ValueError(f"ModelConfig.{field}={getattr(self, field)!r} is not supported; use one of {_DTYPES}.")
        if self.remat not in REMAT_MODES:
            raise ValueError(f"ModelConfig.remat={self.remat!r} is not supported; use one of {REMAT_MODES}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads} (GQA)."
            )
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even for rotary embeddings.")

    @property
    def model_type(self) -> str:
        """Qwen2 is the Llama block with q/k/v biases; the bias decides which HF architecture we are."""
        return "qwen2" if self.qkv_bias else "llama"

    @classmethod
    def from_hf_config(cls, d: dict[str, Any], **overrides: Any) -> "ModelConfig":
        """Read a transformers ``config.json`` dict (model_type qwen2 or llama).

        ``overrides`` replace fields afterwards, e.g. ``dtype="bfloat16"``. Features this decoder does not
        implement (RoPE scaling, sliding windows, o_proj/MLP biases) raise a ValueError instead of loading a
        model that would silently compute something else.
        """
        model_type = d.get("model_type")
        if model_type not in ("qwen2", "llama"):
            raise ValueError(
                f"Unsupported model_type {model_type!r} in the checkpoint config; this decoder supports 'qwen2' and 'llama'."
            )
        if d.get("hidden_act", "silu") != "silu":
            raise ValueError(f"Unsupported hidden_act {d['hidden_act']!r}; only 'silu' (SwiGLU) is implemented.")
        rope = d.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", "default")
        if d.get("rope_scaling") or rope_type != "default":
            raise ValueError(
                f"RoPE scaling ({d.get('rope_scaling') or rope_type!r}) is not implemented; only plain RoPE is supported."
            )
        if model_type == "qwen2" and d.get("use_sliding_window"):
            raise ValueError("Qwen2 sliding-window attention (use_sliding_window=true) is not implemented.")
        if model_type == "llama" and (d.get("attention_bias") or d.get("mlp_bias")):
            raise ValueError("Llama checkpoints with attention_bias or mlp_bias are not supported.")
        num_heads = d["num_attention_heads"]
        config = cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rope_theta=float(rope.get("rope_theta", d.get("rope_theta", 10000.0))),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", model_type == "qwen2")),
            qkv_bias=model_type == "qwen2",
            max_position_embeddings=d.get("max_position_embeddings", 32768),
        )
        return dataclasses.replace(config, **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """A ``config.json`` dict that transformers loads as Qwen2ForCausalLM or LlamaForCausalLM."""
        d = {
            "architectures": ["Qwen2ForCausalLM" if self.qkv_bias else "LlamaForCausalLM"],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_scaling": None,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": self.param_dtype,
            "dtype": self.param_dtype,
            "initializer_range": 0.02,
            "attention_dropout": 0.0,
            "use_cache": True,
        }
        if self.qkv_bias:
            d.update(use_sliding_window=False, sliding_window=None, max_window_layers=self.num_layers)
        else:
            d.update(attention_bias=False, mlp_bias=False)
        return d


def _qwen25(hidden, intermediate, layers, heads, kv_heads, *, vocab=151936, tied=True) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        qkv_bias=True,
        max_position_embeddings=32768,
    )


_QWEN25 = {
    "qwen2.5-0.5b": _qwen25(896, 4864, 24, 14, 2),
    "qwen2.5-1.5b": _qwen25(1536, 8960, 28, 12, 2),
    "qwen2.5-3b": _qwen25(2048, 11008, 36, 16, 2),
    "qwen2.5-7b": _qwen25(3584, 18944, 28, 28, 4, vocab=152064, tied=False),
}

PRESETS: dict[str, ModelConfig] = {
    **_QWEN25,
    **{f"{name}-instruct": config for name, config in _QWEN25.items()},  # same shapes as the base models
    "smollm2-135m-instruct": ModelConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_layers=30,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        rope_theta=100_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        qkv_bias=False,
        max_position_embeddings=8192,
    ),
    # Tiny configs for tests: GQA (2 query heads per kv head), both bias and embedding-tying variants.
    "tiny-qwen2": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        rope_theta=10_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        qkv_bias=True,
        max_position_embeddings=512,
    ),
    "tiny-llama": ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_layers=3,
        num_heads=4,
        num_kv_heads=1,
        head_dim=16,
        rope_theta=100_000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        qkv_bias=False,
        max_position_embeddings=512,
    ),
}


def preset(name: str, **overrides: Any) -> ModelConfig:
    """The named config, with ``overrides`` applied (e.g. ``preset("qwen2.5-0.5b", dtype="bfloat16")``)."""
    if name not in PRESETS:
        raise ValueError(f"Unknown model preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}.")
    return dataclasses.replace(PRESETS[name], **overrides)
