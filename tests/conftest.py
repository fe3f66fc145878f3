import atexit
import os
import shutil
import tempfile

from helpers import simulated_devices  # noqa: E402 (imports no jax)

# Tests run on CPU with deterministic float32 math, on one device, compiled as helpers.py says.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", simulated_devices(1)["XLA_FLAGS"])

# One cache folder for the session (starpo_jax/runtime/caches.py): a program one test process compiled, or
# a tokenizer it read from GGUF, is loaded, not built again, by the next. The suite's own folder,
# removed at exit, unless STARPO_JAX_CACHE names one already. jax's own variables too, so that
# `python -c` scripts and the pytest process itself use it (set before jax is imported).
from starpo_jax.runtime import caches  # noqa: E402 (imports no jax)

if not os.environ.get(caches.ENV):
    _cache = tempfile.mkdtemp(prefix="starpo-jax-test-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ[caches.ENV] = _cache
if caches.compilation_cache_dir() is not None:
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(caches.compilation_cache_dir()))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import pytest
import torch

# torch is only the parity oracle; one thread keeps it from fighting JAX for the two CI cores
# (measured: 16x slower reference generate with 2 threads under load).
torch.set_num_threads(1)

from starpo_jax.models import bundled  # noqa: E402 (after torch's thread setting)


def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per core, as many as the host's memory holds at ~8 GiB each (the
    largest tests start a run of the real 135M model beside the worker). Most of a test's time is
    one thread tracing, compiling or starting a process, so two workers on the 2-core CI machine
    finish sooner than one."""
    from starpo_jax.runtime.host_memory import available_bytes

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    available = available_bytes()
    return cores if available is None else max(1, min(cores, available // (8 * 2**30)))


# The files that take longest (the per-file seconds printed after a run: minutes each on 2 cores),
# longest first, started first: a long file started last would leave the other worker idle at the end.
LONGEST_FIRST = ("test_run.py", "test_any_mesh.py", "test_readme.py", "test_train.py", "test_batches.py",
                 "test_report.py", "test_rollout.py", "envs/test_countdown.py", "test_interrupt.py", "test_sharding.py",
                 "test_bench_step.py", "models/test_gguf.py")


def pytest_configure(config):
    # Workers take files in collection order only if xdist keeps it: from 3.6 on it sends the files
    # with the most tests first unless told not to, which started the long files, of few tests, last.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    def rank(item):
        path = item.path.as_posix()
        return next((i for i, name in enumerate(LONGEST_FIRST) if path.endswith("tests/" + name)), len(LONGEST_FIRST))

    items.sort(key=rank)  # stable: each file's tests keep their order


# Seconds per test file (setup, call and teardown of its tests, module fixtures included), summed
# over the reports the workers send back, and printed after the run: where the suite's time goes,
# and which files LONGEST_FIRST should name.
FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    file = report.nodeid.split("::")[0]
    FILE_SECONDS[file] = FILE_SECONDS.get(file, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not FILE_SECONDS or hasattr(terminalreporter.config, "workerinput"):
        return
    longest = sorted(FILE_SECONDS.items(), key=lambda kv: -kv[1])[:15]
    terminalreporter.write_sep("=", f"slowest test files (of {len(FILE_SECONDS)}, {sum(FILE_SECONDS.values()):.0f} s "
                                    "in all, summed over the workers)")
    for file, seconds in longest:
        terminalreporter.write_line(f"{seconds:8.1f} s  {file}")


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return bundled.qwen_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from starpo_jax.models.loading import smollm2_tokenizer as bundled_smollm2

    return bundled_smollm2()


@pytest.fixture(scope="session")
def full_run(tmp_path_factory):
    """``helpers.TINY``'s run (two steps, validation at 0 and 2, checkpoints, export) with
    ``helpers.FULL_RUN``'s validation, started once for every test that only reads its folder; tests
    that change a run copy it first."""
    from helpers import FULL_RUN, run

    out = tmp_path_factory.mktemp("full")
    proc = run(*FULL_RUN, f"--config.trainer.output_dir={out}")
    (out / "stderr.txt").write_text(proc.stderr)  # what a log file of the run holds (test_run.py)
    return out
