"""One StarPO-S training iteration at the paper's size, timed by phase.

    python -m experiments.bench.step                       # Qwen2.5-0.5B shape, random weights, N = 100 and 400
    python -m experiments.bench.step --model PATH          # a checkpoint (HF folder or GGUF) instead
    python -m experiments.bench.step --cost-analysis       # + XLA's bytes per decode step (compiled for CPU)
    python -m experiments.bench.step --cost-only           # only those bytes (a minute or two on a CPU)
    python -m experiments.bench.step --tiny                # CPU smoke run: tiny model, 8 rows, 2 turns of 8 tokens

Workload: ``configs/sokoban.py`` unchanged unless a flag says otherwise — SimpleSokoban, 8 groups
× 16, 5 turns, ``response_length`` 400, ``max_model_len`` 3,600, PPO with a critic (GAE), filter
0.25 (2 groups × 16 = 32 trajectories updated), bf16 compute over float32 master weights.
Random weights never stop on their own, so ``--response-tokens N`` makes every turn end after
exactly N sampled tokens (``multi_turn.LLMResponder.fixed_length``; stop tokens ignored): the
workload is then fixed, B × turns × N generated tokens. N = 100 is the paper's typical trained
length, N = 400 the worst case. The update always sees ``response_length`` = 400 of room per turn.

The iteration is what ``experiments.run`` executes: ``jit(train_step.collect)`` then
``jit(train_step.learn, donate_argnums=0)``, compiled ahead of time (compile time reported apart),
then ``--steps`` warm iterations; every phase figure is the median over them.

Phases (seconds):

- ``rollout``: ``collect`` (level generation and the whole multi-turn rollout).
- ``update``: ``learn`` (filter, old log-probs and values, advantages, critic and actor updates).
- ``step``: ``rollout`` + ``update``, timed as one.
- ``logprobs_values``: ``learn`` with ``ppo_epochs = 0`` (filter, old / ref log-probs, values,
  advantages: everything before the first optimiser step).
- ``actor_update``: ``learn`` with GRPO advantages (no critic) minus the same with
  ``ppo_epochs = 0``: the actor's passes over the mini-batches.
- ``critic_update``: ``update`` − ``logprobs_values`` − ``actor_update`` (the rest).

``learn`` is one program, so the split comes from timing these variants of it, each compiled by
``make_train_step`` from the same settings but one; differences of medians are noisy when phases
are short.

Side by side, in the same run:

- ``host_loop``: ``bench.rollout``'s baseline (``rollout_timing.bench_baseline``; per turn: rebuild the conversation text, tokenise,
  re-prefill the whole history, decode, decode to text, parse and step the envs on the host) on
  the same batch, the same N and the same device.
- ``generate``: the decode part alone — B random prompts of the first turn's prompt length, N new
  tokens, stop tokens off — with ``starpo_jax.rollout.sampling.generate`` (cache of ``max_model_len``
  slots, as the rollout) and transformers' ``generate`` on the same device (``bench.generate``'s timers, ``generation_timing``).

Roofline (``experiments.bench.common.hbm_bandwidth``; H100 SXM 3.35 TB/s, H200 4.8 TB/s; a CPU
has none unless ``--bandwidth`` declares one): ``rollout_timing.decode_roofline`` on the rollout's
trajectories — the bytes a decode must read (every weight once per step, each generated token's
context once) over the bandwidth, as a fraction of the measured rollout time.

Memory: the device's peak bytes in use (``memory_stats``; GPUs) and XLA's compiled memory analysis
of ``collect`` and ``learn`` (arguments, outputs, temporaries).

``--cost-analysis``: ``decode_cost`` compiles one decode step (``sampling.decode_step``) of the
paper's model (batch 128) for the CPU from abstract shapes (no weights allocated), in float32 and
bfloat16 and in each cache window a 3,600-slot cache decodes in, and reports the bytes it accesses
per generated token, read off the optimised HLO (``bench.hlo_bytes``), next to the ideal: weights / batch
+ the KV cache of one row filling the window.

Writes JSON (``--out``) and a markdown table next to it (``.md``); every record carries the device
and the date.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import statistics
import time
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from configs import base, sokoban
from experiments.bench import generation_timing, rollout_timing
from experiments.bench.common import (
    built_or_exit,
    hbm_bandwidth,
    machine,
    markdown_table,
    require_positive,
    timed,
    write_markdown,
    write_report,
)
from experiments.bench.hlo_bytes import hlo_bytes
from starpo_jax.models import Decoder, ModelState, cpu_kernels, preset
from starpo_jax.rollout import sampling
from starpo_jax.rollout.multi_turn import LLMResponder, initial_states_from_seeds
from starpo_jax.rollout.sampling import decode_windows, sampling_policy
from starpo_jax.runtime import allocator
from starpo_jax.runtime.planning import device_peak, kv_bytes_per_token, program_memory
from starpo_jax.train import init_train_state, make_train_step, policy_weights

if TYPE_CHECKING:
    from starpo_jax.train import TrainState

# ---- the workload ------------------------------------------------------------------------------

TINY = {
    "model.source": "smollm2-135m-instruct",  # its (bundled) tokenizer; the weights are random
    "model.random_init_preset": "tiny-llama",
    "model.dtype": "float32",
    "envs.train.n_groups": (4,),
    "envs.train.group_size": 2,
    "rollout.max_turn": 2,
    "rollout.response_length": 8,
    "rollout.max_model_len": 512,  # the first prompt (313 tokens) + a next prompt (170) + 2 x 8
    "actor.ppo_mini_batch_size": 2,
    "actor.micro_batch_size": 2,
}  # fmt: skip


def experiment_config(args):
    changes: dict[str, object] = {"envs.val.n_groups": (1,), "trainer.output_dir": "bench_results/bench_step_run"}
    if args.model:
        changes |= {"model.source": args.model}
    else:
        changes |= {"model.source": "qwen2.5", "model.random_init_preset": "qwen2.5-0.5b"}
    if args.tiny:
        changes |= TINY
    if args.dtype:
        changes["model.dtype"] = args.dtype
    return base.with_overrides(sokoban.get_config(), changes)


# ---- timing ------------------------------------------------------------------------------------


def compiled(fn, *args):
    """``fn`` compiled ahead of time for ``args``, and the seconds it took."""
    return timed(lambda: fn.lower(*args).compile())


def median(xs) -> float:
    return statistics.median(xs)


@dataclasses.dataclass
class Programs:
    """The compiled pieces shared by every N: ``learn`` and its variants (see the docstring)."""

    learn: object
    variants: dict
    compile_s: dict
    memory: dict


def memory_sizes(compiled_fn) -> dict:
    """XLA's arguments, outputs and temporaries of a compiled program (``planning.program_memory``);
    none where the backend reports none."""
    memory = program_memory(compiled_fn)
    return {} if memory is None else memory.sizes()


def compile_learn(exp, state, traj) -> Programs:
    settings = exp.settings
    variants = {
        "learn": (settings, True),
        "forward_only": (dataclasses.replace(settings, ppo_epochs=0), False),
        "grpo": (dataclasses.replace(settings, adv_estimator="grpo"), False),
        "grpo_forward_only": (dataclasses.replace(settings, adv_estimator="grpo", ppo_epochs=0), False),
    }
    programs, compile_s = {}, {}
    for name, (s, donate) in tqdm(variants.items(), desc="compile learn", leave=False):
        learn = make_train_step(s, exp.model.graphdef, exp.train_plan).learn
        jitted = jax.jit(learn, donate_argnums=0) if donate else jax.jit(learn)
        programs[name], compile_s[name] = compiled(jitted, state, traj, exp.hyper)
    learn = programs.pop("learn")
    return Programs(learn, programs, compile_s, memory_sizes(learn))


def run_steps(exp, state, collect, learn, steps: int, bar):
    """``steps`` warm iterations as ``experiments.run`` runs them; per-iteration seconds."""
    times: dict[str, list[float]] = {"rollout": [], "update": [], "step": []}
    traj = None
    for i in range(steps):
        key = jax.random.PRNGKey(i)
        t0 = time.perf_counter()
        traj = jax.block_until_ready(collect(state, exp.train_tables, key))
        t1 = time.perf_counter()
        state, metrics = jax.block_until_ready(learn(state, traj, exp.hyper))
        t2 = time.perf_counter()
        times["rollout"].append(t1 - t0)
        times["update"].append(t2 - t1)
        times["step"].append(t2 - t0)
        bar.update()
    return state, traj, times, jax.device_get(metrics)


def split_update(programs: Programs, state, traj, hyper, steps: int, bar) -> dict[str, list[float]]:
    """Seconds of each ``learn`` variant on the same batch, ``steps`` times each."""
    times: dict[str, list[float]] = {}
    for name, fn in programs.variants.items():
        times[name] = []
        for _ in range(steps):
            times[name].append(timed(lambda: fn(state, traj, hyper))[1])
            bar.update()
    return times


def phases(times: dict, variants: dict) -> dict[str, float]:
    forward = median(variants["forward_only"])
    actor = median(variants["grpo"]) - median(variants["grpo_forward_only"])
    update = median(times["update"])
    return {
        "rollout": median(times["rollout"]),
        "logprobs_values": forward,
        "critic_update": update - forward - actor,
        "actor_update": actor,
        "update": update,
        "step": median(times["step"]),
    }


# ---- side by side: the host loop and transformers ------------------------------------------------


HOST_LOOP_SEED = 10000  # RAGEN's seed.train: the host loop plays RAGEN's first training levels


def host_loop(exp, policy, n: int, steps: int, bar) -> dict:
    """``bench.rollout``'s baseline on the same batch and device, every turn N tokens."""
    plan = dataclasses.replace(exp.train_plan, response_length=n, stop_tokens=())

    subject = rollout_timing.Subject("policy", policy, exp.tokenizer, "")
    init = initial_states_from_seeds(plan, HOST_LOOP_SEED)
    result, _ = rollout_timing.bench_baseline(subject, plan, init, jax.random.key(0), steps, bucket=256, bar=bar)
    return result


def decode_side_by_side(exp, policy, n: int, args) -> dict:
    """Prefill + N decode steps of B random first-turn prompts: starpo_jax vs transformers."""
    config = policy.merge().config
    plan = exp.train_plan
    prompt_len = exp.train_tables.tags[0].prompts.first_len
    prompts = np.random.default_rng(0).integers(0, config.vocab_size, (plan.batch_size, prompt_len), np.int32)
    out = {"batch": plan.batch_size, "prompt_len": prompt_len, "new_tokens": n, "cache_size": plan.max_len}
    out["starpo_jax"] = generation_timing.bench_jax(policy, config, prompts, n, args.steps, plan.max_len)
    device = None if args.no_hf else generation_timing.transformers_device(jax.devices()[0].platform)
    if device:
        hf = generation_timing.hf_model(config, device)
        out["transformers"] = generation_timing.bench_transformers(hf, prompts, n, args.hf_repeats, device)
        out["speedup"] = out["starpo_jax"]["tokens_per_s"] / out["transformers"]["tokens_per_s"]
        del hf
    return out


# ---- XLA cost analysis of one decode step ------------------------------------------------------

def decode_cost(config, batch: int, window: int, top: bool = False) -> dict:
    """Bytes one decode step of ``config`` accesses per generated token, batch ``batch`` in a
    cache of ``window`` slots, compiled for the CPU from abstract shapes; the ideal next to it."""
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    graphdef, params = nnx.split(nnx.eval_shape(lambda: Decoder(config, rngs=nnx.Rngs(0))))
    on_cpu = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=cpu)  # noqa: E731
    model = ModelState(graphdef, jax.tree.map(on_cpu, params))
    # The blocks' weights split per layer, as the decode loop takes them (once per call).
    weights = jax.tree.map(on_cpu, jax.eval_shape(lambda m: m.merge().layers.per_layer(), model))
    state = jax.tree.map(on_cpu, jax.eval_shape(lambda: sampling.initial_decode_state(
        sampling.init_cache(config, batch, window), (jnp.zeros((batch,), jnp.int32), jnp.zeros((batch,))),
        jnp.zeros((batch, config.hidden_size), jnp.dtype(config.dtype)), 1, None)))
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=cpu)

    def step(model, weights, state, key):
        return sampling.decode_step(model.merge(), weights, state, key, 1.0, 0, 1.0, jnp.full((batch, 1), -1), 0)

    # The state is donated, as the decode loop carries it: its cache is updated in place. XLA's
    # attention, not the CPU kernel: the program stands for an accelerator's.
    with cpu_kernels.xla_only():
        hlo = jax.jit(step, donate_argnums=2).lower(model, weights, state, key).compile().as_text()
    if hlo is None:  # XLA:CPU gives its compiled programs' text
        raise RuntimeError("the compiled decode step has no HLO text to count its bytes from")
    total, biggest = hlo_bytes(hlo)
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    kv_per_token = kv_bytes_per_token(config)
    ideal = weight_bytes / batch + window * kv_per_token
    out = {
        "batch": batch, "window": window, "bytes_per_token": total / batch, "ideal_bytes_per_token": ideal,
        "ideal_weights": weight_bytes / batch, "ideal_kv": window * kv_per_token, "over_ideal": total / batch / ideal,
    }  # fmt: skip
    if top:
        out["biggest"] = [{"bytes": b, "what": w} for b, w in biggest]
    return out


def cost_analysis(batch: int = 128, max_len: int = 3600) -> list[dict]:
    """``decode_cost`` of Qwen2.5-0.5B in every decode window of a ``max_len`` cache, in float32
    and in bfloat16 (XLA:CPU computes bf16 in float32, converting buffers around each dot, so the
    float32 program shows the structure a GPU's bf16 program has, at twice the bytes)."""
    windows = decode_windows(max_len)
    out = []
    for dtype in tqdm(("float32", "bfloat16"), desc="cost analysis", leave=False):
        config = preset("qwen2.5-0.5b", dtype=dtype, param_dtype=dtype)
        out += [{"dtype": dtype, **decode_cost(config, batch, w, top=w == windows[-1])} for w in windows]
    return out


# ---- the run -------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m experiments.bench.step",
                                description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a checkpoint (HF folder, GGUF file, hub id) instead of random weights")
    p.add_argument("--response-tokens", default=None,
                   help="comma-separated N: every turn ends after exactly N tokens (default 100,400; --tiny 8)")
    p.add_argument("--steps", type=int, default=3, help="warm iterations per N (median; at least 3)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], help="compute dtype (default: the config's, bfloat16)")
    p.add_argument("--bandwidth", type=float, default=None,
                   help="memory bandwidth in bytes/s for the roofline where the device is not in the table (CPU)")
    p.add_argument("--no-baseline", action="store_true", help="skip the host loop")
    p.add_argument("--no-hf", action="store_true", help="skip transformers' generate")
    p.add_argument("--hf-repeats", type=int, default=1, help="timed transformers runs (median)")
    p.add_argument("--cost-analysis", action="store_true", help="XLA bytes per decode step at the paper's size (CPU)")
    p.add_argument("--cost-only", action="store_true", help="only the cost analysis (no timing)")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. machine load)")
    p.add_argument("--out", default="bench_results/bench_step.json")
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny-llama, 4 groups x 2, 2 turns, N = 8")
    args = p.parse_args(argv)
    if args.steps < 3 and not args.tiny:
        p.error("--steps must be at least 3 (the median of warm steps)")
    try:
        args.response_tokens = [int(n) for n in (args.response_tokens or ("8" if args.tiny else "100,400")).split(",")]
    except ValueError:
        p.error(f"--response-tokens takes whole numbers separated by commas, not {args.response_tokens!r}")
    limit = TINY["rollout.response_length"] if args.tiny else 400
    if any(not 0 < n <= limit for n in args.response_tokens):
        p.error(f"--response-tokens must lie in 1..{limit} (the response length)")
    if args.tiny and args.model:
        p.error("--tiny times a tiny random model: give --model without --tiny")
    require_positive(p, args, "hf_repeats", "bandwidth")
    args.cost_analysis = args.cost_analysis or args.cost_only
    return args


def run_n(exp, state: TrainState, programs, n: int, args, bandwidth, bar) -> tuple[TrainState, dict]:
    responder = LLMResponder(exp.train_plan, fixed_length=n)
    collect = jax.jit(make_train_step(exp.settings, exp.model.graphdef, exp.train_plan, responder).collect)
    collect, collect_s = compiled(collect, state, exp.train_tables, jax.random.PRNGKey(0))
    state, traj, times, metrics = run_steps(exp, state, collect, programs.learn, args.steps, bar)
    variants = split_update(programs, state, traj, exp.hyper, args.steps, bar)
    tokens = int(np.asarray(traj.response_tokens).sum())
    result = {
        "date": _now(), "device": jax.devices()[0].device_kind, "response_tokens": n,
        "compile_s": {"collect": collect_s, **programs.compile_s},
        "phases_s": phases(times, variants), "runs_s": {**times, **variants},
        "generated_tokens": tokens, "turns_played": int(np.asarray(traj.num_turns).sum()),
        "rollout_tokens_per_s": tokens / median(times["rollout"]),
        "train_metrics": {
            k: float(metrics[k]) for k in ("train/generated_tokens", "actor/grad_norm", "critic/grad_norm")
        },
        "memory": {"collect": memory_sizes(collect), "learn": programs.memory},
    }  # fmt: skip
    policy = sampling_policy(exp.model.graphdef, policy_weights(exp.settings, state))
    if bandwidth:
        subject = rollout_timing.Subject("policy", policy, exp.tokenizer, "")
        rollout_s = median(times["rollout"])
        result["roofline"] = rollout_timing.decode_roofline(traj, subject, exp.train_plan, rollout_s, bandwidth)
    if not args.no_baseline:
        result["host_loop"] = host_loop(exp, policy, n, args.steps, bar)
        result["speedup_vs_host_loop"] = result["rollout_tokens_per_s"] / result["host_loop"]["tokens_per_s"]
    result["generate"] = decode_side_by_side(exp, policy, n, args)
    return state, result


def workload(exp, args) -> dict:
    config, plan = exp.model.merge().config, exp.train_plan
    return {
        "model": args.model or ("tiny-llama (random)" if args.tiny else "qwen2.5-0.5b (random)"),
        "dtype": config.dtype, "env": plan.tags[0].name, "groups": plan.num_groups, "group_size": plan.group_size,
        "rows": plan.batch_size, "max_turn": plan.max_turn, "response_length": plan.response_length,
        "max_model_len": plan.max_len, "estimator": exp.settings.adv_estimator,
        "filter_ratio": float(exp.config.filter.ratio), "updated_rows": exp.settings.kept_groups * plan.group_size,
        "steps": args.steps,
    }  # fmt: skip


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def main(argv=None) -> dict:
    args = parse_args(argv)

    device = jax.devices()[0]
    bandwidth = args.bandwidth or hbm_bandwidth(device.device_kind)
    report: dict[str, Any] = {"date": _now(), "machine": machine(args.note), "hbm_bytes_per_s": bandwidth,
                              "results": []}
    if not args.cost_only:
        exp = built_or_exit(experiment_config(args))
        report["workload"] = workload(exp, args)
        state = init_train_state(exp.settings, exp.model, jax.random.PRNGKey(0))
        # per N: the iterations, three learn variants, and the host loop's first run and repeats
        runs = len(args.response_tokens) * (4 * args.steps + (0 if args.no_baseline else 1 + args.steps))
        with tqdm(total=runs, desc="bench_step", unit="run") as bar:
            collect = make_train_step(exp.settings, exp.model.graphdef, exp.train_plan).collect
            traj = jax.eval_shape(collect, state, exp.train_tables, jax.random.PRNGKey(0))  # shapes only
            programs = compile_learn(exp, state, traj)
            for n in args.response_tokens:
                bar.set_postfix_str(f"N={n}")
                state, result = run_n(exp, state, programs, n, args, bandwidth, bar)
                report["results"].append(result)
        report["peak_device_bytes"] = device_peak(jax.devices()[:1])
    if args.cost_analysis:
        report["decode_cost"] = {"date": _now(), "device": "cpu (compiled, not run)", "model": "qwen2.5-0.5b",
                                 "batch": 128, "max_len": 3600, "steps": cost_analysis(128, 3600)}
    text = markdown(report)
    print(text, flush=True)
    write_report(report, args.out)
    write_markdown(text, args.out)
    return report


def markdown(report: dict) -> str:
    m = report["machine"]
    parts = [f"bench_step {report['date']}, {m['device_kind']} ({m['jax_platform']}, jax {m['jax']})"]
    if report["results"]:
        w = report["workload"]
        parts[0] += (f", {w['model']} {w['dtype']}, {w['rows']} rows x {w['max_turn']} turns, "
                     f"update on {w['updated_rows']} rows")
        rows = []
        for r in report["results"]:
            p, c = r["phases_s"], r["compile_s"]
            roof = f"{100 * r['roofline']['fraction']:.0f}%" if "roofline" in r else "n/a"
            host = f"{r['speedup_vs_host_loop']:.2f}x" if "speedup_vs_host_loop" in r else "-"
            gen = r["generate"]
            hf = f"{gen['speedup']:.2f}x" if "speedup" in gen else "-"
            rows.append([
                r["response_tokens"], f"{p['step']:.2f}", f"{p['rollout']:.2f}", f"{p['logprobs_values']:.2f}",
                f"{p['critic_update']:.2f}", f"{p['actor_update']:.2f}", f"{r['rollout_tokens_per_s']:,.0f}", roof,
                host, hf, f"{c['collect'] + c['learn']:.1f}",
            ])  # fmt: skip
        parts.append(markdown_table(
            ["N", "step s", "rollout s", "log-probs + values s", "critic update s", "actor update s",
             "rollout tok/s", "HBM roofline", "vs host loop", "generate vs transformers", "compile s"], rows))
    if "decode_cost" in report:
        rows = [[c["dtype"], c["window"], f"{c['bytes_per_token'] / 2**20:.2f}",
                 f"{c['ideal_bytes_per_token'] / 2**20:.2f}", f"{c['over_ideal']:.2f}x"]
                for c in report["decode_cost"]["steps"]]  # fmt: skip
        parts.append("Decode step, Qwen2.5-0.5B, batch 128 (XLA, compiled for CPU):\n\n" + markdown_table(
            ["dtype", "cache window", "MiB accessed per token", "ideal MiB per token", "over ideal"], rows))
    return "\n\n".join(parts)


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
