"""The environment variables that switch a part of starpo-jax off: ``STARPO_JAX_TCMALLOC``
(``allocator``), ``STARPO_JAX_CPU_KERNEL`` (``models.cpu_kernels``) and ``STARPO_JAX_CACHE``
(``caches``). Each is on unless set to ``off``, ``0``, ``false`` or ``no`` (any case). They are
environment variables rather than config keys because they act before a config is read, or where
there is none. This module imports nothing heavy: ``allocator`` reads it before the process restarts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

OFF = frozenset({"off", "0", "false", "no"})


def is_off(value: str) -> bool:
    """Whether a switch's value turns it off."""
    return value.strip().lower() in OFF


def switched_on(name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the switch ``name`` is on in ``environ`` (default ``os.environ``): unset counts as on."""
    environ = os.environ if environ is None else environ
    return not is_off(environ.get(name, ""))
