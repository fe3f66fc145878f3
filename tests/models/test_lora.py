"""LoRA adapters: the merged model starts as the base, the merge is W + (alpha/r)·A·B in every
linear layer, peft's tensor layout reproduces the same weights, and gradients reach the adapters."""

import json
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from starpo_jax.models import Decoder, ModelState, decoder_to_hf_tensors, lora, preset
from starpo_jax.models.decoder import linear_layer_weights

RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def model():
    return ModelState.split(Decoder(preset("tiny-qwen2"), rngs=nnx.Rngs(0)))


def _random_adapters(config, key):
    """Adapters with B non-zero too, so the merge has something to add."""
    adapters = lora.init_adapters(config, RANK, key)
    return jax.tree.map(lambda x: x + 0.05 * jax.random.normal(key, x.shape), adapters)


def _tokens(config):
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 6), 0, config.vocab_size)
    return tokens, jnp.broadcast_to(jnp.arange(6), (2, 6))


def test_adapters_cover_every_linear_layer_and_start_at_the_base(model):
    config = model.merge().config
    adapters = lora.init_adapters(config, RANK, jax.random.PRNGKey(0))
    assert set(adapters) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    for name, (fan_in, fan_out, _) in linear_layer_weights(config).items():
        assert adapters[name]["a"].shape == (config.num_layers, fan_in, RANK)
        assert adapters[name]["b"].shape == (config.num_layers, RANK, fan_out)
        assert float(jnp.abs(adapters[name]["a"]).max()) > 0
    merged = lora.merge(model.params, adapters, ALPHA / RANK)
    for a, b in zip(jax.tree.leaves(merged), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(a, b)


def test_merge_adds_scaled_product_in_peft_layout(model):
    """Our merged weights, in Hugging Face layout, equal base + (alpha/r) · lora_B @ lora_A."""
    config = model.merge().config
    adapters = _random_adapters(config, jax.random.PRNGKey(2))
    merged = nnx.merge(model.graphdef, lora.merge(model.params, adapters, ALPHA / RANK))
    base_hf = decoder_to_hf_tensors(model.merge())
    merged_hf = decoder_to_hf_tensors(merged)
    peft = lora.to_peft_tensors(adapters, config)
    assert len(peft) == 2 * 7 * config.num_layers
    for name in base_hf:
        prefix = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{prefix}.lora_A.weight" in peft:
            delta = (ALPHA / RANK) * peft[f"{prefix}.lora_B.weight"] @ peft[f"{prefix}.lora_A.weight"]
            assert np.abs(delta).max() > 1e-4
            np.testing.assert_allclose(merged_hf[name], base_hf[name] + delta, rtol=1e-5, atol=1e-6)
        else:  # norms, biases, embeddings: untouched
            np.testing.assert_array_equal(merged_hf[name], base_hf[name])


def test_gradients_reach_both_adapter_matrices(model):
    config = model.merge().config
    adapters = _random_adapters(config, jax.random.PRNGKey(3))
    tokens, positions = _tokens(config)

    def loss(adapters):
        logits = nnx.merge(model.graphdef, lora.merge(model.params, adapters, ALPHA / RANK))(tokens, positions)
        return jax.nn.log_softmax(logits)[..., 0].mean()

    grads = jax.grad(loss)(adapters)
    for name in adapters:
        assert float(jnp.abs(grads[name]["a"]).max()) > 0, name
        assert float(jnp.abs(grads[name]["b"]).max()) > 0, name
    # The gradient agrees with a finite difference along B of one layer.
    eps = 1e-3
    direction = jax.tree.map(jnp.zeros_like, adapters)
    direction["v_proj"]["b"] = direction["v_proj"]["b"].at[0].set(1.0)
    moved = jax.tree.map(lambda x, d: x + eps * d, adapters, direction)
    back = jax.tree.map(lambda x, d: x - eps * d, adapters, direction)
    numeric = (loss(moved) - loss(back)) / (2 * eps)
    analytic = jnp.sum(grads["v_proj"]["b"][0])
    np.testing.assert_allclose(numeric, analytic, rtol=2e-2, atol=1e-5)


def test_save_adapter_writes_a_peft_folder(model, tmp_path):
    from safetensors.numpy import load_file

    config = model.merge().config
    adapters = _random_adapters(config, jax.random.PRNGKey(4))
    folder = lora.save_adapter(adapters, config, ALPHA, tmp_path / "lora_adapter", base_model="some/base")
    peft_config = json.loads((folder / "adapter_config.json").read_text())
    assert (peft_config["r"], peft_config["lora_alpha"], peft_config["peft_type"]) == (RANK, ALPHA, "LORA")
    assert peft_config["target_modules"] == sorted(adapters)
    tensors = load_file(folder / "adapter_model.safetensors")
    expected = lora.to_peft_tensors(adapters, config)
    assert set(tensors) == set(expected)
    for name, value in expected.items():
        np.testing.assert_array_equal(tensors[name], value)
    assert [p.name for p in tmp_path.iterdir()] == ["lora_adapter"]  # no staging folder left behind
    assert peft_config["base_model_name_or_path"] == "some/base"


def test_saved_adapter_honours_the_umask(model, tmp_path):
    config = model.merge().config
    old = os.umask(0o022)
    try:
        folder = lora.save_adapter(_random_adapters(config, jax.random.PRNGKey(4)), config, ALPHA, tmp_path / "a")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (folder, *folder.iterdir())}
    assert modes == {"a": 0o755, "adapter_config.json": 0o644, "adapter_model.safetensors": 0o644}


def test_rank_must_be_positive(model):
    with pytest.raises(ValueError, match="rank"):
        lora.init_adapters(model.merge().config, 0, jax.random.PRNGKey(0))
