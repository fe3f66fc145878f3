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

A run whose sampler has devices of its own (``mesh.rollout_devices``) moves its weights and batches
between meshes that may lie on different processes: ``jax.device_put`` does it as a cross-host
transfer, through a socket each process opens where the others reach it (``initialize`` picks the
address). A program on a mesh of other processes' devices only is skipped on this process and
returns an array it cannot read, so every process runs the same loop; ``to_host`` reads any array
on every process, wherever it lives.
"""

from __future__ import annotations

import os
import socket
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

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
    elif _cluster_detected():
        jax.distributed.initialize()  # reads the launcher's environment
    else:
        return False
    _open_transfer_socket()
    return True


TRANSFER_SOCKET = "jax_cross_host_transfer_socket_address"


def _open_transfer_socket() -> None:
    """Let ``jax.device_put`` move arrays between devices of different processes (a split of the
    devices, ``mesh.rollout_devices``): the address of a socket of this process that the others
    reach, set before XLA's backend starts (it opens the socket then). The interface is the one
    that routes to the coordinator (127.0.0.1 for a coordinator on localhost), the port a free one
    (jax's port 0 is not published to the other processes). An address already set
    (``jax.config.update`` by a launcher) is kept."""
    if jax.config.values.get(TRANSFER_SOCKET):
        return
    from jax._src import distributed as jax_distributed  # the coordinator the launcher or the settings gave

    coordinator = jax_distributed.global_state.coordinator_address or ""
    host, _, port = coordinator.rpartition(":")
    jax.config.update(TRANSFER_SOCKET, transfer_address(host.strip("[]"), int(port or 0)))


def transfer_address(coordinator_host: str, coordinator_port: int) -> str:
    """``ip:port`` (``[ip]:port`` for IPv6) of a free port on this host's interface that routes to
    ``coordinator_host`` (no packet is sent)."""
    try:
        family, _, _, _, target = socket.getaddrinfo(coordinator_host, coordinator_port or 1, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(target)
            ip = probe.getsockname()[0]
    except OSError:  # no route known: this host's name
        family, ip = socket.AF_INET, socket.gethostbyname(socket.gethostname())
    with socket.socket(family, socket.SOCK_STREAM) as free:
        free.bind((ip, 0))
        port = free.getsockname()[1]
    return f"[{ip}]:{port}" if family == socket.AF_INET6 else f"{ip}:{port}"


def is_writer() -> bool:
    """Whether this process writes the run's files (process 0 of the run)."""
    return jax.process_index() == 0


def tag() -> str:
    """``"[process i/n] "`` to prefix this process's messages with in a multi-process run, else ``""``."""
    return f"[process {jax.process_index()}/{jax.process_count()}] " if jax.process_count() > 1 else ""


def to_host(tree):
    """``tree`` readable on this process: unchanged in a single-process run; with several processes,
    every array whole on every process as a NumPy array (a collective: every process must call it,
    with arrays of the same shardings).

    An array of every process's devices is gathered (``process_allgather``), or read where it lies
    when each device holds it whole. An array of some processes' devices only (the trainer's or
    the sampler's part of a split, ``mesh.rollout_devices``) is first made whole on its own devices,
    then the first process that holds it sends it to the others. A value of each process's own (a
    NumPy array, or a JAX array not committed to devices) is read where it is."""
    if jax.process_count() == 1:
        return tree
    leaves, treedef = jax.tree.flatten(tree)
    out = list(leaves)
    everywhere = set(range(jax.process_count()))
    gather: list[int] = []  # the leaves to gather across every process
    owned: dict[int, list[int]] = {}  # the leaves of some processes' devices, by the process that sends them
    for i, x in enumerate(leaves):
        if not (isinstance(x, jax.Array) and x.committed):
            out[i] = np.asarray(x)  # a value of this process's own (NumPy, or made on its default device)
            continue
        processes = processes_of(x.sharding)
        if processes != everywhere:
            owned.setdefault(min(processes), []).append(i)
        elif x.is_fully_replicated:
            out[i] = np.asarray(x.addressable_data(0))  # every device holds it whole: no collective needed
        else:
            gather.append(i)
    if gather:
        for i, x in zip(gather, multihost_utils.process_allgather([leaves[i] for i in gather], tiled=True)):
            out[i] = x
    for owner, indices in sorted(owned.items()):
        sent = [np.asarray(x.addressable_data(0)) if jax.process_index() == owner else np.zeros(x.shape, x.dtype)
                for x in (whole(leaves[i]) for i in indices)]
        # Stacked, one row per process, and the owner's row taken: its bytes as they are (no arithmetic).
        for i, x in zip(indices, multihost_utils.process_allgather(sent)):
            out[i] = x[owner]
    return jax.tree.unflatten(treedef, out)


def processes_of(sharding) -> set[int]:
    """The processes whose devices hold a part of an array laid out by ``sharding``."""
    devices: Any = sharding.device_set
    return {d.process_index for d in devices}


def _identity(x):
    return x


def whole(x: jax.Array) -> jax.Array:
    """``x`` whole on each of its devices (a program on them; skipped by the processes without one)."""
    if x.is_fully_replicated:
        return x
    assert isinstance(x.sharding, NamedSharding), x.sharding
    return jax.jit(_identity, out_shardings=x.sharding.update(spec=PartitionSpec()))(x)
