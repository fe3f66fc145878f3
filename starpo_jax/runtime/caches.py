"""What starpo-jax keeps on disk to start faster: compiled programs and tokenizers read from GGUF.

Both are rebuilt from their sources when missing, and neither changes a result.

- ``jax/``: JAX's persistent compilation cache. A process that compiles a program XLA has compiled
  before (same program, shapes, devices, flags and jax version; jax's cache key) loads the executable
  from disk instead of compiling it again: the second ``python -m experiments.run --config
  configs/quickstart.py`` skips most of its compile time. Every program is cached, however small.
  A cached executable runs the same machine code as the freshly compiled one, so results are bit for
  bit the same (``tests/test_caches.py``). jax keys entries by platform and its version; XLA:CPU
  refuses (and recompiles) an entry compiled for CPU features the host lacks.
- ``tokenizers/``: a GGUF file's tokenizer as transformers builds it, saved as a tokenizer folder.
  transformers parses the file's ~100,000 vocabulary and merge entries in Python, seconds per
  process; loading the saved folder takes a fraction of a second. Keyed by the file's path, size and modification time and transformers' version
  (``models.loading.gguf_tokenizer``).

One setting, the environment variable ``STARPO_JAX_CACHE``:

- unset or empty: the caches live in ``$XDG_CACHE_HOME/starpo-jax`` (``~/.cache/starpo-jax``);
- a path: they live there;
- ``off`` (or ``0``, ``false``, ``no``): no cache; every process compiles its programs and builds
  its tokenizers.

An environment variable rather than a config key because ``evaluate`` has no config and the cache
must be set before the first compile. ``setup_compilation_cache`` is called by every command that
compiles (``experiments.run``, ``sweep``, ``evaluate``) before anything compiles. The benchmarks
and ``experiments.plan`` do not call it: they report compile seconds or read compiled programs,
which a cache hit would turn into the cost of loading a file.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax

from starpo_jax.runtime.switches import is_off

ENV = "STARPO_JAX_CACHE"


def cache_root(environ=None) -> Path | None:
    """The folder of starpo-jax's caches under ``environ`` (default ``os.environ``), or None when off."""
    environ = os.environ if environ is None else environ
    value = environ.get(ENV, "").strip()
    if is_off(value):
        return None
    if value:
        return Path(value).expanduser()
    return Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "starpo-jax"


def compilation_cache_dir(environ=None) -> Path | None:
    """The folder of JAX's persistent compilation cache, or None when the caches are off."""
    root = cache_root(environ)
    return None if root is None else root / "jax"


def tokenizer_cache_dir(environ=None) -> Path | None:
    """The folder of the tokenizers built from GGUF files, or None when the caches are off."""
    root = cache_root(environ)
    return None if root is None else root / "tokenizers"


def setup_compilation_cache(environ=None) -> Path | None:
    """Point JAX's persistent compilation cache at ``compilation_cache_dir`` (or turn it off); call
    before the first compile. Returns the folder, or None when off."""
    path = compilation_cache_dir(environ)
    if path is None:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    # Cache every program: the tiny ones of a CPU run too (jax's defaults skip those under 1 s).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # no minimum size, and no override
    return path
