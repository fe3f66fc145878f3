import atexit
import os
import shutil
import tempfile

from helpers import simulated_devices  # noqa: E402 (imports no jax)

# Tests run on CPU with deterministic float32 math, on one device, compiled as helpers.py says.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", simulated_devices(1)["XLA_FLAGS"])

# One cache folder for the session (starpo_jax/caches.py): a program one test process compiled, or
# a tokenizer it read from GGUF, is loaded, not built again, by the next. The suite's own folder,
# removed at exit, unless STARPO_JAX_CACHE names one already. jax's own variables too, so that
# `python -c` scripts and the pytest process itself use it (set before jax is imported).
from starpo_jax import caches  # noqa: E402 (imports no jax)

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

from starpo_jax import bundled


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return bundled.qwen_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return bundled.smollm2_tokenizer()


@pytest.fixture(scope="session")
def full_run(tmp_path_factory):
    """``helpers.TINY``'s run (two steps, validation at 0 and 2, checkpoints, export), started once
    for every test that only reads its folder; tests that change a run copy it first."""
    from helpers import run

    out = tmp_path_factory.mktemp("full")
    run(f"--config.trainer.output_dir={out}")
    return out
