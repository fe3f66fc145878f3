"""XLA:CPU's working memory from tcmalloc rather than glibc's malloc, for the commands.

XLA:CPU allocates each compiled call's working memory afresh and frees it when the call returns:
the update's gradients and activations, a prefill's KV cache, an append's attention scores, tens of
MB to GBs a call. glibc serves every allocation above 32 MiB with a fresh ``mmap`` and hands it back
with ``munmap``, so every call faults its pages in again and the kernel zeroes them one by one:
millions of page faults an iteration, a sixth of the process's CPU time spent in the kernel
(docs/benchmarks.md, "Huge pages for XLA:CPU's working memory" and "tcmalloc for XLA:CPU's working
memory"). Keeping glibc's heap instead (``mmap_max=0``) put XLA's threads in one arena and cost more
than it saved; 2 MiB pages traded the faults for as much time compacting memory. tcmalloc keeps
what one call frees for the next, with a cache per thread.

What it keeps it holds resident. Left to itself it also gives free pages back to the kernel a few
at a time, and it never merges a span it has given back with a free neighbour it kept: a call that
needs a block larger than either grows the heap, though the two together would have served it, and
then touches the new block's pages for the first time. In the FrozenLake preset that grew the heap
by another update's working memory, and slowed that update, at a step that varied from run to run
with the order in which threads freed their buffers (docs/benchmarks.md, "What tcmalloc keeps, and its
heap limit"). So the restart sets ``TCMALLOC_RELEASE_RATE=0``: tcmalloc never gives pages back by
itself, every two free neighbours merge, and the heap grows to what the process's largest calls
need and stays there. It bounds that heap too (``TCMALLOC_HEAP_LIMIT_MB``): what the host has
available when the command starts, less ``UNCOUNTED`` for the process's memory tcmalloc does not
count (its code, Python's own arenas). At the limit tcmalloc hands its free spans back to the
kernel before it grows, and the calls that reuse them touch them afresh (slower, not killed); a
call that needs more than the limit fails with XLA's "Out of memory" error rather than the kernel's
killer. A setting in the environment is kept (and passed on to child processes):
``TCMALLOC_RELEASE_RATE=1`` is tcmalloc's own default, ``TCMALLOC_HEAP_LIMIT_MB=0`` no limit.

A preloaded allocator must be in place before the process allocates anything, so a command restarts
itself with it in ``LD_PRELOAD`` as its first step (``restart_with_tcmalloc``, which
``experiments.bootstrap`` and the benchmarks call) where the library is installed (Debian and
Ubuntu: ``apt-get install libtcmalloc-minimal4``; ``setup.sh`` installs it where it runs as root)
and not loaded yet. Where it is missing, the command runs on glibc's malloc as before.
``STARPO_JAX_TCMALLOC=off`` (or ``0``, ``false``, ``no``) keeps glibc's malloc; code that uses the
library without a command preloads it itself: ``LD_PRELOAD=libtcmalloc_minimal.so.4 python ...``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from starpo_jax.runtime import switches
from starpo_jax.runtime.host_memory import available_bytes

ENV = "STARPO_JAX_TCMALLOC"
LIBRARY = "libtcmalloc_minimal.so.4"
LIBRARY_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib",
                "/usr/local/lib")
HEAP_LIMIT = "TCMALLOC_HEAP_LIMIT_MB"
RELEASE_RATE = "TCMALLOC_RELEASE_RATE"
SETTINGS = {
    # tcmalloc reports every allocation above 1 GiB on stderr; XLA:CPU makes such buffers every call.
    "TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": str(1 << 50),
    # free pages stay resident and merge, given back only at the heap limit (module docstring)
    RELEASE_RATE: "0",
}
# What a process holds that tcmalloc does not count, left outside its limit: the code it runs
# (jaxlib's, Python's) and Python's own arenas, with room to spare so that the kernel need not
# evict that code to serve the heap.
UNCOUNTED = 3 << 29  # 1.5 GiB


def enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``STARPO_JAX_TCMALLOC`` leaves the restart on (it is unless set to off)."""
    return switches.switched_on(ENV, environ)


def library(dirs: Sequence[str | Path] = LIBRARY_DIRS) -> Path | None:
    """The installed tcmalloc library, or None."""
    return next((Path(d) / LIBRARY for d in dirs if (Path(d) / LIBRARY).is_file()), None)


def loaded(maps: str | Path = "/proc/self/maps") -> bool:
    """Whether this process runs on tcmalloc (its library is mapped)."""
    try:
        return "libtcmalloc" in Path(maps).read_text()
    except OSError:
        return False


def heap_limit(available: int | None) -> dict[str, str]:
    """tcmalloc's heap limit for a host with ``available`` bytes available (module docstring), in
    the environment variable's MiB; none where that is unknown or leaves too little to limit."""
    if available is None or available < 2 * UNCOUNTED:
        return {}
    return {HEAP_LIMIT: str((available - UNCOUNTED) >> 20)}


def current_heap_limit(environ: Mapping[str, str] | None = None) -> int | None:
    """This process's tcmalloc heap limit in MiB; None where it runs without tcmalloc or unlimited."""
    value = (os.environ if environ is None else environ).get(HEAP_LIMIT, "").strip()
    return int(value) if loaded() and value.isdigit() and int(value) > 0 else None


def preloaded_environment(environ: Mapping[str, str], path: Path, available: int | None = None) -> dict[str, str] | None:
    """``environ`` with ``path`` first in ``LD_PRELOAD`` and tcmalloc's settings (quiet, keeping its
    free pages, its heap limited to ``available`` less ``UNCOUNTED``) where ``environ`` sets none, or None where the
    library is preloaded already (a process started with it that still runs without it: restarting
    again would loop)."""
    preload = environ.get("LD_PRELOAD", "").replace(":", " ").split()
    if str(path) in preload:
        return None
    return {**SETTINGS, **heap_limit(available), **environ, "LD_PRELOAD": " ".join([str(path), *preload])}


def restart_with_tcmalloc(environ: Mapping[str, str] | None = None, dirs: Sequence[str | Path] = LIBRARY_DIRS) -> None:
    """Replace this process by the same command with tcmalloc preloaded, where it is installed,
    switched on and not loaded yet (module docstring); otherwise return and go on as before. Call it
    first, before the command has started threads or opened files it expects to keep."""
    environ = os.environ if environ is None else environ
    if not sys.platform.startswith("linux") or not enabled(environ) or loaded():
        return
    path = library(dirs)
    env = preloaded_environment(environ, path, available_bytes()) if path else None
    if env is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
