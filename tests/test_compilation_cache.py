"""The persistent compilation cache (starpo_jax/compilation_cache.py): where it lives, that a
program loaded from it computes bit for bit what the compiled one did, and that it turns off."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import REPO, command_env

from starpo_jax.compilation_cache import cache_dir

# A program with matmuls, transcendental functions, a reduction and random numbers; prints its
# outputs' bytes and whether jax loaded it from the cache.
SCRIPT = """
import json, logging
from starpo_jax.compilation_cache import setup_compilation_cache
path = setup_compilation_cache()
import jax, jax.numpy as jnp
hits = []
class Hits(logging.Handler):
    def emit(self, record):
        if "cache hit" in record.getMessage():
            hits.append(record.getMessage())
logger = logging.getLogger("jax._src.compiler")
logger.setLevel(logging.DEBUG)
logger.addHandler(Hits())

@jax.jit
def f(key, x):
    w = jax.random.normal(key, (64, 64))
    h = jnp.tanh(x @ w) * jax.nn.softmax(x @ w.T, axis=-1)
    return h, jnp.log1p(jnp.exp(h)).sum(axis=0), jnp.cumsum(h, axis=1)[:, -1]

x = jnp.linspace(-2.0, 2.0, 32 * 64, dtype=jnp.float32).reshape(32, 64)
out = jax.device_get(f(jax.random.PRNGKey(7), x))
print(json.dumps({"path": str(path) if path else None, "bytes": [a.tobytes().hex() for a in out],
                  "f_hit": any("jit_f" in m for m in hits)}))
"""


def run_script(cache: str, **extra: str) -> dict:
    env = command_env(STARPO_JAX_COMPILATION_CACHE=cache, **extra)
    env = {k: v for k, v in env.items() if not k.startswith("JAX_COMPILATION") and not k.startswith("JAX_PERSISTENT")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cached_program_gives_the_compiled_programs_results_bit_for_bit(tmp_path):
    cache = tmp_path / "cache"
    first = run_script(str(cache))
    assert first["path"] == str(cache) and not first["f_hit"]
    assert any(p.name.startswith("jit_f-") for p in cache.iterdir())  # tiny programs are cached too
    second = run_script(str(cache))
    assert second["f_hit"]  # loaded, not compiled
    assert second["bytes"] == first["bytes"]


def test_off_writes_nothing_and_compiles(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    for off in ("off", "0", "false", "no"):
        assert cache_dir({"STARPO_JAX_COMPILATION_CACHE": off, "HOME": str(home)}) is None
    result = run_script("off", HOME=str(home))
    assert result["path"] is None and not result["f_hit"]
    assert list(home.iterdir()) == []  # no ~/.cache/starpo-jax
    assert result["bytes"] == run_script(str(tmp_path / "cache"))["bytes"]


def test_cache_folder_by_default_and_by_setting(tmp_path):
    assert cache_dir({"HOME": "/h"}) == Path.home() / ".cache" / "starpo-jax" / "jax"
    assert cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/starpo-jax/jax")
    assert cache_dir({"STARPO_JAX_COMPILATION_CACHE": str(tmp_path)}) == tmp_path
    assert cache_dir({"STARPO_JAX_COMPILATION_CACHE": "OFF"}) is None
