"""starpo-jax's CPU kernels, compiled and spread over the cores: attention to the KV cache (a
decode step's, and a prompt chunk's), the sampler's Gumbel-max draw, and a decode step's weight
products.

**Attention.** XLA:CPU runs a decode step's attention, one batched product per layer ([S, d] × [d, q]
per row and kv head), on one core whatever library it hands it to, and reads every slot of the
cache, empty or not: on the FrozenLake preset it was half of each decode step (docs/benchmarks.md,
"A decode step's attention runs on one core" and "The decode's attention as a kernel"). A prompt
chunk's attention (16 tokens of 64 rows, a later turn's append) read every slot too, held or not, a
few rows at a time. ``cached_attention.cc`` does the same sums as an XLA FFI kernel: every (row, kv
head) is a task on XLA's intra-op threads, its sums kept in vector registers; a row's tokens are
taken one after the other while its keys stay in the core's cache, each reading only the row's
first ``length`` slots and the block's own keys up to its own, and padding tokens are skipped.
While a row sums its values (already in the core's cache) it asks the memory for the keys and
values its thread reads next, so that the memory keeps streaming: a decode step's attention is bound
by reading the cache (docs/benchmarks.md, "The attention kernel asks for the next row's cache").

Rows that begin with the same prompt (the first turn's copies of each distinct first prompt:
``KVCache.prefix_group``) are tasks of a few rows together, each row reading the prompt's slots
from the first one's cache: a decode step reads a prompt's keys and values from memory once per
few rows instead of once per row, and reading them was most of the kernel's time where many rows
share a prompt (docs/benchmarks.md, "The decode's attention reads a shared prompt once"). Each
row's sums are the same, in the same order: the same floats.

**The sampler.** A decode step draws Gumbel noise for every row and every word of the vocabulary
(jax's threefry hash, two logarithms each), takes the noisy argmax and the token's log-softmax:
XLA:CPU runs each of these loops on one core, and over SmolLM2's vocabulary they are a share of
every step worth spreading (docs/benchmarks.md, "The sampler as a kernel"). ``gumbel_sample.cc``
does the same per row as a task on XLA's threads: the same threefry bits, the noise with Cephes'
logarithms (XLA's own agree to about an ulp), the first index of the maximum, and the log-sum-exp
while the row is still in the core's cache. ``rollout.sampling.sample_logits`` takes it where no
top-k or top-p filter is on and the key is threefry's.

**The weight products.** A decode step multiplies a few dozen rows by every weight of the model,
which comes from memory at every step: XLA's matrix library ran those products at ~300 GFLOP/s
where its 2048² product reaches ~460 on the same two cores, waiting on the weights' reads
(docs/benchmarks.md, "A decode step's weight products as a kernel"). ``row_product.cc`` computes a
block's products of one input in one call (q, k and v; gate and up), in register tiles of 6 rows,
each task one column block of a weight for all the rows, asking the memory for the weights of its
thread's next task while it runs. ``Decoder.extend`` takes it for a block of 16 to 256 rows in
float32 (``decoder.KERNEL_PRODUCT_ROWS``): a decode step. Each output sums its products in order,
which XLA's library does in blocks: the same sums to float32 rounding.

The kernels' threads: the calling thread runs tasks beside XLA's, then spins a short while for the
others' last tasks before it sleeps (waking from a sleep cost tens of microseconds a call).

All three are built at first use with the machine's C++ compiler (``$CXX``, else ``c++``), for this CPU
(``-march=native``), into one library in the cache folder (``runtime.caches``: ``kernels/``, keyed
by the sources, the compiler and the CPU), and registered with XLA. ``Decoder.extend`` uses the
attention for every block it appends (a decode step's one token per row, a prompt's chunk) on a CPU
when ``available()``; everywhere else, and where they cannot be built (one warning saying why), the
programs are XLA's (``decoder._attend_after``, ``sampling``'s draw, ``decoder.weight_products``). Each agrees with XLA's to
float32 rounding (tests/models/test_cpu_kernels.py), so sampled tokens can differ where two
candidates tie to that precision.

``STARPO_JAX_CPU_KERNEL=off`` (or ``0``, ``false``, ``no``) keeps XLA's programs: a benchmark's
other side, or a machine without a compiler that should not try.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from starpo_jax.runtime import caches, switches

ENV = "STARPO_JAX_CPU_KERNEL"
TARGET = "starpo_cached_attention"
SAMPLER = "starpo_gumbel_sample"
PRODUCT = "starpo_row_products"
#: The library's sources: the three kernels and the header they share.
SOURCES = tuple(Path(__file__).with_name(name) for name in ("cached_attention.cc", "gumbel_sample.cc", "row_product.cc"))
HEADER = Path(__file__).with_name("cpu_kernels.h")
FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC"]


def enabled(environ=None) -> bool:
    """Whether ``STARPO_JAX_CPU_KERNEL`` leaves the kernels on (they are unless it is set to off)."""
    return switches.switched_on(ENV, environ)


_held_off: collections.Counter[str] = collections.Counter()  # kernel -> how many ``xla_only`` blocks hold it


def available(kernel: str = TARGET) -> bool:
    """Whether what is traced now takes ``kernel`` (``TARGET``: a block appended to a cache;
    ``SAMPLER``: a sampled token): on a CPU, on one device (a kernel knows no sharding: XLA would
    gather a split batch onto every device), switched on, not held off by ``xla_only``, and built."""
    if jax.default_backend() != "cpu" or not enabled() or _held_off[kernel]:
        return False
    mesh = jax.sharding.get_abstract_mesh()
    return (mesh.empty or mesh.size == 1) and _registered()


@contextlib.contextmanager
def xla_only(*kernels: str):
    """What is traced inside takes XLA's programs instead of ``kernels`` (default: all three): a
    benchmark's other side (``bench.decode_attention`` holds off the attention alone), or a CPU
    program that stands for an accelerator's (``bench.step``'s decode cost)."""
    held = kernels or (TARGET, SAMPLER, PRODUCT)
    _held_off.update(held)
    try:
        yield
    finally:
        _held_off.subtract(held)


def cached_attention(q, k_new, v_new, k_cache, v_cache, lengths, num_new, prefix_group=None, prefix_length=None,
                     *, target: str = TARGET):
    """Attention of a block of T new tokens per row, q [B, T, heads, d], to the first ``lengths[b]``
    slots of its layer cache k_cache, v_cache [B, kv_heads, S, d] and causally to the block's own
    keys and values k_new, v_new [B, T, kv_heads, d]: what ``decoder._attend_after`` computes for a
    decode step (T = 1) or a prompt chunk. Row b's first ``num_new[b]`` tokens are real; the rest
    are padding, and come back as zeros. Returns [B, T, heads, d] in q's dtype. Call it where
    ``available()``: it builds the kernel if need be, and raises RuntimeError where it cannot be
    built. ``target``: the registered kernel to call (a test registers a build of another vector
    width under a name of its own).

    ``prefix_group``, ``prefix_length`` [B] int32 (``KVCache``'s): rows of one group hold the same
    keys and values in their first ``min`` of their prefix lengths' slots (a prompt they share).
    The kernel attends a group's rows together, a few at a time, each reading those slots from the
    first one's cache: the same sums in the same order, from one read of the memory instead of one
    per row. Default: every row its own group."""
    _require_built(target, TARGET)
    B, T, H, D = q.shape
    kv_heads = k_cache.shape[1]
    f32, i32 = jnp.float32, jnp.int32
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((B, T, kv_heads, H // kv_heads, D), f32),
                            vmap_method="broadcast_all")
    groups = jnp.arange(B, dtype=i32) if prefix_group is None else prefix_group.astype(i32)
    shared = jnp.zeros((B,), i32) if prefix_length is None else prefix_length.astype(i32)
    out = call(q.reshape(B, T, kv_heads, H // kv_heads, D).astype(f32), k_cache.astype(f32), v_cache.astype(f32),
               jnp.minimum(lengths, k_cache.shape[2]).astype(i32), jnp.broadcast_to(num_new, (B,)).astype(i32),
               k_new.astype(f32), v_new.astype(f32), groups, shared, scale=np.float32(D**-0.5))
    return out.reshape(B, T, H, D).astype(q.dtype)


def gumbel_sample(scaled, key_data, rows, greedy, *, target: str = SAMPLER):
    """One token per row of ``scaled`` [B, V] float32 (logits over the temperature) and its log-prob:
    ``jax.random.categorical``'s draw under the threefry key ``key_data`` uint32[2], noise bits and
    all, where row b draws row ``rows[b]``'s noise of a [R, V] draw (R * V < 2**32); rows where
    ``greedy`` [B] bool take the argmax, no noise. The log-prob is ``log_softmax(scaled)`` at the
    token. What ``sampling.sample_logits`` computes with no top-k or top-p filter, to float32
    rounding. Call it where ``available()``, as ``cached_attention``; ``target`` likewise."""
    _require_built(target, SAMPLER)
    B = scaled.shape[0]
    call = jax.ffi.ffi_call(target, (jax.ShapeDtypeStruct((B,), jnp.int32), jax.ShapeDtypeStruct((B,), jnp.float32)),
                            vmap_method="broadcast_all")
    return call(scaled.astype(jnp.float32), key_data.astype(jnp.uint32), rows.astype(jnp.int32), greedy.astype(bool))


def row_products(x, weights, *, target: str = PRODUCT):
    """x [rows, in] @ w [in, out_i] for each w of ``weights``, in float32, as a tuple, in one call:
    what ``decoder.weight_products`` computes for a block of few rows, to float32 rounding (each
    output sums its products over ``in`` in order). Call it where ``available(PRODUCT)``, as
    ``cached_attention``; ``target`` likewise."""
    _require_built(target, PRODUCT)
    call = jax.ffi.ffi_call(target, tuple(jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32) for w in weights),
                            vmap_method="broadcast_all")
    return tuple(call(x.astype(jnp.float32), *(w.astype(jnp.float32) for w in weights)))


def register(library: ctypes.CDLL, suffix: str = "") -> None:
    """Register a build's three kernels with XLA, as ``TARGET``, ``SAMPLER`` and ``PRODUCT`` + ``suffix``."""
    jax.ffi.register_ffi_target(TARGET + suffix, jax.ffi.pycapsule(library.starpo_cached_attention), platform="cpu")
    jax.ffi.register_ffi_target(SAMPLER + suffix, jax.ffi.pycapsule(library.starpo_gumbel_sample), platform="cpu")
    jax.ffi.register_ffi_target(PRODUCT + suffix, jax.ffi.pycapsule(library.starpo_row_products), platform="cpu")


def _require_built(target: str, ours: str) -> None:
    """Raises where ``target`` is this library's own kernel ``ours`` (not a test's stand-in) and the
    library could not be built: the call would reach no registered kernel."""
    if target == ours and not _registered():
        raise RuntimeError("starpo-jax's CPU kernels could not be built (the warning says why)")


@functools.cache
def _registered() -> bool:
    """Build (or find) the kernels' library and register it with XLA, once per process; False, with
    one warning, where it cannot be built or loaded."""
    try:
        register(ctypes.cdll.LoadLibrary(str(build())))
        return True
    except (OSError, subprocess.SubprocessError) as err:
        warnings.warn(f"starpo-jax could not build its CPU kernels ({err}); attending and sampling with "
                      f"XLA's programs, which use one core (set {ENV}=off to skip the attempt)", stacklevel=2)
        return False


def build(folder: Path | None = None, defines: tuple[str, ...] = ()) -> Path:
    """The kernels' shared library, compiled into ``folder`` (default: the cache's ``kernels/``, or a
    temporary folder when the caches are off) unless a build of the same sources, compiler and CPU is
    there. ``defines``: extra ``-D`` flags (``-DSTARPO_VECTOR_FLOATS=8`` builds the vectors of eight
    floats on a CPU with AVX-512, which the kernels otherwise take sixteen at a time). Raises OSError
    or a ``subprocess`` error when the compiler is missing or fails."""
    compiler = shlex.split(os.environ.get("CXX") or "c++")
    version = subprocess.run([*compiler, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    flags = [*FLAGS, *defines]
    texts = [path.read_text() for path in (HEADER, *SOURCES)]
    key = hashlib.sha256("\n".join([*texts, " ".join(compiler + flags), version,
                                    platform.machine(), _cpu_flags()]).encode()).hexdigest()[:16]
    root = caches.cache_root()
    folder = folder or (root / "kernels" if root else Path(tempfile.gettempdir()) / f"starpo-jax-kernels-{os.getuid()}")
    library = folder / f"cpu_kernels-{key}.so"
    if library.exists():
        return library
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{library.name}.{os.getpid()}"  # renamed when whole: a reader never sees half a file
    command = [*compiler, *flags, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(partial)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    if done.returncode:
        partial.unlink(missing_ok=True)
        raise subprocess.SubprocessError(f"{' '.join(command)} failed: {_compiler_errors(done.stderr)}")
    os.replace(partial, library)
    return library


def _compiler_errors(stderr: str, limit: int = 2000) -> str:
    """The lines of a failed compile's output that name an error (all of it where none does), at most
    ``limit`` characters: the warnings XLA's headers raise would otherwise fill the message."""
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    return ("\n".join(errors) or stderr.strip())[-limit:]


def _cpu_flags() -> str:
    """The CPU's model and feature flags (``-march=native`` compiles for them), where Linux lists them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(sorted({line for line in lines if line.startswith(("model name", "flags"))}))
