"""Checkpoints of a training run with orbax: the whole ``TrainState`` plus a small JSON of host-side
state (the collapse watch's history), written atomically (orbax writes into a temporary folder and
renames it when complete), so a run killed at any moment resumes from the last complete step.
"""

from __future__ import annotations

from pathlib import Path

import jax
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
    """A missing or unreadable checkpoint; the message names the folder."""


def manager(directory: str | Path, max_to_keep: int = 3) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False)
    return ocp.CheckpointManager(Path(directory).absolute(), item_names=("state", "host"), options=options)


def save(mgr: ocp.CheckpointManager, step: int, state, host: dict) -> None:
    mgr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), host=ocp.args.JsonSave(host)))
    mgr.wait_until_finished()


def restore(mgr: ocp.CheckpointManager, like_state, step: int | None = None):
    """(state, host dict, step) of ``step`` (default: the latest) shaped like ``like_state``."""
    step = mgr.latest_step() if step is None else step
    if step is None:
        raise CheckpointError(
            f"No checkpoint in {mgr.directory}: start without resume, or point trainer.output_dir at a run "
            "that saved one (trainer.save_freq > 0)."
        )
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like_state)
    try:
        out = mgr.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), host=ocp.args.JsonRestore())
        )
    except Exception as err:  # orbax raises many types for truncated or foreign files
        raise CheckpointError(
            f"Checkpoint step {step} in {mgr.directory} cannot be read ({type(err).__name__}: {err}); "
            "it is corrupt or from a different model/config. Delete that step's folder to fall back to "
            "an earlier one."
        ) from err
    return out.state, dict(out.host), step
