"""The host's memory as /proc reports it: a CPU run's memory is its process's. This module imports
nothing heavy: ``allocator`` reads the host's available memory before the process restarts."""

from __future__ import annotations


def _proc_field(text: str, name: str) -> int | None:
    """``name:   1234 kB`` of a /proc status or meminfo text, in bytes."""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key == name:
            return int(value.split()[0]) * 1024
    return None


def _status_field(name: str, status: str | None) -> int:
    try:
        status = open("/proc/self/status").read() if status is None else status
    except OSError:
        return 0
    return _proc_field(status, name) or 0


def resident_bytes(status: str | None = None) -> int:
    """This process's resident memory now (VmRSS of /proc/self/status); 0 where there is no /proc."""
    return _status_field("VmRSS", status)


def peak_resident_bytes(status: str | None = None) -> int:
    """The most resident memory this process has held so far (VmHWM); 0 where there is no /proc."""
    return _status_field("VmHWM", status)


def available_bytes(meminfo: str | None = None) -> int | None:
    """The memory the kernel can still give a process without swapping (MemAvailable of
    /proc/meminfo: free memory plus reclaimable caches, shared with every other process); None where
    there is no /proc."""
    try:
        meminfo = open("/proc/meminfo").read() if meminfo is None else meminfo
    except OSError:
        return None
    return _proc_field(meminfo, "MemAvailable")
