"""Commands restart once with their memory in huge pages (``starpo_jax.runtime.huge_pages``)."""

import json
import os
import subprocess
import sys

import pytest

from helpers import REPO, command_env
from starpo_jax.runtime import huge_pages

COMMAND = [sys.executable, "-m", "experiments.run", "--config", "configs/quickstart.py"]


class Restarted(Exception):
    pass


@pytest.fixture
def restarts(monkeypatch):
    """What ``os.execve`` was asked to run (it raises instead of replacing the test process), on a
    host where nothing argues against huge pages."""
    calls = []

    def execve(path, args, env):
        calls.append((path, args, env))
        raise Restarted

    monkeypatch.setattr(os, "execve", execve)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.setattr(sys, "orig_argv", COMMAND)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    monkeypatch.setattr(huge_pages, "glibc_version", lambda: (2, 36))
    return calls


def test_a_command_restarts_itself_with_the_tunable_and_nothing_else_changed(restarts, monkeypatch):
    monkeypatch.setenv("STARPO_JAX_PROBE", "kept")
    with pytest.raises(Restarted):
        huge_pages.restart_with_huge_pages()
    [(path, args, env)] = restarts
    assert path == sys.executable and args == [sys.executable, *COMMAND[1:]]
    assert env == {**os.environ, "GLIBC_TUNABLES": huge_pages.TUNABLE} and env["STARPO_JAX_PROBE"] == "kept"


@pytest.mark.parametrize("case", ["tunables set", "opted out", "thp always", "thp never", "no thp", "old glibc",
                                  "not glibc", "pytest", "a script"])
def test_no_restart_where_it_cannot_help_or_was_not_asked_for(restarts, monkeypatch, case):
    change = {
        "tunables set": lambda: monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),
        "opted out": lambda: monkeypatch.setenv("GLIBC_TUNABLES", ""),
        "thp always": lambda: monkeypatch.setattr(huge_pages, "thp_mode", lambda: "always"),
        "thp never": lambda: monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never"),
        "no thp": lambda: monkeypatch.setattr(huge_pages, "thp_mode", lambda: None),
        "old glibc": lambda: monkeypatch.setattr(huge_pages, "glibc_version", lambda: (2, 34)),
        "not glibc": lambda: monkeypatch.setattr(huge_pages, "glibc_version", lambda: None),
        "pytest": lambda: monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-m", "pytest", "-q"]),
        "a script": lambda: monkeypatch.setattr(sys, "orig_argv", [sys.executable, "-c", "import experiments"]),
    }[case]
    change()
    huge_pages.restart_with_huge_pages()
    assert restarts == []
    assert (huge_pages.why_not() is None) == (case in ("pytest", "a script"))


def test_the_mode_is_the_bracketed_word(tmp_path, monkeypatch):
    mode = tmp_path / "enabled"
    mode.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", str(mode))
    assert huge_pages.thp_mode() == "madvise"
    monkeypatch.setattr(huge_pages, "THP_MODE", str(tmp_path / "missing"))
    assert huge_pages.thp_mode() is None


def test_a_benchmark_records_whether_its_process_restarted_with_huge_pages(tmp_path, monkeypatch):
    """Through the real restart: a command started without the tunable runs with it where the host
    allows (glibc 2.35+, transparent huge pages on request), and an empty ``GLIBC_TUNABLES`` opts out."""
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    expected = huge_pages.why_not() is None
    extras: list[tuple[dict[str, str], bool]] = [({}, expected), ({"GLIBC_TUNABLES": ""}, False)]
    for extra, on in extras:
        out = tmp_path / f"ceilings_{on}.json"
        proc = subprocess.run([sys.executable, "-m", "experiments.bench.ceilings", "--quick", "--size", "32",
                               "--copy-mib", "1", "--repeats", "1", "--out", str(out)],
                              cwd=REPO, capture_output=True, text=True, timeout=300, env=command_env(None, **extra))
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert json.loads(out.read_text())["machine"]["huge_pages"] is on
