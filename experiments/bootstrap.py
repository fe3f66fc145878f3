"""How a command starts: what must precede XLA's backend, then the command's own module.

XLA's backend starts at the first array, and importing the envs makes one (jumanji builds arrays at
import, and every env imports jumanji), yet some things must come before it. A command first
restarts itself on tcmalloc where it is installed (``starpo_jax.runtime.allocator``), before it
imports anything heavy, so that the restart costs little. Then a multi-host run joins its processes
(``jax.distributed.initialize`` refuses once the backend has started), and ``experiments.plan`` asks
for its simulated CPU devices. So a command begins with

    from experiments import bootstrap

    if __name__ == "__main__":
        bootstrap.command("experiments.run")

above its other imports. Run as ``python -m experiments.run``, the guard does the early steps from
the command line alone (no config file is read: loading one imports the envs), then imports the
command's module under its own name, whose imports sit at the top as in any module, and calls its
``run()`` (or the entry named). Imported as a library, the module skips the guard. The benchmarks,
which run for minutes, restart in the usual guard at their end; ``report`` and ``curves`` compute
nothing and do not restart. This module imports jax only inside the steps that need it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from starpo_jax.runtime import allocator

HELP_FLAGS = {"-h", "--help", "-help", "--helpshort", "-?", "--helpfull"}

_joined = False


def join_processes(argv: list[str]) -> None:
    """Join the other processes of a multi-host run (``starpo_jax.runtime.distributed``) from the
    command line's ``--config.distributed.*`` and the launcher's environment; once per process
    (``experiments.cli.run`` calls it again for a launcher that skipped ``command``). A bad value is
    one line on stderr and exit status 2."""
    global _joined
    if _joined or HELP_FLAGS & set(argv[1:]):
        return
    from starpo_jax.runtime import distributed  # imports jax: after the restart

    _joined = True
    try:
        distributed.initialize(distributed.from_argv(argv))
    except distributed.DistributedError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


def simulate_cpu_devices(argv: list[str]) -> None:
    """``experiments.plan``'s ``--devices N`` (default 1) as CPU devices, which the backend makes as
    it starts; a value that is no count is left to the flags parser to report."""
    import jax  # after the restart

    jax.config.update("jax_platforms", "cpu")
    value = "1"
    for i, arg in enumerate(argv[1:], 1):
        name, has_value, given = arg.lstrip("-").partition("=")
        if arg.startswith("-") and name == "devices":
            value = given if has_value else (argv[i + 1] if i + 1 < len(argv) else "")
    if value.isdigit() and int(value) > 0:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={value}".strip()


def run_nothing_first(argv: list[str]) -> None:
    """For a command with nothing to do before XLA's backend but the restart."""


def command(module: str, before_backend: Callable[[list[str]], None] = join_processes,
            entry: str = "run") -> NoReturn:
    """The command restarted on tcmalloc where it can be (``runtime.allocator``), then
    ``before_backend(sys.argv)`` and ``module``'s ``entry()``, whose return is the exit status (the
    ``__main__`` copy of the module must not go on to its own imports)."""
    allocator.restart_with_tcmalloc()
    before_backend(sys.argv)
    sys.exit(getattr(importlib.import_module(module), entry)())
