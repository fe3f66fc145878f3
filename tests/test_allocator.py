"""The commands' restart on tcmalloc (starpo_jax/runtime/allocator.py).

The restart is tested end to end with a stand-in library built here under tcmalloc's file name (an
empty shared object: the machine need not have tcmalloc), so that the test sees the process replaced
by one that has the library mapped, its command line unchanged, and no second restart."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from experiments import bootstrap
from starpo_jax.models import cpu_kernels
from starpo_jax.runtime import allocator


def test_library_is_found_in_the_first_folder_that_has_it(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    second.mkdir()
    (second / allocator.LIBRARY).write_bytes(b"")
    assert allocator.library([first, second]) == second / allocator.LIBRARY
    assert allocator.library([first]) is None


def test_loaded_reads_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert not allocator.loaded(maps)
    maps.write_text(maps.read_text() + "7f02-7f03 r-xp 0 08:01 2 /usr/lib/libtcmalloc_minimal.so.4.5.10\n")
    assert allocator.loaded(maps)
    assert not allocator.loaded(tmp_path / "missing")


def test_preloaded_environment_puts_the_library_first_once():
    path = Path("/lib/libtcmalloc_minimal.so.4")
    env = allocator.preloaded_environment({"LD_PRELOAD": "/x/a.so:/x/b.so", "HOME": "/h"}, path)
    assert env is not None
    assert env["LD_PRELOAD"] == f"{path} /x/a.so /x/b.so" and env["HOME"] == "/h"
    assert env["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == str(1 << 50)
    # already preloaded (and so, had it worked, loaded): no second restart
    assert allocator.preloaded_environment(env, path) is None
    # a threshold the user chose is kept
    mine = allocator.preloaded_environment({"TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD": "10"}, path)
    assert mine is not None and mine["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] == "10"
    # free pages are kept, unless the user asks tcmalloc to give them back
    assert env[allocator.RELEASE_RATE] == "0"
    mine = allocator.preloaded_environment({allocator.RELEASE_RATE: "1"}, path)
    assert mine is not None and mine[allocator.RELEASE_RATE] == "1"


def test_the_heap_limit_is_the_available_memory_less_what_tcmalloc_does_not_count():
    path = Path("/lib/libtcmalloc_minimal.so.4")
    env = allocator.preloaded_environment({}, path, available=20 * 2**30)
    assert env is not None and int(env[allocator.HEAP_LIMIT]) * 2**20 == 20 * 2**30 - allocator.UNCOUNTED
    assert allocator.HEAP_LIMIT not in (allocator.preloaded_environment({}, path) or {})  # unknown: no limit
    assert allocator.heap_limit(2 * allocator.UNCOUNTED - 1) == {}  # too little to limit
    mine = allocator.preloaded_environment({allocator.HEAP_LIMIT: "0"}, path, available=20 * 2**30)
    assert mine is not None and mine[allocator.HEAP_LIMIT] == "0"  # the user's (0: none) is kept


def test_current_heap_limit_is_the_environment_s_where_tcmalloc_runs(monkeypatch):
    monkeypatch.setattr(allocator, "loaded", lambda: True)
    assert allocator.current_heap_limit({allocator.HEAP_LIMIT: "21893"}) == 21893
    assert allocator.current_heap_limit({allocator.HEAP_LIMIT: "0"}) is None  # 0: no limit
    assert allocator.current_heap_limit({}) is None
    monkeypatch.setattr(allocator, "loaded", lambda: False)  # glibc's malloc reads no such variable
    assert allocator.current_heap_limit({allocator.HEAP_LIMIT: "21893"}) is None


LIMITED = """
    import numpy as np
    try:
        np.ones(300 * 2**20 // 8)
        print("allocated")
    except MemoryError:
        print("refused")
"""


@pytest.mark.skipif(allocator.library() is None, reason="tcmalloc is not installed")
def test_tcmalloc_honours_the_heap_limit_s_variable():
    """The limit is an environment variable only the library reads: a misspelt name would change
    nothing, silently. A 300 MB array within a 200 MiB limit is refused, without it allocated."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.HEAP_LIMIT)}

    def outcome(**extra) -> str:
        env_ = {**env, "LD_PRELOAD": str(allocator.library()), **extra}
        return subprocess.run([sys.executable, "-c", textwrap.dedent(LIMITED)], capture_output=True, text=True,
                              env=env_, timeout=120, check=True).stdout.strip()

    assert outcome(**{allocator.HEAP_LIMIT: "200"}) == "refused"
    assert outcome() == "allocated"


RELEASED = """
    import ctypes
    import numpy as np
    for mib in range(100, 300, 10):  # each block larger than the last: none fits in a freed one
        np.ones(mib * 2**20, np.uint8)
    given_back = ctypes.c_size_t(0)
    ctypes.CDLL(None).MallocExtension_GetNumericProperty(b"tcmalloc.pageheap_unmapped_bytes",
                                                         ctypes.byref(given_back))
    print(given_back.value)
"""


@pytest.mark.skipif(allocator.library() is None, reason="tcmalloc is not installed")
def test_tcmalloc_keeps_its_free_pages_under_the_commands_settings():
    """Pages tcmalloc has given back do not merge with free pages it kept (module docstring). Under
    the restart's settings it gives none back while it allocates and frees 20 growing blocks; under
    its own default release rate it does (so the variable's name is the one the library reads)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TCMALLOC_") and k != "LD_PRELOAD"}
    path = allocator.library()
    assert path is not None

    def given_back(environ: dict[str, str]) -> int:
        return int(subprocess.run([sys.executable, "-c", textwrap.dedent(RELEASED)], capture_output=True, text=True,
                                  env=environ, timeout=120, check=True).stdout)

    commands = allocator.preloaded_environment(env, path)
    assert commands is not None
    assert given_back(commands) == 0
    assert given_back({**commands, allocator.RELEASE_RATE: "1"}) > 0


@pytest.mark.parametrize("value, on", [("", True), ("on", True), ("off", False), ("0", False), (" False ", False),
                                       ("no", False)])
def test_the_switch(value, on):
    assert allocator.enabled({allocator.ENV: value}) is on
    assert cpu_kernels.enabled({cpu_kernels.ENV: value}) is on  # one parse for every switch
    assert allocator.enabled({}) is True  # unset: on


def test_the_restart_comes_before_any_heavy_import():
    """The restart replaces the process: whatever a command imported before it is imported twice.
    ``experiments.bootstrap`` and ``allocator`` must not import jax (seconds of start-up)."""
    code = "import sys, experiments.bootstrap; print(sorted(m for m in ('jax', 'numpy') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stdout
    assert out.strip() == "[]"


SCRIPT = """
    import json, os, sys
    from starpo_jax.runtime import allocator
    print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "loaded": allocator.loaded(),
                      "preload": os.environ.get("LD_PRELOAD", ""),
                      "heap_limit": os.environ.get("TCMALLOC_HEAP_LIMIT_MB"),
                      "release_rate": os.environ.get("TCMALLOC_RELEASE_RATE")}), flush=True)
    allocator.restart_with_tcmalloc(dirs=[sys.argv[1]])
    print("went on", flush=True)
"""


def run_script(tmp_path, folder, **env):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(SCRIPT))
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", allocator.ENV, allocator.HEAP_LIMIT,
                                                                  allocator.RELEASE_RATE)}
    root = str(Path(__file__).parents[1])  # this checkout's packages, whichever the venv installed
    done = subprocess.run([sys.executable, str(script), str(folder), "--flag", "x y"], capture_output=True, text=True,
                          timeout=120, env={**environ, "PYTHONPATH": root, **env})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    return [json.loads(line) for line in lines if line.startswith("{")], lines[-1]


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory):
    """A folder holding an empty shared library under tcmalloc's file name."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the stand-in library")
    folder = tmp_path_factory.mktemp("lib")
    source = folder / "empty.c"
    source.write_text("int starpo_stand_in;\n")
    subprocess.run([compiler, "-shared", "-fPIC", str(source), "-o", str(folder / allocator.LIBRARY)], check=True,
                   timeout=120)
    return folder


def test_a_command_restarts_once_with_the_library_preloaded(tmp_path, stand_in):
    (before, after), last = run_script(tmp_path, stand_in)
    assert not before["loaded"] and after["loaded"]
    assert after["pid"] == before["pid"]  # the same process, replaced (exec), not a child
    assert after["argv"] == before["argv"] == [str(stand_in), "--flag", "x y"]
    assert after["preload"].split()[0] == str(stand_in / allocator.LIBRARY)
    assert int(after["heap_limit"]) > 0  # this host's /proc/meminfo, less what tcmalloc does not count
    assert before["release_rate"] is None and after["release_rate"] == "0"
    assert last == "went on"


def test_switched_off_or_missing_the_command_goes_on_unchanged(tmp_path, stand_in):
    (only,), last = run_script(tmp_path, stand_in, **{allocator.ENV: "off"})
    assert not only["loaded"] and last == "went on"
    (only,), last = run_script(tmp_path, tmp_path / "no-such-folder")
    assert not only["loaded"] and last == "went on"


def test_bootstrap_restarts_before_anything_else(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "restart_with_tcmalloc", lambda: calls.append("restart"))
    monkeypatch.setattr(bootstrap.importlib, "import_module",
                        lambda name: type("Command", (), {"run": staticmethod(lambda: calls.append(name))}))
    with pytest.raises(SystemExit) as stopped:
        bootstrap.command("experiments.somewhere", lambda argv: calls.append("before backend"))
    assert calls == ["restart", "before backend", "experiments.somewhere"]
    assert stopped.value.code is None  # run() returned None: exit status 0


def test_bootstrap_exits_with_the_entry_s_status(monkeypatch):
    monkeypatch.setattr(allocator, "restart_with_tcmalloc", lambda: None)
    monkeypatch.setattr(bootstrap.importlib, "import_module",
                        lambda name: type("Command", (), {"main": staticmethod(lambda: 3)}))
    with pytest.raises(SystemExit) as stopped:
        bootstrap.command("experiments.somewhere", bootstrap.run_nothing_first, entry="main")
    assert stopped.value.code == 3


def test_a_benchmark_s_machine_names_the_allocator_and_its_settings(monkeypatch):
    from experiments.bench import common

    monkeypatch.setattr(allocator, "loaded", lambda: True)
    monkeypatch.setenv(allocator.HEAP_LIMIT, "1234")
    monkeypatch.setenv(allocator.RELEASE_RATE, "0")
    machine = common.machine()
    assert machine["allocator"] == "tcmalloc" and machine["heap_limit_mib"] == 1234
    assert machine["tcmalloc_release_rate"] == "0"
    monkeypatch.setattr(allocator, "loaded", lambda: False)
    machine = common.machine()
    assert machine["allocator"] == "glibc's malloc" and machine["heap_limit_mib"] is None
    assert machine["tcmalloc_release_rate"] is None
