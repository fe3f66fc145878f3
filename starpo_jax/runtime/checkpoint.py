"""Checkpoints of a training run with orbax: the whole ``TrainState`` plus a small JSON of host-side
state (the collapse watch's history), written atomically (orbax writes into a temporary folder and
renames it when complete), so a run killed at any moment resumes from the last complete step.

Orbax does not verify what it reads back: bytes damaged on disk restore silently as garbage (NaN
or 3e38 Adam moments). So every step also stores a CRC-32 of each array's bytes in its JSON item,
and ``restore`` recomputes them; a damaged step is reported in one line and the next older intact
step is used instead. A step whose arrays have other shapes or another structure than the state
the run builds (another model or config) is no damage: ``restore`` raises ``CheckpointMismatch``,
found from orbax's metadata before anything is read, and tries no older step.

A finished step also lists its files' sizes (``FILE_SIZES``, single-process runs), so that a step
cut short on disk (a full disk, an interrupted copy) is found from the sizes alone, before a model
is loaded to restore into (``check_saved_files``); the checksums still catch damaged bytes when the
step is read.

A ``TrainState``'s frozen copies of the initial weights (``FROZEN``: the KL reference, LoRA's base)
are not written: every start rebuilds them from ``model.source``, and a checkpoint holds only
their checksums, so that a resume whose ``model.source`` now holds other weights is refused as a
mismatch instead of continuing from the wrong reference or base.

A one-step-off run (``trainer.staleness=1``) has a batch in flight when it saves: dispatched before
the last update, by the weights that update started from. Those weights (the sampler's ``actor``)
are a third item, ``pending``, so that a resume samples that batch again exactly (a rollout is a
function of its weights, step and key); they are checked like the state.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import sys
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from starpo_jax.runtime import distributed, unraisable


class CheckpointError(ValueError):
    """A missing, damaged or unreadable checkpoint; the message names the folder."""


class CheckpointMismatch(CheckpointError):
    """A readable checkpoint of other arrays (shapes, structure) than the state to restore into:
    written by another model or config. The message names one array that differs."""


def manager(directory: str | Path, max_to_keep: int = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(directory).absolute(), item_names=ITEMS, options=options)


ITEMS = ("state", "host", "pending")  # pending: only in a one-step-off run's steps


class Restored(NamedTuple):
    state: Any
    host: dict
    step: int
    pending: Any = None  # the weights of the batch in flight, when asked for and saved


def saved_steps(directory: str | Path) -> list[int]:
    """The complete steps in a checkpoint folder, newest first, read without creating anything
    (orbax's temporary folders of unfinished steps are not named by a bare number)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((int(p.name) for p in directory.iterdir() if p.is_dir() and p.name.isdigit()), reverse=True)


def require_checkpoint(directory: str | Path) -> None:
    """Raise the one-line error for resuming from a folder without a complete step."""
    if not saved_steps(directory):
        raise _no_checkpoint(directory)


def _no_checkpoint(directory) -> CheckpointError:
    return CheckpointError(
        f"No checkpoint in {directory}: there is nothing to resume. Start afresh with "
        "--config.trainer.overwrite=True (deletes the earlier run's files) or in another --config.trainer.output_dir."
    )


FROZEN = ("ref", "base")  # TrainState's fields rebuilt from model.source at every start


def _split(state):
    """(what a checkpoint of ``state`` stores, the frozen weights it leaves out: None if it has none)."""
    if not all(hasattr(state, name) for name in FROZEN):
        return state, None
    return state.replace(**dict.fromkeys(FROZEN)), tuple(getattr(state, name) for name in FROZEN)


def checksums(state) -> dict[str, str]:
    """CRC-32 of every array's bytes, by its path in the pytree (zlib's, near memory speed: seconds
    for a 0.5B run).

    Arrays split across processes (many hosts) are left out: no process holds their bytes, and
    gathering a large model onto every host to sum it would cost more than the checkpoint."""
    sums = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
        if not getattr(leaf, "is_fully_addressable", True):
            continue
        data = np.ascontiguousarray(jax.device_get(leaf)).reshape(-1).view(np.uint8)
        sums[jax.tree_util.keystr(path)] = f"{zlib.crc32(data.data):08x}"
    return sums


def _partial(tree) -> list[int]:
    """The leaves of ``tree`` on some processes' devices only (a split's parts, many hosts), which
    orbax cannot save: with several processes it writes only arrays of every process's devices."""
    if jax.process_count() == 1:
        return []
    everywhere = set(range(jax.process_count()))
    return [i for i, x in enumerate(jax.tree.leaves(tree))
            if isinstance(x, jax.Array) and distributed.processes_of(x.sharding) != everywhere]


def _whole_everywhere():
    return jax.sharding.NamedSharding(jax.sharding.Mesh(np.asarray(jax.devices()), ("all",)), jax.sharding.PartitionSpec())


def _savable(tree):
    """``tree`` with its ``_partial`` arrays whole on every device (through the host: a collective)."""
    partial = _partial(tree)
    if not partial:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    values = distributed.to_host([leaves[i] for i in partial])
    for i, value in zip(partial, values):
        leaves[i] = jax.make_array_from_callback(value.shape, _whole_everywhere(), value.__getitem__)
    return jax.tree.unflatten(treedef, leaves)


def _restorable(like):
    """What orbax restores for ``like``: its ``_partial`` arrays as ``_savable`` wrote them."""
    partial = set(_partial(like))
    leaves, treedef = jax.tree.flatten(like)
    return jax.tree.unflatten(treedef, [
        jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_whole_everywhere()) if i in partial
        else ocp.utils.to_shape_dtype_struct(x) for i, x in enumerate(leaves)])


def _placed(tree, like):
    """Restored ``tree`` with its arrays of ``like``'s ``_partial`` leaves placed as those are."""
    partial = _partial(like)
    if not partial:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    likes = jax.tree.leaves(like)
    for i in partial:
        leaves[i] = jax.device_put(np.asarray(leaves[i].addressable_data(0)), likes[i].sharding)
    return jax.tree.unflatten(treedef, leaves)


def save(mgr: ocp.CheckpointManager, step: int, state, host: dict, pending=None) -> None:
    """Step ``step``: ``state`` (less its frozen weights), the JSON ``host``, and ``pending``, the
    weights of a batch in flight (None: there is none)."""
    stored, frozen = _split(state)
    stored, pending = _savable(stored), _savable(pending)
    host = {**host, "checksums": checksums(stored)}
    if frozen is not None:
        host["frozen_checksums"] = checksums(frozen)
    items = {"state": ocp.args.StandardSave(stored)}
    if pending is not None:
        host["pending_checksums"] = checksums(pending)
        items["pending"] = ocp.args.StandardSave(pending)
    mgr.save(step, args=ocp.args.Composite(host=ocp.args.JsonSave(host), **items))
    mgr.wait_until_finished()
    if jax.process_count() == 1:  # with many hosts each writes its own files, maybe to its own disk
        _write_file_sizes(Path(str(mgr.directory)) / str(step))


FILE_SIZES = "file_sizes.json"  # {path in the step's folder: bytes}, written once the step is complete


def _write_file_sizes(step_dir: Path) -> None:
    sizes = {str(p.relative_to(step_dir)): p.stat().st_size for p in sorted(step_dir.rglob("*")) if p.is_file()}
    partial = step_dir / (FILE_SIZES + ".partial")
    partial.write_text(json.dumps(sizes, indent=0))
    os.replace(partial, step_dir / FILE_SIZES)  # a step without the list is read (and checked) as before


def check_files(directory: str | Path, step: int) -> None:
    """Raise ``CheckpointError`` if a file of step ``step`` is missing or has another size than when
    it was written; a step saved without the list (many hosts) passes."""
    step_dir = Path(directory) / str(step)
    where = _step_label(directory, step)
    try:
        sizes = json.loads((step_dir / FILE_SIZES).read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{where} is damaged: its {FILE_SIZES} cannot be read ({err}).") from None
    for name, size in sizes.items():
        path = step_dir / name
        if not path.is_file():
            raise CheckpointError(f"{where} is incomplete: its file {name} is missing.")
        if path.stat().st_size != size:
            raise CheckpointError(f"{where} is truncated: its file {name} holds {path.stat().st_size} of the "
                                  f"{size} bytes written.")


def _step_label(directory: str | Path, step: int) -> str:
    """How errors name a step: "Checkpoint step N in /abs/dir"."""
    return f"Checkpoint step {step} in {Path(str(directory)).absolute()}"


def check_saved_files(directory: str | Path) -> None:
    """Raise the last ``check_files`` error if no saved step in ``directory`` is whole on
    disk: what ``restore`` would find after the model is built, from the files' sizes alone."""
    failed = None
    for step in saved_steps(directory):
        try:
            return check_files(directory, step)
        except CheckpointError as err:
            failed = err  # as restore reports it: the oldest step tried last
    if failed is not None:
        raise CheckpointError(f"{failed} No intact checkpoint is left.")


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def restore(mgr: ocp.CheckpointManager, like_state, step: int | None = None, warn: Callable[[str], None] = _warn,
            like_pending=None) -> Restored:
    """State, host dict and step of ``step`` (default: the newest intact one) shaped like ``like_state``,
    whose frozen weights (``FROZEN``) the restored state keeps; with ``like_pending``, also the weights
    of the batch that was in flight, shaped like it (None if the step holds none).

    A damaged or unreadable step is reported through ``warn`` and the next older step is tried.
    """
    steps = mgr.all_steps() if step is None else [step]
    if not steps:
        raise _no_checkpoint(mgr.directory)
    failed = None  # the newer step's error, reported once an older step is tried
    for s in sorted(steps, reverse=True):
        if failed is not None:
            warn(f"{failed} Falling back to step {s}.")
        try:
            return _restore_step(mgr, like_state, s, like_pending)
        except CheckpointMismatch:
            raise  # every step of a run holds the same arrays: an older one would not match either
        except CheckpointError as err:
            failed = err
    raise CheckpointError(f"{failed} No intact checkpoint is left.")


def _restore_step(mgr: ocp.CheckpointManager, like_state, step: int, like_pending=None) -> Restored:
    where = _step_label(mgr.directory, step)
    check_files(str(mgr.directory), step)
    like_stored, frozen = _split(like_state)
    likes = {"state": like_stored}
    if like_pending is not None and (Path(str(mgr.directory)) / str(step) / "pending").is_dir():
        likes["pending"] = like_pending
    for item, like in likes.items():
        difference = _difference(stored_shapes(mgr.directory, step, item), array_shapes(like))
        if difference:
            raise CheckpointMismatch(f"{where} holds other arrays than this run builds ({difference})")
    args = ocp.args.Composite(host=ocp.args.JsonRestore(), **{
        item: ocp.args.StandardRestore(_restorable(like)) for item, like in likes.items()})
    out = reason = None
    with _quiet_storage_errors():
        try:
            out = mgr.restore(step, args=args)
        except Exception as err:  # orbax raises many types, with pages of TensorStore specs, for damaged files
            reason = _root_cause(err)
    if out is None:
        raise CheckpointError(
            f"{where} cannot be read ({reason}): it is damaged, truncated, or from a different model or config."
        )
    host = dict(out.host)
    pending = _placed(out.pending, likes["pending"]) if "pending" in likes else None
    out_state = _placed(out.state, like_stored)
    for arrays, key in ((out_state, "checksums"), (pending, "pending_checksums")):
        expected = host.pop(key, None)
        if expected is None or arrays is None:  # checkpoints written before checksums existed have none
            continue
        got = checksums(arrays)  # orbax already checked the tree's structure against the like
        bad = [name for name, crc in expected.items() if name in got and got[name] != crc]
        if bad:
            raise CheckpointError(
                f"{where} is damaged: {len(bad)} array(s), e.g. {bad[0]}, do not match the checksums written with it."
            )
    if frozen is None:
        return Restored(out_state, host, step, pending)
    if host.pop("frozen_checksums", None) not in (None, checksums(frozen)):
        raise CheckpointMismatch(
            f"{where} was trained from other initial weights than model.source holds now (its KL reference "
            "or LoRA base differs)"
        )
    return Restored(out_state.replace(**dict(zip(FROZEN, frozen))), host, step, pending)


def stored_shapes(directory, step: int, item: str = "state") -> dict[str, tuple] | None:
    """{array path: shape} of the ``item`` saved at ``step``, from orbax's metadata (nothing else is
    read); None when the metadata cannot be read (a damaged step: the restore reports it)."""
    try:
        with _quiet_storage_errors():
            meta = ocp.StandardCheckpointHandler().metadata(epath.Path(str(directory)) / str(step) / item)
        return _shapes(getattr(meta, "tree", meta))
    except Exception:  # orbax raises many types for a damaged file
        return None


def array_shapes(state) -> dict[str, tuple]:
    """{array path: shape} of a state as orbax names its arrays in a checkpoint."""
    return _shapes(ocp.tree.serialize_tree(state, keep_empty_nodes=True))


def _shapes(tree) -> dict[str, tuple]:
    return {"/".join(map(str, path)): tuple(leaf.shape)
            for path, leaf in ocp.tree.to_flat_dict(tree).items() if hasattr(leaf, "shape")}


def _difference(stored: dict[str, tuple] | None, built: dict[str, tuple]) -> str | None:
    """How the saved arrays differ from the state to restore into, in a few words; None when they
    agree or the saved ones are unknown."""
    if not stored:
        return None
    reshaped = [k for k in sorted(stored.keys() & built.keys()) if stored[k] != built[k]]
    only_saved, only_built = sorted(stored.keys() - built.keys()), sorted(built.keys() - stored.keys())
    parts = []
    if reshaped:
        k = reshaped[0]
        parts.append(f"{len(reshaped)} array(s) of another shape, e.g. {k}: saved {stored[k]}, built {built[k]}")
    if only_saved:
        parts.append(f"{len(only_saved)} saved array(s) it does not build, e.g. {only_saved[0]}")
    if only_built:
        parts.append(f"{len(only_built)} array(s) it builds missing from the checkpoint, e.g. {only_built[0]}")
    return "; ".join(parts) or None


def _root_cause(err: BaseException) -> str:
    """The innermost error's first line (TensorStore's own words, without the spec dump)."""
    while (inner := err.__cause__ or err.__context__) is not None:
        err = inner
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return text if len(text) <= 240 else text[:240] + "..."


class _quiet_storage_errors:
    """Silence what a damaged file makes orbax, TensorStore and asyncio print besides the error:
    log lines with whole TensorStore specs, and ``Exception ignored in <coroutine>`` /
    ``Event loop is closed`` tracebacks of the reads still in flight when the first one failed
    (those surface whenever the abandoned reads are collected, so their filter stays installed)."""

    NAMES = ("absl", "orbax", "asyncio", "tensorstore", "jax")

    def __enter__(self):
        self.levels = {name: logging.getLogger(name).level for name in self.NAMES}
        for name in self.NAMES:
            logging.getLogger(name).setLevel(logging.CRITICAL + 1)
        unraisable.ignore(_abandoned_read)

    def __exit__(self, *exc):
        gc.collect()  # finalise the abandoned reads now, while the loggers are muted
        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)


def _abandoned_read(error) -> bool:
    """An error of a read abandoned by a failed orbax restore: its coroutine being closed, or
    TensorStore's thread finishing a read for the event loop the restore already closed."""
    code = getattr(error.object, "cr_code", None)
    orbax_coroutine = code is not None and "orbax" in code.co_filename
    closed_loop = isinstance(error.exc_value, RuntimeError) and str(error.exc_value) == "Event loop is closed"
    return orbax_coroutine or closed_loop


def set_aside(mgr: ocp.CheckpointManager, steps: list[int]) -> Path:
    """Move damaged steps out of the checkpoint folder (to ``damaged_checkpoints/`` beside it), so
    the resumed run can write those step numbers again; nothing is deleted."""
    directory = Path(str(mgr.directory))  # an etils path; pathlib moves it
    aside = directory.parent / "damaged_checkpoints"
    for step in steps:
        target = aside / str(step)
        n = 1
        while target.exists():
            target, n = aside / f"{step}.{n}", n + 1
        aside.mkdir(exist_ok=True)
        shutil.move(directory / str(step), target)
    mgr.reload()
    return aside
