"""Checkpoint integrity: damaged bytes are caught by the per-array checksums and the restore falls
back to an older intact step; an unreadable (truncated) step is one short sentence."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from starpo_jax.runtime import checkpoint

STATE = {"w": jnp.arange(100_000, dtype=jnp.float32), "m": jnp.ones((64, 64), jnp.bfloat16)}


def saved(tmp_path, steps=(1, 2)):
    mgr = checkpoint.manager(tmp_path / "checkpoints")
    for s in steps:
        checkpoint.save(mgr, s, {k: v * s for k, v in STATE.items()}, {"step": s})
    return mgr


def data_file(tmp_path, step):
    """The largest file of a step's state: the one holding the array bytes."""
    files = [p for p in (tmp_path / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def test_restore_checks_every_array_and_falls_back_from_a_damaged_step(tmp_path):
    saved(tmp_path)
    path = data_file(tmp_path, 2)
    with open(path, "r+b") as f:  # 4 KB of random bytes into the middle of the data file
        f.seek(path.stat().st_size // 2)
        f.write(np.random.default_rng(0).bytes(4096))
    warnings: list[str] = []
    state, host, step, _ = checkpoint.restore(checkpoint.manager(tmp_path / "checkpoints"), STATE, warn=warnings.append)
    assert step == 1 and host == {"step": 1}
    np.testing.assert_array_equal(state["w"], STATE["w"])
    assert len(warnings) == 1 and "step 2" in warnings[0] and "damaged" in warnings[0]
    assert "Falling back to step 1" in warnings[0]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")  # the abandoned reads' tracebacks
@pytest.mark.parametrize("listed", [True, False], ids=["file sizes", "orbax's read"])
def test_a_truncated_only_step_is_one_sentence(tmp_path, capfd, listed):
    """Found from the step's list of file sizes, or, for a step without one (many hosts), by the
    read that fails."""
    saved(tmp_path, steps=(1,))
    if not listed:
        (tmp_path / "checkpoints" / "1" / checkpoint.FILE_SIZES).unlink()
    os.truncate(data_file(tmp_path, 1), data_file(tmp_path, 1).stat().st_size // 2)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.restore(checkpoint.manager(tmp_path / "checkpoints"), STATE)
    message = str(err.value)
    assert "step 1" in message and "No intact checkpoint" in message and "\n" not in message
    assert len(message) < 600
    printed = capfd.readouterr()
    assert "TensorStore" not in printed.err + printed.out and "Traceback" not in printed.err + printed.out


def test_a_step_cut_short_on_disk_is_found_from_its_file_sizes_alone(tmp_path):
    """No state to restore into is needed (the model need not be loaded): a truncated or missing file
    is named; an older whole step passes, and restore falls back to it."""
    saved(tmp_path)
    folder = tmp_path / "checkpoints"
    checkpoint.check_saved_files(folder)  # both steps whole
    truncated = data_file(tmp_path, 2)
    os.truncate(truncated, truncated.stat().st_size - 1)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 2 .* is truncated: its file state/.* holds \d+ of the"):
        checkpoint.check_files(folder, 2)
    checkpoint.check_saved_files(folder)  # step 1 is whole
    warnings: list[str] = []
    assert checkpoint.restore(checkpoint.manager(folder), STATE, warn=warnings.append).step == 1
    assert len(warnings) == 1 and "is truncated" in warnings[0] and "Falling back to step 1" in warnings[0]
    data_file(tmp_path, 1).unlink()
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.check_saved_files(folder)
    assert "step 1" in str(err.value) and "is incomplete: its file state/" in str(err.value)
    assert str(err.value).endswith("No intact checkpoint is left.")


def test_damaged_steps_are_set_aside_not_deleted(tmp_path):
    mgr = saved(tmp_path, steps=(1, 2))
    aside = checkpoint.set_aside(mgr, [2])
    assert mgr.all_steps() == [1] and (aside / "2" / "state").is_dir()
    checkpoint.save(mgr, 2, STATE, {})  # the step number is free again
    assert sorted(mgr.all_steps()) == [1, 2]


def test_other_arrays_are_a_mismatch_not_damage(tmp_path):
    """A state of other shapes or structure (another model or config) is named from the metadata,
    and no older step is tried: they would not match either."""
    saved(tmp_path)
    warnings: list[str] = []
    for like, named in (({**STATE, "w": jnp.zeros(99_999)}, "w: saved (100000,), built (99999,)"),
                        ({**STATE, "v": jnp.zeros(3)}, "missing from the checkpoint, e.g. v")):
        with pytest.raises(checkpoint.CheckpointMismatch) as err:
            checkpoint.restore(checkpoint.manager(tmp_path / "checkpoints"), like, warn=warnings.append)
        assert "step 2" in str(err.value) and named in str(err.value) and "damaged" not in str(err.value)
    assert warnings == []


def test_frozen_initial_weights_are_rebuilt_not_stored(tmp_path):
    """The KL reference and LoRA's base are copies of model.source's weights: a checkpoint leaves
    them out (half the disk of a PPO run with a KL term), the restored state keeps the rebuilt ones,
    and other initial weights than the run started from are refused as a mismatch."""
    import flax

    class State(flax.struct.PyTreeNode):
        actor: jnp.ndarray
        ref: jnp.ndarray | None
        base: jnp.ndarray | None

    start = State(actor=jnp.zeros(1000), ref=jnp.arange(1000.0), base=None)
    mgr = checkpoint.manager(tmp_path / "checkpoints")
    checkpoint.save(mgr, 1, start.replace(actor=start.actor + 1), {})
    assert list(checkpoint.stored_shapes(tmp_path / "checkpoints", 1) or {}) == ["actor"]
    state = checkpoint.restore(mgr, start).state
    np.testing.assert_array_equal(state.actor, np.ones(1000))
    assert state.ref is start.ref and state.base is None
    with pytest.raises(checkpoint.CheckpointMismatch, match="other initial weights"):
        checkpoint.restore(mgr, start.replace(ref=start.ref.at[7].set(0.5)))


def test_the_weights_of_a_batch_in_flight_are_a_checked_item_of_their_own(tmp_path):
    """A one-step-off run saves the weights that sample its next batch beside the state: restored
    when asked for, checked like the state (damage falls back to an older step), and absent from a
    step saved without them."""
    mgr = checkpoint.manager(tmp_path / "checkpoints")
    pending = {"w": jnp.full(1000, 3.0)}
    checkpoint.save(mgr, 1, STATE, {"step": 1}, {"w": jnp.full(1000, 1.0)})
    checkpoint.save(mgr, 2, STATE, {"step": 2}, pending)
    checkpoint.save(mgr, 3, STATE, {"step": 3})
    like = {"w": jnp.zeros(1000)}
    restored = checkpoint.restore(mgr, STATE, step=2, like_pending=like)
    assert restored.step == 2 and restored.host == {"step": 2}
    np.testing.assert_array_equal(restored.pending["w"], pending["w"])
    assert checkpoint.restore(mgr, STATE, step=2).pending is None  # not asked for
    assert checkpoint.restore(mgr, STATE, like_pending=like).pending is None  # step 3 holds none
    files = [p for p in (tmp_path / "checkpoints" / "2" / "pending").rglob("*") if p.is_file()]
    path = max(files, key=lambda p: p.stat().st_size)
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        f.write(np.random.default_rng(0).bytes(512))
    checkpoint.set_aside(mgr, [3])
    warnings: list[str] = []
    restored = checkpoint.restore(checkpoint.manager(tmp_path / "checkpoints"), STATE, like_pending=like,
                                  warn=warnings.append)
    assert restored.step == 1 and "step 2" in warnings[0] and "Falling back to step 1" in warnings[0]
    np.testing.assert_array_equal(restored.pending["w"], np.ones(1000))
