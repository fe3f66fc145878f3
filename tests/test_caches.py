"""The caches (starpo_jax/runtime/caches.py): where they live, that a program loaded from the compilation
cache computes bit for bit what the compiled one did, that a GGUF file's tokenizer loaded from the
tokenizer cache is the one transformers builds from the file, and that they turn off."""

import json
import subprocess
import sys
from pathlib import Path

from helpers import REPO, command_env
from starpo_jax.runtime.caches import cache_root, compilation_cache_dir, tokenizer_cache_dir

# A program with matmuls, transcendental functions, a reduction and random numbers; prints its
# outputs' bytes and whether jax loaded it from the cache.
SCRIPT = """
import json, logging
from starpo_jax.runtime.caches import setup_compilation_cache
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
    env = command_env() | {"STARPO_JAX_CACHE": cache} | extra
    env = {k: v for k, v in env.items() if not k.startswith("JAX_COMPILATION") and not k.startswith("JAX_PERSISTENT")}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_cached_program_gives_the_compiled_programs_results_bit_for_bit(tmp_path):
    cache = tmp_path / "cache"
    first = run_script(str(cache))
    assert first["path"] == str(cache / "jax") and not first["f_hit"]
    assert any(p.name.startswith("jit_f-") for p in (cache / "jax").iterdir())  # tiny programs are cached too
    second = run_script(str(cache))
    assert second["f_hit"]  # loaded, not compiled
    assert second["bytes"] == first["bytes"]


def test_off_writes_nothing_and_compiles(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    for off in ("off", "0", "false", "no"):
        environ = {"STARPO_JAX_CACHE": off, "HOME": str(home)}
        assert cache_root(environ) is compilation_cache_dir(environ) is tokenizer_cache_dir(environ) is None
    result = run_script("off", HOME=str(home))
    assert result["path"] is None and not result["f_hit"]
    assert list(home.iterdir()) == []  # no ~/.cache/starpo-jax
    assert result["bytes"] == run_script(str(tmp_path / "cache"))["bytes"]


def test_cache_folder_by_default_and_by_setting(tmp_path):
    assert compilation_cache_dir({"HOME": "/h"}) == Path.home() / ".cache" / "starpo-jax" / "jax"
    assert tokenizer_cache_dir({"XDG_CACHE_HOME": "/x"}) == Path("/x/starpo-jax/tokenizers")
    assert compilation_cache_dir({"STARPO_JAX_CACHE": str(tmp_path)}) == tmp_path / "jax"
    assert cache_root({"STARPO_JAX_CACHE": "OFF"}) is None


def test_a_gguf_tokenizer_loaded_from_the_cache_is_the_one_built_from_the_file(tmp_path, monkeypatch):
    from starpo_jax.models import bundled
    from starpo_jax.models.loading import gguf_tokenizer

    monkeypatch.setenv("STARPO_JAX_CACHE", str(tmp_path))
    path = bundled.smollm2_gguf_path()
    built = gguf_tokenizer(path)  # transformers' tokenizer from the GGUF metadata, saved in the cache
    [saved] = (tmp_path / "tokenizers").iterdir()
    cached = gguf_tokenizer(path)
    assert cached.name_or_path == str(saved) and built.name_or_path != str(saved)
    assert type(cached) is type(built)  # loaded by the class transformers built (not through AutoTokenizer)

    messages = [{"role": "system", "content": "You're a helpful assistant."},
                {"role": "user", "content": "Sokoban:\n#####\n#_PX#\n<answer>Up || Left</answer> ü 日本 🙂"},
                {"role": "assistant", "content": "<think>push</think><answer>Right</answer>"}]
    texts = [built.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
             "  spaces\tand\nnewlines  ", "<|im_start|>user<|im_end|>", "Ärger über Übermaß, 123456789"]
    for attribute in ("chat_template", "eos_token_id", "bos_token_id", "pad_token_id", "all_special_ids"):
        assert getattr(cached, attribute) == getattr(built, attribute), attribute
    assert cached.get_vocab() == built.get_vocab()
    assert cached.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == texts[0]
    assert [cached.encode(t) for t in texts] == [built.encode(t) for t in texts]

    (saved / "tokenizer.json").write_text("{not json")  # damaged: built again from the file, and saved
    rebuilt = gguf_tokenizer(path)
    assert rebuilt.name_or_path != str(saved) and rebuilt.encode(texts[0]) == built.encode(texts[0])
    assert gguf_tokenizer(path).name_or_path == str(saved)
