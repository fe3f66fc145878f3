"""Rematerialisation of the layer scan (``ModelConfig.remat``): the same gradients, less memory."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from configs import base
from starpo_jax.models import Decoder, ModelConfig, preset
from starpo_jax.runtime.experiment import ConfigError, model_compute


def next_token_loss(params, graphdef, tokens, positions, segments):
    logits = nnx.merge(graphdef, params)(tokens, positions, segments)
    logp = jax.nn.log_softmax(logits[:, :-1])
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


grad_fn = jax.jit(jax.value_and_grad(next_token_loss), static_argnums=1)


def split_model(name: str, remat: str, abstract: bool = False):
    config = dataclasses.replace(preset(name), remat=remat)
    make = lambda: Decoder(config, rngs=nnx.Rngs(0))  # noqa: E731
    return nnx.split(nnx.eval_shape(make) if abstract else make())


@pytest.mark.parametrize("name", ["tiny-qwen2", "tiny-llama"])
@pytest.mark.parametrize("remat", ["layer", "dots"])
def test_gradients_with_remat_equal_gradients_without(name, remat):
    B, T = 2, 24
    tokens = jax.random.randint(jax.random.PRNGKey(1), (B, T), 0, 256)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))
    segments = jnp.ones((B, T), jnp.int32).at[1, 15:].set(0)  # a padded row
    graphdef, params = split_model(name, "none")
    loss, grads = grad_fn(params, graphdef, tokens, positions, segments)
    graphdef_r, params_r = split_model(name, remat)  # the same weights (same seed)
    loss_r, grads_r = grad_fn(params_r, graphdef_r, tokens, positions, segments)
    # The recomputed forward is the same float32 maths on the same inputs; only XLA's fusion of it
    # into the backward program differs, which may reorder a reduction's additions: a few ulps per
    # reduction, carried through two or three layers. (On XLA:CPU today the results are bitwise equal.)
    assert jnp.allclose(loss_r, loss, rtol=1e-6)
    for path, g, g_r in zip(jax.tree.leaves_with_path(grads), jax.tree.leaves(grads), jax.tree.leaves(grads_r)):
        scale = float(jnp.max(jnp.abs(g)))
        assert float(jnp.max(jnp.abs(g_r - g))) <= 1e-5 * scale, jax.tree_util.keystr(path[0])


def test_dots_recomputes_only_attention_and_layer_recomputes_the_weight_products():
    """Counted in the gradient's program as jax lowers it: "dots" keeps every weight product's output
    (``decoder.weight_product``, found by its name) and recomputes only attention's two products
    (scores and values, which have batch dimensions); "layer" recomputes the weight products too."""
    tokens = jnp.zeros((2, 24), jnp.int32)

    def products(remat: str) -> int:
        graphdef, params = split_model("tiny-qwen2", remat)
        return grad_fn.lower(params, graphdef, tokens, tokens, tokens).as_text().count("stablehlo.dot_general")

    none, layer, dots = products("none"), products("layer"), products("dots")
    assert dots == none + 2
    assert layer > dots


def test_remat_lowers_the_compiled_gradients_memory():
    """XLA:CPU's working memory of the gradient of a 3-layer model on 2 rows of 256 tokens. Without
    remat the scan keeps every layer's float32 attention probabilities [rows, heads, T, T] for the
    backward pass; with "layer" it keeps one layer's at a time, so it saves at least the other
    layers' probabilities."""
    B, T = 2, 256
    c = preset("tiny-llama")
    tokens = jax.ShapeDtypeStruct((B, T), jnp.int32)

    def temp_bytes(remat: str) -> int:
        graphdef, params = split_model("tiny-llama", remat, abstract=True)
        compiled = grad_fn.lower(params, graphdef, tokens, tokens, tokens).compile()
        stats = compiled.memory_analysis()
        assert stats is not None  # the CPU backend reports one
        return stats.temp_size_in_bytes

    none, layer, dots = temp_bytes("none"), temp_bytes("layer"), temp_bytes("dots")
    one_layer_probabilities = B * c.num_heads * T * T * 4
    assert none - layer >= (c.num_layers - 1) * one_layer_probabilities
    assert layer <= dots < none  # "dots" keeps the projections' outputs as well


def test_remat_setting_is_checked():
    with pytest.raises(ValueError, match="remat"):
        dataclasses.replace(preset("tiny-qwen2"), remat="all")
    config = base.get_config()
    assert model_compute(config)["remat"] == "layer" == ModelConfig.remat  # on by default
    config.model.remat = "everything"
    with pytest.raises(ConfigError, match="model.remat = .* is not one of none, layer, dots"):
        model_compute(config)
