"""Many hosts start before anything touches a device: every command that reads ``distributed.*``
joins the other processes (``jax.distributed.initialize``) while XLA's backend is still
uninitialised, whatever its imports do, and no module of ours builds arrays at import time."""

import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, TINY, command_env, run

DISTRIBUTED = ["--config.distributed.coordinator_address=localhost:1", "--config.distributed.num_processes=2",
               "--config.distributed.process_id=0"]


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=command_env(devices=1))


@pytest.mark.parametrize("module", ["experiments.run", "experiments.sweep"])
def test_commands_join_the_processes_before_the_backend_starts(module):
    """The command runs up to ``jax.distributed.initialize`` (stood in for: no coordinator is
    listening), which must find no backend yet and get the command line's settings."""
    proc = _python(f"""
        import runpy, sys
        import jax
        from jax._src import xla_bridge

        def initialize(**settings):
            print("backend started:", bool(xla_bridge._backends), "settings:", sorted(settings.items()))
            sys.exit(0)

        jax.distributed.initialize = initialize
        sys.argv = ["{module}", *{TINY + DISTRIBUTED!r}]
        runpy.run_module("{module}", run_name="__main__")
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == (
        "backend started: False settings: [('coordinator_address', 'localhost:1'), ('num_processes', 2), "
        "('process_id', 0)]")


def test_no_module_of_ours_builds_arrays_at_import():
    """Arrays made at import initialise the backend; jumanji's own (StepType) are counted first."""
    proc = _python("""
        import gc, importlib, pkgutil
        import jax, jumanji

        def arrays():
            gc.collect()
            return len(jax.live_arrays())

        before, builders = arrays(), []
        for package in ("starpo_jax", "envs_jax", "configs", "experiments"):
            names = [package, *(m.name for m in pkgutil.walk_packages(importlib.import_module(package).__path__,
                                                                      package + "."))]
            for name in names:
                if name in ("experiments.run", "experiments.sweep"):  # define --config as plan does
                    continue
                importlib.import_module(name)
                if arrays() > before:
                    builders.append(name)
                    before = arrays()
        print("modules that built arrays:", builders)
    """)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "modules that built arrays: []"


def test_distributed_value_of_the_wrong_type_is_one_line(tmp_path):
    proc = run(f"--config.trainer.output_dir={tmp_path}", "--config.distributed.num_processes=two", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "error: --config.distributed.num_processes must be a whole number, not 'two'."


@pytest.mark.parametrize("module, args", [("experiments.run", []), ("experiments.sweep", ["--sweep", "actor.lr=0,1"])])
def test_a_config_file_cannot_set_distributed(tmp_path, module, args):
    """Read after the runtime started, a config file's ``distributed`` would be ignored: refused."""
    config = tmp_path / "cluster.py"
    config.write_text("from configs import base\n\n\ndef get_config():\n    c = base.get_config()\n"
                      "    c.distributed.num_processes = 4\n    return c\n")
    proc = run(f"--config={config}", f"--config.trainer.output_dir={tmp_path / 'out'}", *args, module=module,
               tiny=False, check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: the config file sets distributed.num_processes, which is read before any config file: "
        "set it on the command line (--config.distributed.num_processes=...).")
    assert not (tmp_path / "out").exists()
