"""Many hosts, one program: JAX's multi-controller runtime.

Every process runs the same training program over the global mesh (``jax.devices()`` lists the
devices of every process once ``jax.distributed.initialize`` has run). Nothing has to be split by
hand: training levels come from keys inside the compiled step and validation levels are built
identically on every host. Process 0 alone writes logs, TensorBoard, dumps and exports
(``is_writer``); checkpoints are written and restored by every process (orbax's multi-host path).

``initialize(settings)`` starts the runtime from the ``distributed`` settings (``coordinator_address``,
``num_processes``, ``process_id``), or, when those are unset, from the cluster's environment:
SLURM (``srun``), Open MPI (``mpirun``) and Cloud TPU pod slices, which ``jax.distributed``
detects itself. A single process on its own needs none of this and starts nothing.

``jax.distributed.initialize`` must run before anything initialises XLA's backend, and importing a
dependency can do that (jumanji builds arrays at import; loading a config imports the env classes).
So the commands read the ``distributed`` settings from the command line (``from_argv``) and start
the runtime before their other imports and their config file (``experiments.bootstrap``); the
loaded config must then agree with what was started (``check_started``).
"""

from __future__ import annotations

import os

import jax
from jax.experimental import multihost_utils

from starpo_jax.runtime.settings import config_section


class DistributedError(ValueError):
    """A ``distributed`` config that cannot start; the message names the key."""


def from_argv(argv: list[str]):
    """The ``distributed`` settings a command line gives: the defaults of ``configs/base.py`` with
    its ``--config.distributed.KEY=VALUE`` (or ``KEY VALUE``) flags applied, each cast to its
    default's type. Reads no config file, so that nothing has initialised XLA yet."""
    settings = config_section("distributed")
    prefix = "--config.distributed."
    for i, arg in enumerate(argv):
        if not arg.startswith(prefix):
            continue
        key, has_value, value = arg[len(prefix):].partition("=")
        if not has_value:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        if key not in settings:
            continue  # the flags parser names it, with its suggestion
        try:
            settings[key] = type(settings[key])(value)
        except ValueError:
            raise DistributedError(f"--config.distributed.{key} must be a whole number, not {value!r}.") from None
    return settings


def check_started(config_settings, started) -> None:
    """The loaded config's ``distributed`` section must be what the command line started: a config
    file cannot set it, as it is read only after the runtime has started."""
    differ = [k for k in started if config_settings.get(k) != started[k]]
    if differ:
        raise DistributedError(
            f"the config file sets distributed.{differ[0]}, which is read before any config file: "
            f"set it on the command line (--config.distributed.{differ[0]}=...)."
        )


def _cluster_detected() -> str | None:
    """The multi-process launcher this process runs under, if any (one that JAX auto-detects)."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
        return "SLURM"
    if int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
        return "Open MPI"
    if len([h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
        return "TPU pod"
    return None


def initialize(settings) -> bool:
    """Join the other processes of this run (``settings``: ``config.distributed`` or ``from_argv``);
    True when this is a multi-process run. Call before anything else touches JAX's devices."""
    address = settings.get("coordinator_address", "") or None
    num, index = int(settings.get("num_processes", -1)), int(settings.get("process_id", -1))
    if address:
        if num < 1 or index < 0:
            raise DistributedError(
                "distributed.coordinator_address is set: set distributed.num_processes (>= 1) and this "
                "process's distributed.process_id (0 .. num_processes - 1) too."
            )
        jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=index)
        return True
    if _cluster_detected():
        jax.distributed.initialize()  # reads the launcher's environment
        return True
    return False


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0 of the run)."""
    return jax.process_index() == 0


def tag() -> str:
    """``"[process i/n] "`` to prefix this process's messages with in a multi-process run, else ``""``."""
    return f"[process {jax.process_index()}/{jax.process_count()}] " if jax.process_count() > 1 else ""


def to_host(tree):
    """``tree`` readable on this process: unchanged in a single-process run; with several processes,
    every array gathered from all of them (a collective: every process must call it)."""
    if jax.process_count() == 1:
        return tree
    return multihost_utils.process_allgather(tree, tiled=True)
