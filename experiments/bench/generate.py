"""Generation throughput of starpo_jax's sampler next to transformers' ``generate``.

    python -m experiments.bench.generate                      # smollm2-135m-instruct + Qwen2.5-0.5B shape
    python -m experiments.bench.generate --batch-sizes 1,8,32 --out bench_results/bench_cpu.json
    python -m experiments.bench.generate --quick              # seconds: tiny model, smoke test

Workload (fixed, stop tokens disabled): B random prompts of --prompt-len tokens, --new-tokens new
tokens per row, sampled at temperature 1 with top-k off and top-p 1 (RAGEN's training setting).
Both sides run on the same machine, in the same dtype, with the same model shapes;
transformers gets random weights (``generate`` with min_new_tokens = max_new_tokens and no EOS).
SmolLM2 uses the bundled GGUF weights on the JAX side when ``load_model`` is available; with stop
tokens disabled the work is the same for any weights, and the JSON says which were used.

Reported per (model, batch): compile time (apart), the median wall time of a full call (prefill +
decode) over --repeats runs, generated tokens/s = B * new_tokens / that time, prefill time alone,
decode tokens/s = B * new_tokens / (total - prefill), and the ratio to transformers.

GPU roofline: a decode step must at least read every weight once and each row's KV cache up to its
current length. With the average context P + (N - 1) / 2 over the run:
    bytes/step = weight bytes + B * (P + (N - 1) / 2) * 2 * layers * kv_heads * head_dim * dtype bytes
    roofline tokens/s = B * HBM bandwidth / bytes/step
and the fraction is decode tokens/s divided by that. Bandwidths: H100 SXM 3.35 TB/s, H100 PCIe
2.0 TB/s, H200 4.8 TB/s, A100 80GB 2.04 TB/s (``experiments.bench.common.HBM_BYTES_PER_S``).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.bench.common import (
    hbm_bandwidth,
    machine,
    require_positive,
    require_presets,
    whole_numbers,
    write_report,
)
from experiments.bench.generation_timing import bench_jax, bench_transformers, hf_model, transformers_device
from starpo_jax.models import Decoder, ModelConfig, ModelState, preset
from starpo_jax.models.loading import load_model
from starpo_jax.runtime import allocator
from starpo_jax.runtime.planning import kv_bytes_per_token


def roofline(config: ModelConfig, num_params: int, batch: int, prompt_len: int, new_tokens: int, bandwidth: float):
    param_bytes = num_params * jnp.dtype(config.param_dtype).itemsize
    avg_context = prompt_len + (new_tokens - 1) / 2
    # an accelerator's roofline (its HBM bandwidth), whose cache holds the compute dtype
    bytes_per_step = param_bytes + batch * avg_context * kv_bytes_per_token(config, backend="gpu")
    return {
        "hbm_bytes_per_s": bandwidth,
        "bytes_per_step": bytes_per_step,
        "tokens_per_s": batch * bandwidth / bytes_per_step,
    }


def load_jax_model(name: str, config: ModelConfig) -> tuple[Decoder, str]:
    if name == "smollm2-135m-instruct":
        try:
            model, _ = load_model(name, dtype=config.dtype)
            return model, "bundled SmolLM2 GGUF (Q4_1, dequantised)"
        except (ImportError, FileNotFoundError, ValueError) as err:
            print(f"[bench] bundled SmolLM2 not loadable ({err}); using random weights")
    return Decoder(config, rngs=nnx.Rngs(0)), "random"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.generate",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-0.5b")
    parser.add_argument("--batch-sizes", default="1,8,32,128")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--cache-size", type=int, default=None,
                        help="KV cache slots per row (default prompt + new tokens); a multi-turn rollout reserves "
                             "more (RAGEN: 3600). When larger, the JAX side also runs decoding in the whole cache "
                             "(no window) and reports window_speedup")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--repeats", type=int, default=3, help="timed JAX runs per setting (median)")
    parser.add_argument("--hf-repeats", type=int, default=1, help="timed transformers runs per setting (median)")
    parser.add_argument("--hf-max-batch", type=int, default=None, help="skip transformers above this batch")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. machine load)")
    parser.add_argument("--out", default="bench_results/bench_generate.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny-llama, batch 2, 8 + 8 tokens")
    args = parser.parse_args(argv)
    if args.quick:
        args.models, args.batch_sizes, args.prompt_len, args.new_tokens = "tiny-llama", "2", 8, 8
        args.repeats = args.hf_repeats = 1
    require_presets(parser, args.models.split(","), "--models")
    whole_numbers(parser, args.batch_sizes, "--batch-sizes")
    require_positive(parser, args, "prompt_len", "new_tokens", "cache_size", "repeats", "hf_repeats")
    if args.cache_size is not None and args.cache_size < args.prompt_len + args.new_tokens:
        parser.error(f"--cache-size {args.cache_size} holds fewer than --prompt-len + --new-tokens "
                     f"({args.prompt_len + args.new_tokens}) slots")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = jax.devices()[0]
    dtype = args.dtype or ("bfloat16" if device.platform == "gpu" else "float32")
    hf_device = None if args.no_hf else transformers_device(device.platform)
    bandwidth = hbm_bandwidth(device.device_kind) if device.platform == "gpu" else None
    report: dict[str, Any] = {
        "workload": {
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "dtype": dtype,
            "cache_size": args.cache_size or args.prompt_len + args.new_tokens,
            "sampling": "temperature 1.0, top-k off, top-p 1.0, stop tokens disabled",
            "tokens_per_s": "batch * new_tokens / median wall time of prefill + decode; compile time apart",
        },
        "machine": machine(args.note),
        "results": [],
    }  # fmt: skip
    for name in args.models.split(","):
        config = preset(name, dtype=dtype, param_dtype=dtype)
        decoder, weights = load_jax_model(name, config)
        model = ModelState.split(decoder)
        num_params = sum(x.size for x in jax.tree.leaves(model.params))
        hf = hf_model(config, hf_device) if hf_device else None
        for batch in map(int, args.batch_sizes.split(",")):
            prompts = np.random.default_rng(batch).integers(0, config.vocab_size, (batch, args.prompt_len), np.int32)
            row = {"model": name, "weights": weights, "num_params": num_params, "batch": batch}
            row["jax"] = bench_jax(model, config, prompts, args.new_tokens, args.repeats, args.cache_size)
            if args.cache_size and args.cache_size > args.prompt_len + args.new_tokens:
                row["jax_whole_cache"] = bench_jax(model, config, prompts, args.new_tokens, args.repeats,
                                                   args.cache_size, windowed=False)
                row["window_speedup"] = row["jax"]["tokens_per_s"] / row["jax_whole_cache"]["tokens_per_s"]
            if hf is not None and hf_device is not None and (args.hf_max_batch is None or batch <= args.hf_max_batch):
                row["transformers"] = bench_transformers(hf, prompts, args.new_tokens, args.hf_repeats, hf_device)
                row["speedup_vs_transformers"] = row["jax"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
            if bandwidth:
                row["roofline"] = roofline(config, num_params, batch, args.prompt_len, args.new_tokens, bandwidth)
                row["roofline"]["fraction"] = row["jax"]["decode_tokens_per_s"] / row["roofline"]["tokens_per_s"]
            report["results"].append(row)
            print(summary(row), flush=True)
    write_report(report, args.out)
    return report


def summary(row: dict) -> str:
    text = (
        f"{row['model']:<24} B={row['batch']:<4} jax {row['jax']['tokens_per_s']:9.1f} tok/s "
        f"(decode {row['jax']['decode_tokens_per_s']:9.1f}, compile {row['jax']['compile_s']:.1f}s)"
    )
    if "window_speedup" in row:
        text += f" | whole cache {row['jax_whole_cache']['tokens_per_s']:9.1f} tok/s | window x{row['window_speedup']:.2f}"
    if "transformers" in row:
        text += f" | transformers {row['transformers']['tokens_per_s']:8.1f} tok/s | x{row['speedup_vs_transformers']:.2f}"
    if "roofline" in row:
        text += f" | {100 * row['roofline']['fraction']:.0f}% of HBM roofline"
    return text


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
