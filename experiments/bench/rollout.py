"""One full multi-turn rollout: the compiled rollout next to a host-orchestrated baseline.

    python -m experiments.bench.rollout                      # smollm2-135m-instruct + qwen2.5-0.5b-random
    python -m experiments.bench.rollout --models smollm2-135m-instruct --groups 2 --group-size 4 \\
        --max-turn 3 --response-length 64                    # a CPU-sized run
    python -m experiments.bench.rollout --quick              # seconds: tiny random model, smoke test

Workload: ``--groups`` × ``--group-size`` SimpleSokoban episodes (default 8 × 16 = 128 rows), up to
``--max-turn`` turns of up to ``--response-length`` tokens each, RAGEN's prompts, sampling at
temperature 1 with top-k off and top-p 1, stopping at the chat template's end of turn. Episodes
depend on what the model writes, so the stop tokens stay on and the workload is whatever the model
does from a fixed ``--seed``: group g plays RAGEN's level of seed ``seed + g`` and turn t samples
with ``fold_in(key(seed), t)``, the same in both modes. A random model never stops and never
names an action, so its workload is fixed: every row plays every turn at the full response length,
with no env steps (``env_steps_per_s`` is 0).

Modes:

- ``compiled``: ``starpo_jax.rollout.multi_turn.make_rollout``: one XLA program for the whole rollout; the KV
  cache of an episode lives across turns, so a turn only prefills its new tokens; answers are parsed
  on token ids and the envs step in the graph.
- ``baseline``: what a veRL + vLLM-style orchestration pays, with the same semantics: a host Python
  loop over turns that, for every playing episode, rebuilds the conversation text from scratch
  (``prompts.build_messages`` + ``chat_text``), tokenises the batch on the host, runs a fresh
  prefill of the whole history and decodes (``sampling.generate``, jitted; a new cache every turn),
  decodes the tokens to text, parses it with ``parse_response_text`` and steps each env one action
  at a time (jitted ``env.step`` on the CPU, as RAGEN's envs run in host Python). The batch keeps
  all rows (finished ones prefill nothing), as the compiled rollout does; prompt widths are padded
  to multiples of ``--bucket`` tokens so ``generate`` recompiles a bounded number of times. The
  history holds the decoded response text, so re-encoding can change the token ids of a response
  (RAGEN's quirk 4 goes further and re-renders the parse); the compiled rollout keeps the sampled
  ids. The two modes therefore play similar but not token-identical rollouts: compare rates, not
  counts. ``identical_episode_rows`` (the share of rows whose generated tokens, turns and actions
  agree) says how close they came.

Metrics, per model and mode: ``wall_s`` (median of ``--repeats`` timed runs, compile excluded);
``compile_s`` (``jit(...).lower(...).compile()`` of the compiled rollout, or of ``generate`` for
each prompt width the baseline meets; the baseline's first, untimed run also compiles its small
env-step and render functions and is reported as ``first_run_s``);
``generated_tokens`` (sum of ``response_tokens``: sampled tokens, stop tokens included),
``env_steps`` (sum of ``num_actions``), ``turns_played``, ``episodes_solved``; ``tokens_per_s`` and
``env_steps_per_s`` (median over the timed runs of count / wall time); ``speedup`` =
compiled ``tokens_per_s`` / baseline ``tokens_per_s``.

Roofline (GPUs with a known HBM bandwidth, see ``experiments.bench.common.hbm_bandwidth``;
H100 SXM is taken as 3.35 TB/s): a decode step must read every weight once, and each generated
token must read the keys and values of its context. From the compiled rollout's trajectories:
``decode_steps`` = Σ over turns of the longest response of that turn (the decode loop runs until
every row stops), ``kv_token_reads`` = Σ over generated tokens of their position. Then

    ideal time  = (decode_steps × weight bytes + kv_token_reads × KV bytes per token) / bandwidth
    fraction    = ideal time / measured wall time

The wall time includes prefill, parsing and env steps, so the fraction is a lower bound on the
decode loop's own efficiency. ``fraction_full_cache`` uses what decoding in the whole cache would
read instead (every row's ``max_len`` slots at every decode step); decode runs in a window of the
cache (``sampling.decode_windows``), so the truth lies between the two.

JSON (``--out``): ``date``, ``workload`` (env, groups, group_size, rows, max_turn, response_length,
max_actions_per_traj, dtype, temperature, seed, bucket, repeats), ``machine`` (jax_platform,
device_kind, cpu_count, jax, note) and ``results``: one entry per model with ``model``,
``weights``, ``num_params``, ``max_len``, ``compiled`` and ``baseline`` (the metrics above;
baseline adds ``prompt_buckets`` and ``first_run_s``), ``speedup``, ``identical_episode_rows`` and,
on a GPU, ``roofline``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

import envs_jax
from experiments.bench.common import hbm_bandwidth, machine, require_positive, timed, write_report
from experiments.bench.rollout_timing import Episodes, Subject, bench_baseline, decode_roofline, summarise
from starpo_jax.models import Decoder, ModelState, bundled, preset
from starpo_jax.models.loading import load_model, smollm2_tokenizer
from starpo_jax.rollout.multi_turn import (
    RolloutPlan,
    RolloutTables,
    TagPlan,
    build_tables,
    initial_states_from_seeds,
    longest_trajectory,
    make_rollout,
    stop_tokens_for,
)
from starpo_jax.runtime import allocator

MODELS = ("smollm2-135m-instruct", "qwen2.5-0.5b-random", "tiny-random")
DEFAULT_MODELS = "smollm2-135m-instruct,qwen2.5-0.5b-random"
MODES = ("compiled", "baseline")


# ---- the models ----------------------------------------------------------------------------------


def load_subject(name: str, dtype: str) -> Subject:
    """smollm2: the bundled GGUF; qwen2.5-0.5b-random: Qwen2.5-0.5B's shapes, random weights and the
    Qwen tokenizer (ChatML); tiny-random: tiny-llama sized to SmolLM2's tokenizer (smoke tests)."""
    dtypes = dict(dtype=dtype, param_dtype=dtype)
    if name == "smollm2-135m-instruct":
        decoder, tokenizer = load_model(name, dtype=dtype)
        return Subject(name, ModelState.split(decoder), tokenizer, "bundled SmolLM2 GGUF (Q4_1, dequantised)")
    if name == "qwen2.5-0.5b-random":
        decoder = Decoder(preset("qwen2.5-0.5b", **dtypes), rngs=nnx.Rngs(0))
        return Subject(name, ModelState.split(decoder), bundled.qwen_tokenizer(), "random")
    if name == "tiny-random":
        tokenizer = smollm2_tokenizer()
        decoder = Decoder(preset("tiny-llama", vocab_size=len(tokenizer), **dtypes), rngs=nnx.Rngs(0))
        return Subject(name, ModelState.split(decoder), tokenizer, "random")
    raise ValueError(f"Unknown model {name!r} for --models; choose from: {', '.join(MODELS)}.")


def make_plan(tokenizer, args) -> tuple[RolloutPlan, RolloutTables]:
    """The rollout plan of the benchmark and its token tables; ``max_len`` defaults to the longest
    conversation the turns can produce (``multi_turn.longest_trajectory``), so no episode runs out of
    context."""
    env = envs_jax.make(args.env)
    plan = RolloutPlan(
        tags=(TagPlan(args.env, env, args.groups, args.max_actions_per_traj),),
        group_size=args.group_size,
        max_turn=args.max_turn,
        response_length=args.response_length,
    )
    tables = build_tables(tokenizer, plan)
    longest = longest_trajectory(plan, tables)
    plan = dataclasses.replace(plan, max_len=args.max_len or longest, stop_tokens=stop_tokens_for(tokenizer, tables))
    return plan, tables


# ---- the compiled rollout ------------------------------------------------------------------------


def bench_compiled(subject: Subject, plan, tables, init_states, key, repeats: int, bar) -> tuple[dict, Any]:
    """Compile once (timed apart), then ``repeats`` timed rollouts with the same inputs."""
    temperature = jnp.float32(1.0)
    args = (subject.model, tables, init_states, key, temperature)
    rollout, compile_s = timed(lambda: make_rollout(plan).lower(*args).compile())
    bar.update()
    runs = []
    for _ in range(repeats):
        traj, seconds = timed(lambda: rollout(*args))
        traj = jax.device_get(traj)
        runs.append((Episodes(traj.response_tokens, traj.num_actions, traj.num_turns, traj.success), seconds))
        bar.update()
    return summarise(runs, compile_s), traj


# ---- the command line ----------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench.rollout",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default=None, help=f"comma-separated, from {', '.join(MODELS)} (default: {DEFAULT_MODELS})"
    )
    parser.add_argument("--env", default="SimpleSokoban", help="an envs_jax registry name")
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=16)
    parser.add_argument("--max-turn", type=int, default=5)
    parser.add_argument("--response-length", type=int, default=400, help="max new tokens per turn")
    parser.add_argument("--max-actions-per-traj", type=int, default=10)
    parser.add_argument("--max-len", type=int, default=None, help="context per row (default: enough for every turn)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per model and mode (median)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True, help="run the host loop")
    parser.add_argument("--bucket", type=int, default=256, help="baseline prompt widths: multiples of this")
    parser.add_argument("--seed", type=int, default=0, help="first level seed and sampling key (both modes)")
    parser.add_argument("--note", default="", help="free text stored in the JSON (e.g. machine load)")
    parser.add_argument("--out", default="bench_results/bench_rollout.json")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 groups x 2, 2 turns, 8 tokens, 1 repeat")
    args = parser.parse_args(argv)
    require_positive(parser, args, "groups", "group_size", "max_turn", "response_length", "max_actions_per_traj",
                     "max_len", "repeats", "bucket")
    if not envs_jax.is_known(args.env):
        parser.error(f"unknown env {args.env!r} in --env; choose from: {envs_jax.known_names()}")
    if args.quick:
        args.groups, args.group_size, args.max_turn, args.response_length, args.repeats = 2, 2, 2, 8, 1
        args.models = args.models or "tiny-random"
    args.models = (args.models or DEFAULT_MODELS).split(",")
    for name in args.models:
        if name not in MODELS:
            parser.error(f"unknown model {name!r} in --models; choose from: {', '.join(MODELS)}")
    return args


def bench_model(name: str, args, dtype: str, bandwidth: float | None, bar) -> dict:
    subject = load_subject(name, dtype)
    plan, tables = make_plan(subject.tokenizer, args)
    init_states = initial_states_from_seeds(plan, args.seed)
    rollout_key = jax.random.key(args.seed)
    row: dict[str, Any] = {"model": name, "weights": subject.weights, "num_params": subject.num_params,
                           "max_len": plan.max_len}
    row["compiled"], traj = bench_compiled(subject, plan, tables, init_states, rollout_key, args.repeats, bar)
    if args.baseline:
        row["baseline"], episodes = bench_baseline(
            subject, plan, init_states, rollout_key, args.repeats, args.bucket, bar
        )
        row["speedup"] = row["compiled"]["tokens_per_s"] / row["baseline"]["tokens_per_s"]
        compiled = Episodes(traj.response_tokens, traj.num_actions, traj.num_turns, traj.success)
        row["identical_episode_rows"] = float(np.mean(np.all(compiled.signature() == episodes.signature(), axis=1)))
    if bandwidth:
        row["roofline"] = decode_roofline(traj, subject, plan, row["compiled"]["wall_s"], bandwidth)
    return row


def table(results: list[dict]) -> str:
    header = (
        f"{'model':<24} {'mode':<9} {'wall s':>8} {'compile s':>9} {'tokens':>8} {'tok/s':>9} "
        f"{'steps':>6} {'steps/s':>8} {'speedup':>7}"
    )
    lines = [header, "-" * len(header)]
    for row in results:
        for mode in MODES:
            if mode not in row:
                continue
            m = row[mode]
            speedup = row.get("speedup", float("nan")) if mode == "compiled" else 1.0
            lines.append(
                f"{row['model']:<24} {mode:<9} {m['wall_s']:8.2f} {m['compile_s']:9.1f} {m['generated_tokens']:8d} "
                f"{m['tokens_per_s']:9.1f} {m['env_steps']:6d} {m['env_steps_per_s']:8.1f} {speedup:7.2f}"
            )
        if "roofline" in row:
            r = row["roofline"]
            lines.append(
                f"{'':<24} roofline: {100 * r['fraction']:.0f}% of the HBM-bound decode time "
                f"({100 * r['fraction_full_cache']:.0f}% counting full-cache reads)"
            )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device = jax.devices()[0]
    dtype = args.dtype or ("bfloat16" if device.platform == "gpu" else "float32")
    bandwidth = hbm_bandwidth(device.device_kind) if device.platform == "gpu" else None
    report: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "workload": {
            "env": args.env, "groups": args.groups, "group_size": args.group_size,
            "rows": args.groups * args.group_size, "max_turn": args.max_turn,
            "response_length": args.response_length, "max_actions_per_traj": args.max_actions_per_traj,
            "dtype": dtype, "temperature": 1.0, "seed": args.seed, "bucket": args.bucket, "repeats": args.repeats,
        },
        "machine": machine(args.note),
        "results": [],
    }  # fmt: skip
    runs_per_model = len(MODES if args.baseline else MODES[:1]) * (1 + args.repeats)
    with tqdm(total=len(args.models) * runs_per_model, desc="bench_rollout") as bar:
        for name in args.models:
            bar.set_postfix_str(name)
            report["results"].append(bench_model(name, args, dtype, bandwidth, bar))
    print(table(report["results"]), flush=True)
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
