"""Timing one batched generation, shared by ``bench.generate`` and ``bench.step``: starpo_jax's
sampler (``bench_jax``: prefill + decode, and prefill alone) and transformers' ``generate`` on the
same prompts, the same number of new tokens and the same kind of device.
"""

from __future__ import annotations

import statistics
import time

import jax
import numpy as np

from starpo_jax.models import ModelConfig, ModelState
from starpo_jax.rollout import sampling


def median_time(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        fn(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def bench_jax(model: ModelState, config: ModelConfig, prompts: np.ndarray, new_tokens: int, repeats: int,
              cache_size: int | None = None, windowed: bool = True) -> dict:
    B, P = prompts.shape
    lengths = np.full((B,), P, np.int32)
    cache_size = cache_size or P + new_tokens

    def full(m, p, lengths, key):
        return sampling.generate(m, p, lengths, key, max_new_tokens=new_tokens, temperature=1.0, cache_size=cache_size,
                                 windowed=windowed)

    def prefill(m, p, lengths):
        return sampling.append(m, sampling.init_cache(config, B, cache_size), p, lengths)

    start = time.perf_counter()
    full_c = jax.jit(full).lower(model, prompts, lengths, jax.random.key(0)).compile()
    prefill_c = jax.jit(prefill).lower(model, prompts, lengths).compile()
    compile_s = time.perf_counter() - start

    def run(i):
        out = full_c(model, prompts, lengths, jax.random.key(i))
        jax.block_until_ready(out)
        if not (np.asarray(out.lengths) == new_tokens).all():
            raise RuntimeError(f"expected {new_tokens} new tokens per row, got {np.asarray(out.lengths)}")

    total_s, times = median_time(run, repeats)
    prefill_s, _ = median_time(lambda i: jax.block_until_ready(prefill_c(model, prompts, lengths)), repeats)
    return {
        "compile_s": compile_s,
        "run_s": times,
        "tokens_per_s": B * new_tokens / total_s,
        "prefill_s": prefill_s,
        "decode_tokens_per_s": B * new_tokens / max(total_s - prefill_s, 1e-9),
    }


def hf_model(config: ModelConfig, device: str):
    import torch  # torch, here and below, only for the transformers baseline: not in the default install
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.AutoConfig.for_model(**config.to_hf_config())
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
    model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    return model.to(device).eval()


def bench_transformers(model, prompts: np.ndarray, new_tokens: int, repeats: int, device: str) -> dict:
    import torch

    ids = torch.tensor(prompts, dtype=torch.long, device=device)
    kwargs = dict(
        attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        eos_token_id=None, pad_token_id=0,
    )  # fmt: skip

    def run(i, n=new_tokens):
        torch.manual_seed(i)
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        if out.shape[1] != prompts.shape[1] + n:
            raise RuntimeError(f"transformers generated {out.shape[1] - prompts.shape[1]} tokens, expected {n}")

    run(0, n=2)  # warm-up: first-call allocations and lazy initialisation
    total_s, times = median_time(run, repeats)
    return {"run_s": times, "tokens_per_s": prompts.shape[0] * new_tokens / total_s, "device": device}


def transformers_device(jax_platform: str) -> str | None:
    """transformers must run on the same kind of device as JAX, or the comparison is skipped."""
    if jax_platform == "cpu":
        return "cpu"
    import torch

    return "cuda" if jax_platform == "gpu" and torch.cuda.is_available() else None
