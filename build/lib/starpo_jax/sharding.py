"""One device or a mesh of them, with the same code: a rules table maps logical axis names to mesh axes.

The decoder's weights carry logical axis names (``nnx.Param`` metadata ``out_sharding``) and its
activations pass through ``with_logical_constraint``; both are inert until ``use_mesh(mesh)`` is
active. Inside it, ``shard(tree, mesh)`` places a train state — every named weight (and the Adam
moments that mirror it) by its names, everything else (LoRA adapters, the value head, counters)
replicated — and XLA's SPMD partitioner spreads the compiled rollout and update over the mesh:

- ``data``: data parallel. The rows of the rollout and of every micro-batch (``batch``).
- ``model``: tensor parallel. Query heads, MLP features and the vocabulary (``heads``, ``mlp``,
  ``vocab``); key/value heads stay whole because Qwen2.5's 2 kv heads rarely divide the axis.

A mesh of one device is the single-device program. Sizes must divide: each sharded weight
dimension by its mesh axis, and the rollout batch and micro-batch by ``data`` (``check_batch``);
a mismatch is an error naming what to change.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax
import numpy as np
from flax import nnx
from flax import linen as nn
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

AXES = ("data", "model")
RULES = (
    ("batch", "data"),
    ("heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
    ("embed", None),
    ("kv_heads", None),
    ("kv", None),
    ("layers", None),
)


def make_mesh(data: int = -1, model: int = 1, devices=None) -> Mesh:
    """A ``data × model`` mesh over ``devices`` (default: all); ``data=-1`` takes what ``model`` leaves."""
    devices = list(jax.devices() if devices is None else devices)
    if model < 1 or len(devices) % model:
        raise ValueError(f"mesh.model={model} must be a positive divisor of the {len(devices)} devices available.")
    data = len(devices) // model if data == -1 else data
    if data < 1 or data * model > len(devices):
        raise ValueError(
            f"mesh.data × mesh.model = {data} × {model} needs {data * model} devices, but {len(devices)} are "
            "available; use mesh.data=-1 to take all of them."
        )
    grid = np.asarray(devices[: data * model]).reshape(data, model)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Make ``mesh`` and ``RULES`` current: functions jitted (traced) inside run on the mesh."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        yield mesh


def _spec(names, shape, mesh: Mesh, where: str) -> PartitionSpec:
    spec = nn.logical_to_mesh_axes(names, RULES)
    for size, axis, name in zip(shape, spec, names):
        if axis is not None and size % mesh.shape[axis]:
            raise ValueError(
                f"{where}: its {name!r} axis ({size}) does not divide over mesh.{axis}={mesh.shape[axis]}; "
                f"choose a mesh.{axis} that divides it."
            )
    return spec


def shardings(tree, mesh: Mesh):
    """The ``NamedSharding`` of every array in ``tree``: a named weight by its names, else replicated."""

    def one(path, x):
        names = x.get_metadata().get("out_sharding") if isinstance(x, nnx.Variable) else None
        if not names:
            sharding = NamedSharding(mesh, PartitionSpec())
        else:
            sharding = NamedSharding(mesh, _spec(names, x.shape, mesh, jax.tree_util.keystr(path)))
        return x.replace(sharding) if isinstance(x, nnx.Variable) else sharding

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard(tree, mesh: Mesh):
    """``tree`` placed on ``mesh`` by ``shardings``."""
    return jax.device_put(tree, shardings(tree, mesh))


def check_batch(mesh: Mesh, **batch_sizes: int) -> None:
    """Every batch the step splits over ``data`` must divide evenly: e.g. ``check_batch(mesh,
    rollout_batch=128, micro_batch_size=4)``."""
    for name, size in batch_sizes.items():
        if size % mesh.shape["data"]:
            raise ValueError(f"{name} ({size}) must be a multiple of mesh.data ({mesh.shape['data']}).")
