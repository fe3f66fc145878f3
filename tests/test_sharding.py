"""The same training step on one device, data parallel over two, and tensor parallel over two gives
the same result.

Multi-device runs happen in a subprocess with two simulated CPU devices (XLA's host platform device
count must be set before JAX starts). Keep simulated devices <= CPU cores: XLA's CPU collectives
can deadlock when more devices than pool threads wait at a rendezvous (seen with 4 on 2 cores)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx

from starpo_jax import sharding
from starpo_jax.models import Decoder, ModelState, preset

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import envs_jax
from starpo_jax import bundled, sharding
from starpo_jax.models import Decoder, ModelState, preset
from starpo_jax.rollout import RolloutPlan, TagPlan, build_tables, stop_tokens_for
from starpo_jax.train import Hyperparams, TrainSettings, init_train_state, make_train_step

assert len(jax.devices()) == 2, jax.devices()
tok = bundled.smollm2_tokenizer()
plan = RolloutPlan(tags=(TagPlan("FrozenLake", envs_jax.make("FrozenLake"), 2, 4),), group_size=2,
                   max_turn=2, max_actions_per_turn=2, response_length=6, max_len=512, enable_think=False)
tables = build_tables(tok, plan)
plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(tok, tables))
config = dataclasses.replace(preset("tiny-llama"), vocab_size=len(tok), num_kv_heads=2)
model = ModelState.split(Decoder(config, rngs=nnx.Rngs(0)))
settings = TrainSettings(adv_estimator="gae", kept_groups=2, ppo_mini_batch_size=4, micro_batch_size=2,
                         logprob_chunk=32, use_kl_loss=True)
hyper = Hyperparams.create(actor_lr=1e-3, critic_lr=1e-3, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
                           entropy_coeff=0.001, kl_loss_coef=0.01, kl_in_reward_coef=0.0, filter_ratio=1.0, gamma=1.0,
                           lam=1.0, high_level_gamma=0.95)

def one_step(mesh):
    with sharding.use_mesh(mesh):
        state = sharding.shard(init_train_state(settings, model, jax.random.PRNGKey(0)), mesh)
        step = jax.jit(make_train_step(settings, model.graphdef, plan))
        new, metrics = step(state, tables, hyper, jax.random.PRNGKey(1))
        q = new.actor["layers"]["q_proj"][...]
        return new, {k: float(v) for k, v in metrics.items()}, len(q.sharding.device_set), q.addressable_shards[0].data.shape

start = init_train_state(settings, model, jax.random.PRNGKey(0))
def largest_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

out = {}
for name, shape in (("single", (1, 1)), ("data", (2, 1)), ("model", (1, 2))):
    state, metrics, devices, q_shard = one_step(sharding.make_mesh(*shape))
    out[name] = {"metrics": metrics, "devices": devices, "q_shard": list(q_shard), "state": state}
single = out["single"].pop("state")
out["update"] = largest_diff(single.actor, start.actor)
for name in ("data", "model"):
    out[name]["param_diff"] = largest_diff(out[name].pop("state"), single)
json.dump(out, sys.stdout)
"""


def test_rules_name_every_weight_axis():
    """Each weight's spec follows the rules table: heads, MLP and vocabulary on ``model``."""
    params = ModelState.split(Decoder(preset("tiny-qwen2"), rngs=nnx.Rngs(0))).params
    specs = jax.tree.map(lambda s: tuple(s.spec), sharding.shardings(params, sharding.make_mesh(1, 1)))
    assert specs["layers"]["q_proj"].value == (None, None, "model", None)  # layers, embed, heads, kv
    assert specs["layers"]["k_proj"].value == (None, None, None, None)  # kv heads stay whole
    assert specs["layers"]["down_proj"].value == (None, "model", None)  # layers, mlp, embed
    assert specs["embed"].value == ("model", None)  # vocab, embed
    assert specs["final_norm"].value == (None,)


class _TwoWayData:
    """Stands in for a mesh with data=2: ``check_batch`` reads only the axis sizes."""

    shape = {"data": 2, "model": 1}


def test_mesh_errors_name_what_to_change():
    with pytest.raises(ValueError, match="needs 2 devices"):
        sharding.make_mesh(2, 1)  # the test process has one CPU device
    with pytest.raises(ValueError, match="mesh.model=3"):
        sharding.make_mesh(-1, 3)
    sharding.check_batch(_TwoWayData(), rollout_batch=8, micro_batch_size=2)
    with pytest.raises(ValueError, match=r"micro_batch_size \(3\) must be a multiple of mesh.data \(2\)"):
        sharding.check_batch(_TwoWayData(), rollout_batch=8, micro_batch_size=3)


@pytest.fixture(scope="module")
def steps_on_meshes():
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("axis", ["data", "model"])
def test_step_on_two_devices_matches_one_device(steps_on_meshes, axis):
    out = steps_on_meshes
    assert out["single"]["devices"] == 1 and out[axis]["devices"] == 2
    # Tensor parallel splits the 4 query heads of q_proj [layers, embed, heads, kv]; data parallel keeps them whole.
    assert out[axis]["q_shard"][2] == (2 if axis == "model" else 4)
    for key in ("train/reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "actor/kl_loss",
                "train/response_length", "rollout/old_log_prob"):
        assert out[axis]["metrics"][key] == pytest.approx(out["single"]["metrics"][key], rel=1e-4, abs=1e-5), key
    # Adam's first step moves each weight by about lr; only the reduction order differs between meshes.
    assert out["update"] > 5e-4 and out[axis]["param_diff"] < 0.05 * out["update"]
