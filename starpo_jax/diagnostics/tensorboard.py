"""TensorBoard scalars under the exact names of ``metrics.jsonl``, written without importing torch."""

from __future__ import annotations

import sys


def _tensorboardx():
    """tensorboardX, imported without torch: where torch is installed, tensorboardX's writer imports
    it only to accept torch tensors, which a run never logs, and that import would add seconds to every
    run's start."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX

        return tensorboardX
    # ``import torch`` raises ImportError while tensorboardX loads (None in sys.modules blocks an import;
    # typeshed types the values as modules only)
    sys.modules["torch"] = None  # type: ignore[assignment]
    try:
        import tensorboardX
    finally:
        del sys.modules["torch"]
    return tensorboardX


def summary_writer(folder, purge_step=None):
    """A TensorBoard writer into ``folder``; ``purge_step`` drops the events logged from that step on
    (those a killed run logged after its last checkpoint)."""
    return _tensorboardx().SummaryWriter(str(folder), purge_step=purge_step)


def write_scalars(writer, metrics: dict, step: int) -> None:
    """One TensorBoard event holding every metric of a step, under the exact names of
    ``metrics.jsonl`` (tensorboardX's ``add_scalar`` would rename ``pass@4`` to ``pass_4``)."""
    _tensorboardx()
    from tensorboardX.proto.summary_pb2 import Summary

    values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in metrics.items()]
    writer.file_writer.add_summary(Summary(value=values), step)
