"""The same training step on one device and on data-parallel, FSDP, tensor-parallel and mixed meshes
gives the same result (its update with the drivers' layout, each row's first prompt found in the
program: ``UpdateLayout.across_groups``).

Multi-device runs happen in a subprocess with simulated CPU devices (XLA's host platform device
count must be set before JAX starts), with a thread pool larger than the cores
(``helpers.simulated_devices``: XLA:CPU's collectives each hold a pool thread until every device
arrives, so with too few threads two devices can wait at different collectives for each other).

Tolerance: every mesh runs the same float32 math with the sums of a matmul, a mean or a gradient
split into partial sums that are added in another order; each reordering changes a result by a
few ulps (~1e-7 relative) per term, far below the 1e-4 relative (1e-5 absolute) the metrics are
held to. Weights after one step: Adam's first step moves each weight by lr · m / (sqrt(v) + eps)
≈ ±lr whatever the gradient's scale, so a reordered gradient moves a weight differently only where
its gradient is within rounding of 0; the largest weight difference must stay under 5 % of the
largest move (lr = 1e-3)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from helpers import simulated_devices
from starpo_jax.models import Decoder, ModelState, preset
from starpo_jax.runtime import sharding

REPO = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import dataclasses, json, sys
import jax, jax.numpy as jnp, numpy as np
from flax import nnx
import envs_jax
from starpo_jax.models.loading import smollm2_tokenizer
from starpo_jax.runtime import sharding
from starpo_jax.models import Decoder, ModelState, preset
from starpo_jax.rollout.multi_turn import RolloutPlan, TagPlan, build_tables, stop_tokens_for
from starpo_jax.rollout.sampling import sampling_policy
from starpo_jax.forward import update_layout
from starpo_jax.train import Hyperparams, TrainSettings, init_train_state, make_train_step

meshes = json.loads(sys.argv[1])
assert len(jax.devices()) == max(np.prod(shape) for shape in meshes.values()), jax.devices()
tok = smollm2_tokenizer()
plan = RolloutPlan(tags=(TagPlan("FrozenLake", envs_jax.make("FrozenLake"), 2, 4),), group_size=2,
                   max_turn=2, max_actions_per_turn=2, response_length=6, max_len=512, enable_think=False)
tables = build_tables(tok, plan)
plan = dataclasses.replace(plan, stop_tokens=stop_tokens_for(tok, tables))
config = dataclasses.replace(preset("tiny-llama"), vocab_size=len(tok), num_kv_heads=2)
model = ModelState.split(Decoder(config, rngs=nnx.Rngs(0)))
# Micro-batches of 4 rows split over up to 4 row shards (data × fsdp).
settings = TrainSettings(adv_estimator="gae", kept_groups=2, ppo_mini_batch_size=4, micro_batch_size=4,
                         logprob_chunk=32, use_kl_loss=True)
hyper = Hyperparams.create(actor_lr=1e-3, critic_lr=1e-3, kl_loss_coef=0.01, filter_ratio=1.0)  # the rest: defaults

def one_step(mesh):
    with sharding.use_mesh(mesh):
        state = sharding.shard(init_train_state(settings, model, jax.random.PRNGKey(0)), mesh)
        step = make_train_step(settings, model.graphdef, plan)
        traj = jax.jit(step.collect)(state, tables, jax.random.PRNGKey(1))
        # The drivers' layout, the rows searched for their first prompts in the program (across_groups).
        layout = update_layout(traj, plan, settings.micro_batch_size)._replace(across_groups=True)
        new, metrics = jax.jit(step.learn, static_argnums=3)(state, traj, hyper, layout)
        q = new.actor["layers"]["q_proj"][...]
        # The rollout's copy of the policy: gathered over fsdp, still split over model.
        decode = jax.jit(lambda s: sampling_policy(model.graphdef, s.actor).params)(new)["layers"]["q_proj"][...]
        return (new, {k: float(v) for k, v in metrics.items()}, len(q.sharding.device_set),
                q.addressable_shards[0].data.shape, decode.addressable_shards[0].data.shape)

start = init_train_state(settings, model, jax.random.PRNGKey(0))
def largest_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y)))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))

out = {}
for name, shape in meshes.items():
    state, metrics, devices, q_shard, decode_shard = one_step(sharding.make_mesh(*shape))
    out[name] = {"metrics": metrics, "devices": devices, "q_shard": list(q_shard), "decode_shard": list(decode_shard),
                 "state": state}
single = out["single"].pop("state")
out["update"] = largest_diff(single.actor, start.actor)
for name in meshes:
    if name != "single":
        out[name]["param_diff"] = largest_diff(out[name].pop("state"), single)
json.dump(out, sys.stdout)
"""


MESH_AXES = ("data", "fsdp", "model")


def test_rules_name_every_weight_axis():
    """Each weight's spec follows the rules table: heads, MLP and vocabulary on ``model``, the
    embedding dimension on ``fsdp``; the rollout's layout keeps the weights whole over ``fsdp``."""
    params = ModelState.split(Decoder(preset("tiny-qwen2"), rngs=nnx.Rngs(0))).params
    mesh = AbstractMesh((1, 2, 2), MESH_AXES)
    specs = jax.tree.map(lambda s: tuple(s.spec), sharding.shardings(params, mesh))
    assert specs["layers"]["q_proj"].value == (None, "fsdp", "model", None)  # layers, embed, heads, kv
    assert specs["layers"]["k_proj"].value == (None, "fsdp", None, None)  # kv heads stay whole
    assert specs["layers"]["down_proj"].value == (None, "model", "fsdp")  # layers, mlp, embed
    assert specs["embed"].value == ("model", "fsdp")  # vocab, embed
    assert specs["final_norm"].value == ("fsdp",)
    decode = jax.tree.map(lambda s: tuple(s.spec), sharding.shardings(params, mesh, sharding.DECODE_RULES))
    assert decode["layers"]["q_proj"].value == (None, None, "model", None)
    assert decode["embed"].value == ("model", None)
    # a mesh axis of size 1 splits nothing and is left out: one spelling for one layout
    fsdp_only = jax.tree.map(lambda s: tuple(s.spec), sharding.shardings(params, AbstractMesh((2, 2, 1), MESH_AXES)))
    assert fsdp_only["embed"].value == (None, "fsdp")
    assert fsdp_only["layers"]["q_proj"].value == (None, "fsdp", None, None)


# The rollout's copy of an FSDP policy, cast then gathered over 2 devices: the compiled program's
# gathers must move the cast dtype. float16 stands in for bfloat16, which XLA:CPU alone cannot
# gather (its float-normalization pass widens a bfloat16 all-gather to float32 after partitioning).
GATHER_SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp
from flax import nnx
from starpo_jax.runtime import sharding
from starpo_jax.models import Decoder, ModelState, preset
params = ModelState.split(Decoder(preset("tiny-qwen2"), rngs=nnx.Rngs(0))).params
mesh = sharding.make_mesh(1, 2, 1)
with sharding.use_mesh(mesh):
    params = sharding.shard(params, mesh)
    gather = jax.jit(lambda p: sharding.for_decoding(jax.tree.map(lambda x: x.astype(jnp.float16), p)))
    compiled = gather.lower(params).compile()
    q = gather(params)["layers"]["q_proj"][...]
hlo = compiled.as_text()
print(json.dumps({"gathered": re.findall(r"= (\w+)\[[^=]*? all-gather\(", hlo), "q_shard": list(q.addressable_shards[0].data.shape),
                  "q_equal": bool((q == params["layers"]["q_proj"][...].astype(jnp.float16)).all())}))
"""


def test_rollout_gathers_the_cast_policy():
    """Cast, then gather (half the bytes of float32 weights moved, no float32 copy of the policy);
    given only the gathered layout, XLA's partitioner gathers the float32 weights and casts after."""
    env = {**os.environ, **simulated_devices(2)}
    proc = subprocess.run([sys.executable, "-c", GATHER_SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["gathered"] and set(out["gathered"]) == {"f16"}, out["gathered"]
    assert out["q_shard"][1] == 64 and out["q_equal"]  # whole over fsdp, the cast values


# One decode step and one prefill block of a data-parallel rollout (rows split over 2 devices, the
# policy whole on each), compiled from abstract shapes; the collectives of each partitioned program.
LOCAL_ROWS_SCRIPT = r"""
import json, re
import jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P
from starpo_jax.rollout import sampling
from starpo_jax.runtime import sharding
from starpo_jax.models import Decoder, ModelState, decoder, preset
config, B, T = preset("tiny-llama"), 4, 8
mesh = sharding.make_mesh(2, 1, 1)
graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
def placed(tree, spec):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec(x))), tree)
by_rows = lambda x: P() if x.ndim == 0 else P(sharding.ROWS)  # batch first; scalars replicated
with sharding.use_mesh(mesh):
    model = ModelState(graphdef, placed(params, lambda x: P()))
    # The cache is one buffer per layer [B, kv_heads, 32, d], rows split.
    cache = placed(sampling.init_cache(config, B, 32), by_rows)
    first = (jnp.zeros((B,), jnp.int32), jnp.zeros((B,)))  # the first sampled tokens, log-probs
    hidden = jnp.zeros((B, config.hidden_size))
    state = jax.eval_shape(lambda c: sampling.initial_decode_state(c, first, hidden, 4, None), cache)
    state = placed(state, by_rows)
    weights = placed(jax.eval_shape(lambda m: m.merge().layers.per_layer(), model), lambda x: P())
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=NamedSharding(mesh, P()))
    step = lambda m, w, s, k: sampling.decode_step(m.merge(), w, s, k, 1.0, 0, 1.0, jnp.full((B, 1), -1), 0)
    decode = jax.jit(step, donate_argnums=2).lower(model, weights, state, key).compile().as_text()
    tokens = placed(jax.ShapeDtypeStruct((B, T), jnp.int32), by_rows)
    num_new = placed(jax.ShapeDtypeStruct((B,), jnp.int32), by_rows)
    extend = lambda m, c, t, n: m.merge().extend(t, n, c)[1]
    prefill = jax.jit(extend, donate_argnums=1).lower(model, cache, tokens, num_new).compile().as_text()
    # A prompt block appended as the rollout appends it (sampling.append), its attention in passes
    # of one row each (a budget below one row's scores): each pass takes a row of each device.
    decoder.CPU_SCORES_BYTES_PER_PASS = 1
    appended = lambda m, c, t, n: sampling.append(m, c, t, n, windowed=False)[0]
    passes = jax.jit(appended, donate_argnums=1).lower(model, cache, tokens, num_new).compile().as_text()
collective = r"= ([^=]+?) (all-gather|all-to-all|all-reduce|reduce-scatter|collective-permute)(?:-start)?\("
local = f"{B // 2},{config.num_kv_heads},32,{config.head_dim}]"  # a device's half of a layer's cache
print(json.dumps({"decode": re.findall(collective, decode), "prefill": re.findall(collective, prefill),
                  "append_in_row_passes": re.findall(collective, passes), "loops": passes.count(" while("),
                  "partitioned": f"[{local}" in decode and f"[{local}" in prefill}))
"""


def test_data_parallel_decoding_stays_on_each_device():
    """Each device holds its rows' cache and the whole policy, so neither a decoded token nor a
    prefill block (attending in row passes or not) needs any communication beyond the append's one
    scalar (its chunk count). A KV-cache write that scatters by (row, slot) pairs made
    the partitioner all-gather every row's new keys, values and slots to every device."""
    env = {**os.environ, **simulated_devices(2)}
    proc = subprocess.run([sys.executable, "-c", LOCAL_ROWS_SCRIPT], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    loops = out.pop("loops")
    # The append agrees on one scalar, how many chunks hold a real token of some row (sampling.append)
    assert out == {"decode": [], "prefill": [], "append_in_row_passes": [["s32[]", "all-reduce"]],
                   "partitioned": True}, out
    assert loops >= 2, loops  # the append's loop over chunks, and the row passes inside it


def test_mesh_errors_name_what_to_change():
    with pytest.raises(ValueError, match="needs 2 devices"):
        sharding.make_mesh(2, 1, 1)  # the test process has one CPU device
    with pytest.raises(ValueError, match="mesh.model=3 must divide the 1 devices"):
        sharding.make_mesh(-1, 1, 3)
    with pytest.raises(ValueError, match="Only one of .* may be -1"):
        sharding.make_mesh(-1, -1, 1)
    with pytest.raises(ValueError, match="mesh.fsdp=0 must be a positive size"):
        sharding.make_mesh(-1, 0, 1)
    assert dict(sharding.make_mesh(1, -1, 1).shape) == {"data": 1, "fsdp": 1, "model": 1}
    two_by_two = AbstractMesh((2, 2, 1), MESH_AXES)  # data=2, fsdp=2 without the devices: only sizes are read
    sharding.check_batch(two_by_two, rollout_batch=8, micro_batch_size=4)
    with pytest.raises(ValueError, match=r"micro_batch_size \(2\) must be a multiple of mesh.data × mesh.fsdp \(2 × 2 = 4\)"):
        sharding.check_batch(two_by_two, rollout_batch=8, micro_batch_size=2)


def _steps_on_meshes(meshes: dict[str, tuple[int, int, int]]) -> dict:
    devices = max(d * f * m for d, f, m in meshes.values())
    env = {**os.environ, **simulated_devices(devices)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(meshes)], cwd=REPO, capture_output=True,
                          text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# (data, fsdp, model) sizes of each mesh.
TWO_DEVICES = {"single": (1, 1, 1), "data": (2, 1, 1), "fsdp": (1, 2, 1), "model": (1, 1, 2)}
FOUR_DEVICES = {"single": (1, 1, 1), "data_fsdp": (2, 2, 1), "fsdp_model": (1, 2, 2), "data_model": (2, 1, 2)}


@pytest.fixture(scope="module")
def steps_on_two_devices():
    return _steps_on_meshes(TWO_DEVICES)


def _assert_same_step(out: dict, name: str, shape: tuple[int, int, int]) -> None:
    data, fsdp, model = shape
    assert out["single"]["devices"] == 1 and out[name]["devices"] == data * fsdp * model
    # q_proj is [layers, embed, heads, kv]: fsdp splits the 64 embed features in the update, model the
    # 4 query heads; the rollout's copy is whole over fsdp and still split over model.
    assert out[name]["q_shard"][1:3] == [64 // fsdp, 4 // model]
    assert out[name]["decode_shard"][1:3] == [64, 4 // model]
    for key in ("train/reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "actor/kl_loss",
                "critic/grad_norm", "train/response_length", "rollout/old_log_prob", "critic/values/mean"):
        assert out[name]["metrics"][key] == pytest.approx(out["single"]["metrics"][key], rel=1e-4, abs=1e-5), key
    # Tolerance derived in the module docstring: Adam's first step moves weights by about lr.
    assert out["update"] > 5e-4 and out[name]["param_diff"] < 0.05 * out["update"]


@pytest.mark.parametrize("name", [n for n in TWO_DEVICES if n != "single"])
def test_step_on_two_devices_matches_one_device(steps_on_two_devices, name):
    _assert_same_step(steps_on_two_devices, name, TWO_DEVICES[name])


# Slow: 4 simulated devices compile four more programs (~2 min on an idle 2-core machine). The
# 2-device test covers each axis alone; this one their combinations.
@pytest.mark.slow
def test_step_on_mixed_meshes_matches_one_device():
    out = _steps_on_meshes(FOUR_DEVICES)
    for name, shape in FOUR_DEVICES.items():
        if name != "single":
            _assert_same_step(out, name, shape)
