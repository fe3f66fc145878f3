"""One device or a mesh of them, with the same code: a rules table maps logical axis names to mesh axes.

The decoder's weights carry logical axis names (``nnx.Param`` metadata ``out_sharding``) and its
activations pass through ``with_logical_constraint``; both are inert until ``use_mesh(mesh)`` is
active. Inside it, ``shard(tree, mesh)`` places a train state — every named weight (and the Adam
moments that mirror it) by its names, everything else (LoRA adapters, the value head, counters)
replicated — and XLA's SPMD partitioner spreads the compiled rollout and update over the mesh:

- ``data``: data parallel. The rows of the rollout and of every micro-batch (``batch``).
- ``fsdp``: fully sharded data parallel. The rows as well (``batch`` splits over ``data × fsdp``),
  and in the update every weight's ``embed`` dimension, so actor, critic, reference and Adam
  moments are stored 1/fsdp per device; XLA gathers each layer's weights where it uses them and
  reduce-scatters their gradients. The rollout instead gets the policy gathered once per iteration
  (``for_decoding``): decoding reads every weight once per token, so it wants them local.
- ``model``: tensor parallel. Query heads, MLP features and the vocabulary (``heads``, ``mlp``,
  ``vocab``); key/value heads stay whole because Qwen2.5's 2 kv heads rarely divide the axis.

An activation's ``embed`` is never split: ``batch`` comes first in the rules and already holds
``fsdp`` (flax assigns each mesh axis once per array). A mesh of one device is the single-device
program. Sizes must divide: each sharded weight dimension by its mesh axis, and the rollout batch
and micro-batch by ``data × fsdp`` (``check_batch``); a mismatch is an error naming what to change.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import jax
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from starpo_jax.runtime import distributed

AXES = ("data", "fsdp", "model")
ROWS = ("data", "fsdp")  # the mesh axes that split rows
RULES = (
    ("batch", ROWS),
    ("heads", "model"),
    ("mlp", "model"),
    ("vocab", "model"),
    ("embed", "fsdp"),
    ("kv_heads", None),
    ("kv", None),
    ("layers", None),
)
# The rollout's layout of the policy: the same, with weights whole over ``fsdp``.
DECODE_RULES = tuple((name, None if name == "embed" else axes) for name, axes in RULES)


def make_mesh(data: int = -1, fsdp: int = 1, model: int = 1, devices=None) -> Mesh:
    """A ``data × fsdp × model`` mesh over ``devices`` (default: all); one size may be -1 (the rest)."""
    devices = list(jax.devices() if devices is None else devices)
    sizes = {"data": data, "fsdp": fsdp, "model": model}
    rest = [name for name, size in sizes.items() if size == -1]
    if len(rest) > 1:
        raise ValueError(f"Only one of mesh.data, mesh.fsdp, mesh.model may be -1 (the rest); got {', '.join(rest)}.")
    for name, size in sizes.items():
        if size != -1 and size < 1:
            raise ValueError(f"mesh.{name}={size} must be a positive size, or -1 for the devices the others leave.")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if rest:
        if len(devices) % fixed:
            named = " × ".join(f"mesh.{n}={s}" for n, s in sizes.items() if s != -1)
            raise ValueError(f"{named} must divide the {len(devices)} devices available.")
        sizes[rest[0]] = len(devices) // fixed
    total = math.prod(sizes.values())
    if total > len(devices):
        raise ValueError(
            f"mesh.data × mesh.fsdp × mesh.model = {' × '.join(map(str, sizes.values()))} needs {total} devices, but "
            f"{len(devices)} are available; set one of them to -1 to take the rest."
        )
    grid = np.asarray(devices[:total]).reshape(tuple(sizes.values()))
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def rows_per_mesh(mesh) -> int:
    """How many ways the rows of a batch are split (``data × fsdp``)."""
    return math.prod(mesh.shape[axis] for axis in ROWS)


@contextlib.contextmanager
def use_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Make ``mesh`` and ``RULES`` current: functions jitted (traced) inside run on the mesh."""
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        yield mesh


def _axis_size(mesh, axis) -> int:
    return math.prod(mesh.shape[a] for a in ((axis,) if isinstance(axis, str) else axis))


def _spec(names, shape, mesh, where: str, rules=RULES) -> PartitionSpec:
    """The mesh axes of an array with logical axes ``names``, mesh axes of size 1 left out.

    Leaving them out keeps one spelling for one layout: the arrays XLA returns from a program name
    no axis of size 1, so a state placed with them and the state an update returns would otherwise
    be the same layout spelled two ways, and every program that reads both (the validation
    rollout at step 0 and after a resume) would be compiled and cached twice."""
    spec = nn.logical_to_mesh_axes(names, rules)
    assert spec is not None  # None only for names=None
    for size, axis, name in zip(shape, spec, names):
        if axis is not None and size % _axis_size(mesh, axis):
            raise ValueError(
                f"{where}: its {name!r} axis ({size}) does not divide over mesh.{axis}={_axis_size(mesh, axis)}; "
                f"choose a mesh.{axis} that divides it."
            )
    return PartitionSpec(*(_without_unit_axes(axis, mesh) for axis in spec))


def _without_unit_axes(axis, mesh):
    """``axis`` (None, a mesh axis or a tuple of them) without the mesh axes of size 1."""
    if axis is None:
        return None
    kept = tuple(a for a in ((axis,) if isinstance(axis, str) else axis) if mesh.shape[a] > 1)
    return None if not kept else kept[0] if len(kept) == 1 else kept


def _names(x):
    return x.get_metadata().get("out_sharding") if isinstance(x, nnx.Variable) else None


def shardings(tree, mesh: Mesh | AbstractMesh, rules=RULES):
    """The ``NamedSharding`` of every array in ``tree``: a named weight by its names, else replicated."""

    def one(path, x):
        names = _names(x)
        spec = _spec(names, x.shape, mesh, jax.tree_util.keystr(path), rules) if names else PartitionSpec()
        sharding = NamedSharding(mesh, spec)
        return x.replace(sharding) if isinstance(x, nnx.Variable) else sharding

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard(tree, mesh: Mesh, copy: bool = False):
    """``tree`` placed on ``mesh`` by ``shardings``; ``copy``: in buffers of its own even where it
    already lies so (a program that donates ``tree`` then leaves the copy alone). From any devices,
    those of other processes too (``move``)."""
    return move(tree, shardings(tree, mesh), copy)


def move(tree, shardings, copy: bool = False):
    """``jax.device_put(tree, shardings)`` (``shardings``: one for each array of ``tree``; ``copy``: in
    buffers of their own), also from the devices of some processes to those of others (a split's
    parts on different hosts).

    JAX moves an array between processes (a cross-host transfer, ``distributed.initialize`` opens
    its socket) only onto the same layout: the same tiles in the same device order. An array laid
    out otherwise goes whole: made whole on its own devices, sent whole to each of the target's,
    and split there, moving more bytes (each target device receives all of it)."""
    if jax.process_count() == 1:
        return jax.device_put(tree, shardings, may_alias=False if copy else None)
    leaves, treedef = jax.tree.flatten(tree)
    targets = jax.tree.leaves(shardings)
    assert len(targets) == len(leaves), "move takes a sharding for every array"
    detour = [i for i, (x, s) in enumerate(zip(leaves, targets)) if _goes_whole(x, s)]
    if detour:
        whole = [distributed.whole(leaves[i]) for i in detour]
        moved = jax.device_put(whole, [targets[i].update(spec=PartitionSpec()) for i in detour])
        leaves = list(leaves)
        for i, x in zip(detour, moved):
            leaves[i] = x
    return jax.device_put(jax.tree.unflatten(treedef, leaves), shardings, may_alias=False if copy else None)


def _goes_whole(x, target) -> bool:
    """Whether ``x`` lies on other processes' devices than ``target`` in another layout (``move``)."""
    if not isinstance(x, jax.Array) or not x.committed:
        return False
    if distributed.processes_of(x.sharding) == distributed.processes_of(target):
        return False
    return x.sharding._to_xla_hlo_sharding(x.ndim) != target._to_xla_hlo_sharding(x.ndim)


def row_shardings(batch, mesh: Mesh):
    """The ``NamedSharding`` of every array of ``batch`` (a pytree of arrays whose leading axis is
    its rows, such as a rollout's ``Trajectories``) with its rows split over ``data × fsdp``."""
    rows = _without_unit_axes(ROWS, mesh)
    return jax.tree.map(lambda x: NamedSharding(mesh, PartitionSpec(rows) if x.ndim else PartitionSpec()), batch)


def for_decoding(params):
    """Inside a jitted function on a mesh: the policy's weights gathered over ``fsdp`` (still split
    over ``model``), the layout decoding is fastest in. One constraint at the phase boundary, so the
    gather happens once per iteration, not once per decoded token. Without a mesh, ``params``.

    Each weight is first pinned to its stored (``fsdp``-split) layout: given only the gathered
    layout, XLA's SPMD partitioner gathers the operand of the cast that made ``params`` (float32
    master weights), then casts: twice the bytes moved and a float32 copy of the whole policy."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or "fsdp" not in mesh.axis_names or mesh.shape["fsdp"] == 1:
        return params

    def one(x):
        names = _names(x)
        if not names:
            return x
        stored = jax.lax.with_sharding_constraint(x[...], _spec(names, x.shape, mesh, "policy"))
        return x.replace(jax.lax.with_sharding_constraint(stored, _spec(names, x.shape, mesh, "policy", DECODE_RULES)))

    return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def replicated(x):
    """Inside a jitted function on a mesh: ``x`` whole on every device (one gather), so that an
    operation XLA cannot split by rows, such as ``jnp.unique``'s sort, reads it locally instead of
    gathering each of its operands apart. Without a mesh, ``x``."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, PartitionSpec())


def scatter_rows(buffer, columns, values):
    """``buffer[b, columns[b, j]] = values[b, j]`` (cast to the buffer's dtype); a column outside
    the row is dropped. Row by row (vmapped): a scatter whose batch dimension is the rows', so a
    row-sharded batch scatters on each device without gathering every row's columns (an explicit
    row index made XLA all-gather them, and that collective could run out of order with others)."""
    row = lambda buf, cols, v: buf.at[cols].set(v.astype(buf.dtype), mode="drop")  # noqa: E731
    return jax.vmap(row)(buffer, columns, values)


def check_batch(mesh: Mesh | AbstractMesh, **batch_sizes: int) -> None:
    """Every batch the step splits into rows must divide evenly over ``data × fsdp``: e.g.
    ``check_batch(mesh, rollout_batch=128, micro_batch_size=4)``."""
    rows = rows_per_mesh(mesh)
    for name, size in batch_sizes.items():
        if size % rows:
            raise ValueError(
                f"{name} ({size}) must be a multiple of mesh.data × mesh.fsdp ({mesh.shape['data']} × "
                f"{mesh.shape['fsdp']} = {rows})."
            )
