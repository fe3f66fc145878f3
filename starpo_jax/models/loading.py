"""Load the policy model and its tokenizer from anything a user is likely to hold, and save it back
as a Hugging Face checkpoint folder that transformers and vLLM read.

``load_model(source)`` accepts
- ``"smollm2-135m-instruct"``: the bundled SmolLM2 GGUF (works offline; the default model);
- a path to a ``.gguf`` file (llama / qwen2 architectures, any type ``gguf`` dequantises);
- a local Hugging Face folder: ``config.json`` + ``model.safetensors`` (or a sharded
  ``model.safetensors.index.json``) + tokenizer files;
- a hub id such as ``"Qwen/Qwen2.5-0.5B-Instruct"``, fetched with ``huggingface_hub``.

Every source is first turned into the same thing: an HF config dict and numpy tensors under
transformers' names and layouts. ``decoder_from_hf_tensors`` builds the JAX model from that, so
there is one weight-mapping path for all formats. Anything wrong with the input is a
``ModelLoadError`` naming the file or tensor. Nothing is cached on disk except what
``huggingface_hub`` itself caches for hub downloads.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Iterator

import ml_dtypes  # also registers numpy's "bfloat16", which safetensors' numpy reader needs
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from starpo_jax.models import bundled
from starpo_jax.models.config import ModelConfig
from starpo_jax.models.errors import ModelLoadError
from starpo_jax.models.gguf_reader import open_gguf, read_gguf
from starpo_jax.models.hf_tensors import decoder_from_hf_tensors, decoder_to_hf_tensors
from starpo_jax.runtime.caches import tokenizer_cache_dir

HUB_FILE_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                     "tokenizer*", "vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                     "chat_template.jinja", "chat_template.json"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_SOURCES_HINT = (f"pass a local checkpoint folder, a .gguf file, or {bundled.SMOLLM2_NAME!r} "
                 "(the bundled model, which needs no network)")


def load_model(source: str | os.PathLike = bundled.SMOLLM2_NAME, dtype: str = "float32",
               param_dtype: str | None = None, **compute):
    """``(Decoder, tokenizer)`` from a bundled name, GGUF file, local HF folder or hub id.

    ``dtype`` is the compute dtype ("float32" or "bfloat16"); ``param_dtype`` the dtype the weights
    are kept in (default: ``dtype``); ``compute`` other ``ModelConfig`` fields that are not the
    checkpoint's (``remat``). For a folder, the config and tokenizer are checked before any
    weight is read, so a wrong checkpoint fails fast.
    """
    kind, path = resolve_source(source)
    dtypes = {"dtype": dtype, "param_dtype": param_dtype or dtype, **compute}
    if kind == "gguf":
        hf_config, tensors = read_gguf(path)
        config = model_config(hf_config, path, **dtypes)
        tokenizer = load_tokenizer(path)
    else:
        config = model_config(read_hf_config(path), path / "config.json", **dtypes)
        tokenizer = load_tokenizer(path)
        tensors = read_safetensors(path)
    model = build_decoder(config, tensors, path)
    del tensors
    release_freed_memory()
    return model, tokenizer


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``). Reading a checkpoint frees
    its float32 tensors in pieces below glibc's mmap threshold, which glibc would otherwise keep for
    the process: most of a checkpoint's size stays resident for nothing (docs/scaling.md, "On a CPU
    host"). Nothing off glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def model_config(hf_config: dict, origin: Path, **overrides):
    """``ModelConfig`` from an HF config dict; an unsupported model names the file it came from."""
    try:
        return ModelConfig.from_hf_config(hf_config, **overrides)
    except (ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{origin}: unsupported model config ({err}).") from err


def build_decoder(config, tensors: dict[str, np.ndarray], origin: Path):
    """``decoder_from_hf_tensors``, with the checkpoint named in its errors (missing or misshapen tensors)."""
    try:
        return decoder_from_hf_tensors(config, tensors)
    except (ValueError, KeyError) as err:
        raise ModelLoadError(f"{origin}: {err}") from err


def resolve_source(source: str | os.PathLike) -> tuple[str, Path]:
    """``("gguf", file)`` or ``("folder", dir)``; hub ids are downloaded to a local folder here."""
    if str(source) == bundled.SMOLLM2_NAME:
        return "gguf", bundled.smollm2_gguf_path()
    path = Path(source).expanduser()
    if path.is_dir():
        return "folder", path
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf file; {_SOURCES_HINT}.")
        return "gguf", path
    if path.suffix.lower() == ".gguf" or not _HUB_ID.match(str(source)) or _looks_local(str(source)):
        raise ModelLoadError(f"No checkpoint folder or GGUF file exists at {path}; {_SOURCES_HINT}.")
    return "folder", download_from_hub(str(source))


def _looks_local(source: str) -> bool:
    """``runs/x`` where ``runs`` is a local folder is a path on this machine, not a hub id."""
    return Path(source).parent.is_dir()


def hf_name(source: str | os.PathLike) -> str | None:
    """The name a Hugging Face client (transformers, peft, vLLM) resolves to ``source``'s weights:
    a local folder's absolute path or a hub id; None for a GGUF file or the bundled model."""
    if str(source) == bundled.SMOLLM2_NAME:
        return None
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path.absolute())
    if path.exists() or path.suffix.lower() == ".gguf" or path.is_absolute() or not _HUB_ID.match(str(source)):
        return None
    return str(source)


def download_from_hub(repo_id: str) -> Path:
    """Snapshot of the config, safetensors and tokenizer files of a hub repo (cached by
    huggingface_hub). Honours ``HF_HUB_OFFLINE`` as set now, not only at import time, and fails
    fast with one message when the hub cannot be reached."""
    from huggingface_hub import constants, snapshot_download  # here: only a hub id needs it, and it is slow to import
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled

    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    try:
        folder = snapshot_download(repo_id, allow_patterns=HUB_FILE_PATTERNS, local_files_only=offline,
                                   etag_timeout=5)
    except HfHubHTTPError as err:  # reached the hub, which answered with an error (unknown repo, gated, ...)
        raise ModelLoadError(f"The Hugging Face hub refused {repo_id!r} ({err}); check the id, or "
                             f"{_SOURCES_HINT}.") from err
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, OSError) as err:
        raise ModelLoadError(f"Could not reach the Hugging Face hub to fetch {repo_id!r}, and it is not in the "
                             f"local cache (no local folder of that name exists either); {_SOURCES_HINT}.") from err
    return Path(folder)


def read_hf_config(folder: Path) -> dict:
    """``config.json`` of a Hugging Face checkpoint folder."""
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder} has no config.json; a checkpoint folder needs config.json, "
                             "model.safetensors (or model.safetensors.index.json and its shards) and tokenizer files.")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ModelLoadError(f"{path} is not valid JSON ({err}).") from err


def read_safetensors(folder: Path) -> dict[str, np.ndarray]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``,
    as numpy arrays in their stored dtype (bfloat16 via ml_dtypes)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as err:
            raise ModelLoadError(f"{index} is not a valid safetensors index (needs a 'weight_map').") from err
        files = sorted(set(weight_map.values()))
    elif (folder / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ModelLoadError(f"{folder} has neither model.safetensors nor model.safetensors.index.json "
                             "(PyTorch .bin checkpoints are not read; re-save with safe_serialization=True).")
    tensors = {}
    for name in files:
        tensors.update(_read_safetensors_file(folder / name))
    return tensors


def _read_safetensors_file(path: Path) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise ModelLoadError(f"Safetensors shard {path} is missing; download the checkpoint again.")
    try:
        with safe_open(path, framework="np") as file:
            return {name: file.get_tensor(name) for name in file.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        raise ModelLoadError(f"{path} is not a readable safetensors file ({err}); it may be truncated or "
                             "corrupt.") from err


TOKENIZER_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")  # one of these holds the vocabulary


def load_tokenizer(path: Path):
    """transformers tokenizer (with its chat template) of a checkpoint folder or a GGUF file."""
    # transformers 5 quietly builds an empty tokenizer for a folder without vocabulary files.
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ModelLoadError(f"{path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)}); save the "
                             "tokenizer into the checkpoint folder with tokenizer.save_pretrained(folder).")
    try:
        if path.is_file():
            return gguf_tokenizer(path)
        from transformers import AutoTokenizer  # here, as below: seconds to import, and only a folder needs it

        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"Could not load a tokenizer from {path} ({err}).") from err


@functools.lru_cache(maxsize=None)
def smollm2_tokenizer():
    """The bundled SmolLM2-135M-Instruct's tokenizer and chat template, read from its GGUF file (or
    from the tokenizer cache, ``gguf_tokenizer``)."""
    return gguf_tokenizer(bundled.smollm2_gguf_path())


def gguf_tokenizer(path: Path):
    """The tokenizer (with its chat template) of the GGUF file ``path``, as transformers builds it from
    the file's metadata. Building takes seconds, so the result is saved once in the tokenizer cache
    (``starpo_jax/runtime/caches.py``) under a key of the file's path, size and modification time and
    transformers' version, and loaded from there by later processes."""
    saved = _gguf_tokenizer_folder(path)
    if saved is not None and saved.is_dir():
        try:
            return _saved_tokenizer(saved)
        except (OSError, ValueError, KeyError, TypeError):
            pass  # damaged: built again below, and replaced
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if saved is not None:
        with contextlib.suppress(OSError):  # a cache that cannot be written is skipped, not an error
            with atomic_folder(saved) as staging:
                tokenizer.save_pretrained(str(staging))
    return tokenizer


def _saved_tokenizer(folder: Path):
    """A tokenizer ``gguf_tokenizer`` saved. transformers builds a GGUF's as its generic fast class,
    loaded here by that class itself: importing ``AutoTokenizer``'s machinery would add about a
    second to every process's start."""
    from transformers import PreTrainedTokenizerFast

    named = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if named in ("PreTrainedTokenizerFast", PreTrainedTokenizerFast.__name__):
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _gguf_tokenizer_folder(path: Path) -> Path | None:
    import transformers  # its version keys the cache; imported here, as above, for its seconds of import

    root = tokenizer_cache_dir()
    if root is None:
        return None
    stat = path.stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    return root / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def save_model(model, tokenizer, folder: str | os.PathLike, dtype: str | None = None) -> Path:
    """Write ``model`` and ``tokenizer`` as a Hugging Face checkpoint folder (config.json,
    model.safetensors, tokenizer files with the chat template) that transformers and vLLM load,
    its weights in ``dtype`` (default: the model's ``param_dtype``).

    The folder is written next to its destination under a temporary name and renamed into place,
    so a crash never leaves a half-written checkpoint; an existing folder is replaced.
    """
    with atomic_folder(folder) as staging:
        dtype = dtype or model.config.param_dtype
        hf_config = {**_hf_config_for_saving(model.config, tokenizer), "torch_dtype": dtype, "dtype": dtype}
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        # The dtype config.json states; copy=False: a float32 model's tensors are already float32, and a
        # second copy of every weight would make the export a run's peak of memory.
        tensors = {name: value.astype(_numpy_dtype(dtype), copy=False)
                   for name, value in decoder_to_hf_tensors(model).items()}
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        save_tokenizer(tokenizer, staging)
    return Path(folder).expanduser().absolute()


# GGUF's float tensor types; a quantized file states no float dtype, and its weights export as
# bfloat16, the dtype Qwen2.5's and SmolLM2's released checkpoints have.
_GGUF_FLOAT_TYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def source_dtype(source: str | os.PathLike) -> str:
    """The dtype ``source`` stores its weights in: a folder's config.json ``torch_dtype``
    (transformers 5: ``dtype``; float32 when it says neither), the float type of most of a GGUF
    file's matrices, or bfloat16 when any is quantized (the bundled model)."""
    kind, path = resolve_source(source)
    if kind == "folder":
        config = read_hf_config(path)
        return str(config.get("torch_dtype") or config.get("dtype") or "float32")

    matrices = Counter(tensor.tensor_type.name for tensor in open_gguf(path).tensors if len(tensor.shape) > 1)
    if not matrices or not set(matrices) <= set(_GGUF_FLOAT_TYPES):
        return "bfloat16"
    return _GGUF_FLOAT_TYPES[matrices.most_common(1)[0][0]]


def save_tokenizer(tokenizer, folder: Path) -> None:
    """``tokenizer.save_pretrained(folder)``, made readable by every transformers the project
    supports (>= 4.45) and by vLLM. transformers 5 names the class ``TokenizersBackend`` and keeps
    the chat template in ``chat_template.jinja`` and extra special tokens under
    ``extra_special_tokens``; 4.x knows none of these. ``PreTrainedTokenizerFast`` (built from
    ``tokenizer.json`` alone, in every version), the template inline and
    ``additional_special_tokens`` are what both read.
    """
    tokenizer.save_pretrained(str(folder))
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    template = folder / "chat_template.jinja"
    if template.is_file():
        config["chat_template"] = template.read_text()
    extra = config.pop("extra_special_tokens", None)
    if isinstance(extra, list):
        config["additional_special_tokens"] = extra
    path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _numpy_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def _hf_config_for_saving(config, tokenizer) -> dict:
    """``config.to_hf_config()`` plus the special-token ids, which serving engines read from it."""
    hf_config = dict(config.to_hf_config())
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = getattr(tokenizer, key, None)
        if hf_config.get(key) is None and token_id is not None:
            hf_config[key] = token_id
    return hf_config


@contextlib.contextmanager
def atomic_folder(folder: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder next to ``folder``; when the block finishes it replaces
    ``folder``, and if it raises the staging folder is deleted. A crash never leaves a half-written
    ``folder``."""
    folder = Path(folder).expanduser().absolute()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        yield staging
        _honour_umask(staging)
        _move_into_place(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _honour_umask(folder: Path) -> None:
    """Give ``folder`` and what it holds the modes a plain ``mkdir`` / ``open`` would (0755 / 0644
    under umask 022), so a serving process of another user can read the export: ``mkdtemp``
    creates 0700 and some writers 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for path in (folder, *folder.rglob("*")):
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


def _move_into_place(staging: Path, folder: Path) -> None:
    """Rename ``staging`` to ``folder``; an existing ``folder`` is renamed away first and deleted last."""
    if not folder.exists():
        staging.rename(folder)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".old", dir=folder.parent))
    folder.rename(old / folder.name)
    staging.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
