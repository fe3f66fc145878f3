"""The suite's own XLA flags (helpers.XLA_TEST_FLAGS): only flags the installed jaxlib knows reach
XLA, which aborts a process on an unknown one."""

import subprocess
import sys

from helpers import REPO, XLA_TEST_FLAGS, _known_to_jaxlib, command_env


def test_flags_unknown_to_jaxlib_are_left_out():
    known = "--xla_backend_optimization_level=0"  # in every XLA since its first release
    assert _known_to_jaxlib(["--xla_no_such_flag=true", known, "--xla_backend_optimization"]) == known
    assert known in XLA_TEST_FLAGS


def test_a_command_starts_with_the_suites_flags():
    env = command_env()
    assert env["XLA_FLAGS"] == XLA_TEST_FLAGS
    proc = subprocess.run([sys.executable, "-c", "import jax; print(jax.numpy.ones(2).sum())"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "2.0", proc.stderr[-2000:]
