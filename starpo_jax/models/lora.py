"""LoRA adapters (Hu et al., 2021) on every linear layer of the decoder's blocks.

RAGEN's LoRA (ragen-reference.md §5): rank 64, alpha 64, peft's ``target_modules="all-linear"`` — the q/k/v/o and
gate/up/down projections of every block (peft leaves the output head out), no bias adapters. For a
weight W (ours ``[in..., out...]``, i.e. ``[in, out]`` once flattened) the adapter is a pair
A ``[in, r]``, B ``[r, out]`` and the adapted weight is ``W + (alpha / r) · A B``. A starts random
(peft's Kaiming-uniform bound ``1 / sqrt(in)``) and B at zero, so the adapted model starts as the
base.

Adapters are merged into the weights rather than run beside them. The sampler then decodes with
plain weights and pays nothing per token for the adapters (RAGEN merges before syncing to vLLM for
the same reason), and the training forward merges inside the loss, so gradients reach A and B
through the merge. A merge costs one ``[in, r] × [r, out]`` product per weight per forward, small
next to the tokens' own products. The reference policy is simply the base (adapters off).

Adapters are a plain pytree ``{weight name: {"a": [layers, in, r], "b": [layers, r, out]}}`` in
float32. ``save_adapter`` writes them as peft does (``adapter_model.safetensors`` +
``adapter_config.json``), to load with ``peft.PeftModel.from_pretrained`` on the base checkpoint.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from starpo_jax.models.config import ModelConfig
from starpo_jax.models.decoder import linear_layer_weights
from starpo_jax.models.loading import atomic_folder

Adapters = dict[str, dict[str, jax.Array]]


def init_adapters(config: ModelConfig, rank: int, key: jax.Array) -> Adapters:
    """Fresh adapters for every linear weight of every block: A uniform in ±1/sqrt(in), B zero."""
    if rank <= 0:
        raise ValueError(f"LoRA rank must be a positive integer, not {rank}.")
    weights = linear_layer_weights(config)
    adapters = {}
    for k, (name, (fan_in, fan_out, _)) in zip(jax.random.split(key, len(weights)), weights.items()):
        bound = 1.0 / math.sqrt(fan_in)
        adapters[name] = {
            "a": jax.random.uniform(k, (config.num_layers, fan_in, rank), jnp.float32, -bound, bound),
            "b": jnp.zeros((config.num_layers, rank, fan_out), jnp.float32),
        }
    return adapters


def merge(base: nnx.State, adapters: Adapters, scale: float) -> nnx.State:
    """The decoder's weights with ``scale · A B`` added to each adapted block weight."""

    def adapted(path, weight):
        keys = [getattr(k, "key", None) for k in path]
        name = keys[1] if keys[0] == "layers" else None
        if name not in adapters:
            return weight
        delta = jnp.einsum("lir,lro->lio", adapters[name]["a"], adapters[name]["b"])
        return weight + (scale * delta).reshape(weight.shape).astype(weight.dtype)

    return jax.tree_util.tree_map_with_path(adapted, base)


def to_peft_tensors(adapters: Adapters, config: ModelConfig) -> dict[str, np.ndarray]:
    """peft's tensor names and layouts: ``lora_A.weight`` [r, in] and ``lora_B.weight`` [out, r], so
    that ``lora_B @ lora_A`` is the Hugging Face ``[out, in]`` form of our ``A B``."""
    tensors = {}
    for name, (_, _, hf_name) in linear_layer_weights(config).items():
        a, b = (np.asarray(adapters[name][part], np.float32) for part in ("a", "b"))
        module = hf_name.removesuffix(".weight")
        for i in range(config.num_layers):
            prefix = f"base_model.model.model.layers.{i}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].T)
    return tensors


def save_adapter(adapters: Adapters, config: ModelConfig, alpha: float, folder: str | os.PathLike,
                 base_model: str = "") -> Path:
    """Write the adapters as a peft LoRA folder (atomically: a crash leaves no half-written folder)."""
    rank = int(next(iter(adapters.values()))["a"].shape[-1])
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": sorted(h.split(".")[-2] for _, _, h in linear_layer_weights(config).values()),
        "fan_in_fan_out": False,
        "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    with atomic_folder(folder) as staging:
        save_file(to_peft_tensors(adapters, config), staging / "adapter_model.safetensors", metadata={"format": "pt"})
        (staging / "adapter_config.json").write_text(json.dumps(peft_config, indent=2) + "\n")
    return Path(folder).expanduser().absolute()
