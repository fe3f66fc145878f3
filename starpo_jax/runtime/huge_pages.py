"""A command's memory in transparent huge pages: a command run as ``python -m experiments.…``
restarts itself once, before anything heavy is imported (``experiments/__init__.py``), with glibc's
malloc asking the kernel for 2 MiB pages (the ``glibc.malloc.hugetlb=1`` tunable, glibc 2.35 and
later).

Why: XLA:CPU allocates a program's working memory afresh at every call and frees it after (one
update of the Bandit preset: 2.4 GB). In the kernel's 4 KiB pages every call then faults in and
zeroes ~600,000 pages, and each copy, gradient initialisation or slice of the stacked layer weights
runs at first-touch speed. In 2 MiB pages a call faults ~2,000 times. What it gains is in
docs/benchmarks.md ("Huge pages").

glibc reads its tunables once, as the process starts, so setting the variable later does nothing;
hence the restart (``os.execv``: the same process id, arguments and environment, plus the tunable).
Nothing is restarted where ``GLIBC_TUNABLES`` is already set (to anything, empty included: that is
how to opt out), where the kernel's transparent huge pages are not ``madvise`` (``always`` needs no
request, ``never`` refuses it), or where the C library is not glibc 2.35 or later. Benchmarks record whether their process ran
with them (``experiments.bench.common.machine``: ``huge_pages``).
"""

from __future__ import annotations

import os
import sys

TUNABLE = "glibc.malloc.hugetlb=1"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def restart_with_huge_pages() -> None:
    """Restart this process with ``TUNABLE`` set when it is an ``experiments`` command (``python -m
    experiments.…``) and ``why_not()`` finds no reason against; otherwise return at once."""
    if not run_as_command() or why_not() is not None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, "GLIBC_TUNABLES": TUNABLE})


def run_as_command() -> bool:
    """Whether Python was started as ``python [options] -m experiments.…``: not by pytest, nor by a
    script that imports the package."""
    argv = sys.orig_argv
    return "-m" in argv[:-1] and argv[argv.index("-m") + 1].split(".")[0] == "experiments"


def why_not() -> str | None:
    """Why this process should not restart with huge pages, or None if it should."""
    if "GLIBC_TUNABLES" in os.environ:
        return f"GLIBC_TUNABLES is set already ({os.environ['GLIBC_TUNABLES']!r})"
    version = glibc_version()
    if version is None or version < (2, 35):
        return "the C library is not glibc 2.35 or later"
    mode = thp_mode()
    if mode != "madvise":
        return f"the kernel's transparent huge pages are {mode or 'unavailable'}, not madvise"
    return None


def glibc_version() -> tuple[int, int] | None:
    """glibc's (major, minor), or None for another C library or system."""
    try:
        name, version = (os.confstr("CS_GNU_LIBC_VERSION") or "").split()  # "glibc 2.36"
        major, minor = version.split(".")[:2]
        return (int(major), int(minor)) if name == "glibc" else None
    except (AttributeError, ValueError, OSError):  # no confstr, or no such name here
        return None


def thp_mode() -> str | None:
    """The kernel's transparent huge page mode (``always``, ``madvise`` or ``never``: the bracketed
    word of ``THP_MODE``), or None where the file is missing."""
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return None
    return text[text.find("[") + 1:text.find("]")] if "[" in text else None


def in_use() -> bool:
    """Whether this process started with the tunable set, as glibc read it: the environment the
    process was started with (``/proc/self/environ``), which later changes to ``os.environ`` leave
    alone."""
    try:
        with open("/proc/self/environ", "rb") as f:
            started = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        tunables = started.get(b"GLIBC_TUNABLES", b"").decode(errors="replace")
    except OSError:
        tunables = os.environ.get("GLIBC_TUNABLES", "")
    return TUNABLE in tunables.split(":")
