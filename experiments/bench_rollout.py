"""One full multi-turn rollout: the compiled rollout next to a host-orchestrated baseline.

    python -m experiments.bench_rollout                      # smollm2-135m-instruct + qwen2.5-0.5b-random
    python -m experiments.bench_rollout --models smollm2-135m-instruct --groups 2 --group-size 4 \\
        --max-turn 3 --response-length 64                    # a CPU-sized run
    python -m experiments.bench_rollout --quick              # seconds: tiny random model, smoke test

Workload: ``--groups`` × ``--group-size`` SimpleSokoban episodes (default 8 × 16 = 128 rows), up to
``--max-turn`` turns of up to ``--response-length`` tokens each, RAGEN's prompts, sampling at
temperature 1 with top-k off and top-p 1, stopping at the chat template's end of turn. Episodes
depend on what the model writes, so the stop tokens stay on and the workload is whatever the model
does from a fixed ``--seed``: group g plays RAGEN's level of seed ``seed + g`` and turn t samples
with ``fold_in(key(seed), t)``, the same in both modes. A random model never stops and never
names an action, so its workload is fixed: every row plays every turn at the full response length,
with no env steps (``env_steps_per_s`` is 0).

Modes:

- ``compiled``: ``starpo_jax.rollout.make_rollout``: one XLA program for the whole rollout; the KV
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

Roofline (GPUs with a known HBM bandwidth, see ``experiments.bench_report.hbm_bandwidth``;
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
import math
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jumanji.types import StepType
from tqdm import tqdm

from experiments.bench_report import hbm_bandwidth, machine, write_report

import envs_jax
from envs_jax.base import GridEnv, symbols_to_text
from starpo_jax import bundled, prompts, sampling
from starpo_jax.models import Decoder, ModelState, preset
from starpo_jax.parsing import decode_response, parse_response_text
from starpo_jax.rollout import (
    RolloutPlan,
    RolloutTables,
    TagPlan,
    build_tables,
    initial_states_from_seeds,
    make_rollout,
    stop_tokens_for,
)

MODELS = ("smollm2-135m-instruct", "qwen2.5-0.5b-random", "tiny-random")
DEFAULT_MODELS = "smollm2-135m-instruct,qwen2.5-0.5b-random"
MODES = ("compiled", "baseline")
LAST = int(StepType.LAST)


# ---- the models ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Subject:
    """A model under test, its tokenizer, and where its weights came from."""

    name: str
    model: ModelState
    tokenizer: Any
    weights: str

    @property
    def num_params(self) -> int:
        return sum(x.size for x in jax.tree.leaves(self.model.params))


def load_subject(name: str, dtype: str) -> Subject:
    """smollm2: the bundled GGUF; qwen2.5-0.5b-random: Qwen2.5-0.5B's shapes, random weights and the
    Qwen tokenizer (ChatML); tiny-random: tiny-llama sized to SmolLM2's tokenizer (smoke tests)."""
    dtypes = dict(dtype=dtype, param_dtype=dtype)
    if name == "smollm2-135m-instruct":
        from starpo_jax.models.loading import load_model

        decoder, tokenizer = load_model(name, dtype=dtype)
        return Subject(name, ModelState.split(decoder), tokenizer, "bundled SmolLM2 GGUF (Q4_1, dequantised)")
    if name == "qwen2.5-0.5b-random":
        decoder = Decoder(preset("qwen2.5-0.5b", **dtypes), rngs=nnx.Rngs(0))
        return Subject(name, ModelState.split(decoder), bundled.qwen_tokenizer(), "random")
    if name == "tiny-random":
        tokenizer = bundled.smollm2_tokenizer()
        decoder = Decoder(preset("tiny-llama", vocab_size=len(tokenizer), **dtypes), rngs=nnx.Rngs(0))
        return Subject(name, ModelState.split(decoder), tokenizer, "random")
    raise ValueError(f"Unknown model {name!r} for --models; choose from: {', '.join(MODELS)}.")


def make_plan(tokenizer, args) -> tuple[RolloutPlan, RolloutTables]:
    """The rollout plan of the benchmark and its token tables; ``max_len`` defaults to the longest
    conversation the turns can produce (the first prompt, ``max_turn - 1`` later prompts and
    ``max_turn`` full responses), so no episode runs out of context."""
    env = envs_jax.make(args.env)
    plan = RolloutPlan(
        tags=(TagPlan(args.env, env, args.groups, args.max_actions_per_traj),),
        group_size=args.group_size,
        max_turn=args.max_turn,
        response_length=args.response_length,
    )
    tables = build_tables(tokenizer, plan)
    pieces = tables.tags[0].prompts
    longest = pieces.first_len + (args.max_turn - 1) * pieces.next_len + args.max_turn * args.response_length
    plan = dataclasses.replace(plan, max_len=args.max_len or longest, stop_tokens=stop_tokens_for(tokenizer, tables))
    return plan, tables


# ---- timing --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Episodes:
    """What a rollout did, per row (numpy), whichever mode produced it."""

    response_tokens: np.ndarray
    num_actions: np.ndarray
    num_turns: np.ndarray
    success: np.ndarray

    def signature(self) -> np.ndarray:
        return np.stack([self.response_tokens, self.num_actions, self.num_turns], axis=1)


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def summarise(runs: list[tuple[Episodes, float]], compile_s: float) -> dict:
    """Median wall time and rates over the timed runs (each run: what it did, its wall time)."""
    tokens = [int(e.response_tokens.sum()) for e, _ in runs]
    steps = [int(e.num_actions.sum()) for e, _ in runs]
    times = [t for _, t in runs]
    last = runs[-1][0]
    return {
        "wall_s": statistics.median(times),
        "run_s": times,
        "compile_s": compile_s,
        "generated_tokens": int(statistics.median(tokens)),
        "env_steps": int(statistics.median(steps)),
        "turns_played": int(last.num_turns.sum()),
        "episodes_solved": int(last.success.sum()),
        "tokens_per_s": statistics.median(n / t for n, t in zip(tokens, times)),
        "env_steps_per_s": statistics.median(n / t for n, t in zip(steps, times)),
    }


# ---- the compiled rollout ------------------------------------------------------------------------


def bench_compiled(subject: Subject, plan, tables, init_states, key, repeats: int, bar) -> tuple[dict, Any]:
    """Compile once (timed apart), then ``repeats`` timed rollouts with the same inputs."""
    temperature = jnp.float32(1.0)
    args = (subject.model, tables, init_states, key, temperature)
    rollout, compile_s = timed(lambda: make_rollout(plan).lower(*args).compile())
    bar.update()
    runs = []
    for _ in range(repeats):
        traj, seconds = timed(lambda: jax.block_until_ready(rollout(*args)))
        traj = jax.device_get(traj)
        runs.append((Episodes(traj.response_tokens, traj.num_actions, traj.num_turns, traj.success), seconds))
        bar.update()
    return summarise(runs, compile_s), traj


# ---- the host-orchestrated baseline --------------------------------------------------------------


@dataclasses.dataclass
class HostEpisode:
    """One env's episode as RAGEN's host loop keeps it: env state and the message history."""

    env: Any
    state: Any
    action_names: tuple[str, ...]
    budget: int
    history: list[dict]
    num_actions: int = 0
    num_turns: int = 0
    response_tokens: int = 0
    done: bool = False
    success: bool = False


@dataclasses.dataclass(frozen=True)
class HostEnv:
    """An env's host-side operations, jitted once on the CPU (op-by-op dispatch would dominate)."""

    env: Any
    step: Any
    render: Any
    reward_values: tuple[float, ...]

    @classmethod
    def of(cls, env) -> "HostEnv":
        if isinstance(env, GridEnv):
            symbols = jax.jit(env.render_symbols)
            render = lambda state: symbols_to_text(np.asarray(symbols(state)), env.symbols)  # noqa: E731
        else:
            render = env.render_text
        return cls(env, jax.jit(env.step), render, tuple(env.step_reward_values))

    def python_reward(self, reward) -> float:
        """The env's float32 reward as the Python double RAGEN's env returns (nearest known value)."""
        return min(self.reward_values, key=lambda v: abs(v - float(reward)))


def start_episodes(plan: RolloutPlan, host_envs, init_states) -> list[HostEpisode]:
    cpu = jax.devices("cpu")[0]
    episodes = []
    for tag, host, states in zip(plan.tags, host_envs, init_states):
        states = jax.device_put(jax.device_get(states), cpu)
        for i in range(tag.n_groups * plan.group_size):
            state = jax.tree.map(lambda x: x[i], states)
            names = tuple(tag.env.action_names[int(i)] for i in tag.env.action_name_ids(state))
            history = [{"state": host.render(state), "actions_left": tag.max_actions_per_traj}]
            episodes.append(HostEpisode(tag.env, state, names, tag.max_actions_per_traj, history))
    return episodes


def host_turn(episode: HostEpisode, host: HostEnv, text: str, plan: RolloutPlan) -> None:
    """RAGEN's es_manager step for one env: parse, run the valid actions within the budget, record."""
    parsed = parse_response_text(text, episode.action_names, plan.max_actions_per_turn, plan.enable_think)
    step_rewards, env_done = [], False
    for action in parsed.valid_action_ids[: episode.budget - episode.num_actions]:
        episode.state, ts = host.step(episode.state, action)
        step_rewards.append(host.python_reward(ts.reward))
        if int(ts.step_type) == LAST:
            env_done, episode.success = True, bool(ts.extras["success"])
            break
    episode.num_actions += len(step_rewards)
    episode.num_turns += 1
    response = prompts.forced_prefix(plan.enable_think) + text
    episode.history[-1].update(llm_response=response, reward=prompts.turn_reward(step_rewards))
    episode.history.append({"state": host.render(episode.state), "actions_left": episode.budget - episode.num_actions})
    episode.done = env_done or episode.num_actions >= episode.budget


def conversation_text(episode: HostEpisode, tokenizer, plan: RolloutPlan, prefix: str) -> str:
    max_tokens = 100  # the "Max response length" the prompt states: build_tables' default, RAGEN's value
    messages = prompts.build_messages(episode.history, prefix, max_tokens, plan.enable_think)
    return prompts.chat_text(tokenizer, messages, add_generation_prompt=True, enable_think=plan.enable_think)


def padded_batch(ids: dict[int, list[int]], batch: int, bucket: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded prompts [batch, width] (width: the longest, rounded up to ``bucket``)."""
    width = bucket * math.ceil(max(len(x) for x in ids.values()) / bucket)
    tokens = np.full((batch, width), pad_id, np.int32)
    lengths = np.zeros((batch,), np.int32)
    for b, row in ids.items():
        tokens[b, : len(row)] = row
        lengths[b] = len(row)
    return tokens, lengths


def host_rollout(
    subject: Subject, plan: RolloutPlan, host_envs, init_states, key, bucket: int, compile_s: dict
) -> Episodes:
    """The baseline: the same rollout, orchestrated turn by turn from host Python.

    ``generate`` is compiled ahead of time for each new prompt width, timed into ``compile_s``
    (width -> seconds); later calls of that width reuse the executable.
    """
    tokenizer, R = subject.tokenizer, plan.response_length
    episodes = start_episodes(plan, host_envs, init_states)
    tag_of_row = np.concatenate([np.full(sl.stop - sl.start, i) for i, sl in enumerate(plan.row_slices())])
    prefixes = [prompts.env_instruction(t.env, t.max_actions_per_traj) for t in plan.tags]
    stop_tokens = jnp.asarray(plan.stop_tokens, jnp.int32)
    settings = dict(max_new_tokens=R, temperature=1.0, stop_tokens=stop_tokens, pad_id=plan.pad_id)
    for turn in range(plan.max_turn):
        playing = [b for b, e in enumerate(episodes) if not e.done]
        texts = [conversation_text(episodes[b], tokenizer, plan, prefixes[tag_of_row[b]]) for b in playing]
        encoded = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        ids = {}
        for b, row in zip(playing, encoded):
            if len(row) + R > plan.max_len:  # the compiled rollout's context budget
                episodes[b].done = True
            else:
                ids[b] = row
        if not ids:
            break
        tokens, lengths = padded_batch(ids, len(episodes), bucket, plan.pad_id)
        width = tokens.shape[1]
        args = (subject.model, tokens, lengths, jax.random.fold_in(key, turn))
        kwargs = dict(settings, cache_size=width + R)
        if width not in compile_s:
            _, compile_s[width] = timed(lambda: sampling.generate.lower(*args, **kwargs).compile())
        out = sampling.generate(*args, **kwargs)
        response_ids, response_lengths = jax.device_get((out.tokens, out.lengths))
        for b in ids:
            n = int(response_lengths[b])
            episodes[b].response_tokens += n
            host_turn(episodes[b], host_envs[tag_of_row[b]], decode_response(tokenizer, response_ids[b, :n]), plan)
    return Episodes(
        response_tokens=np.array([e.response_tokens for e in episodes]),
        num_actions=np.array([e.num_actions for e in episodes]),
        num_turns=np.array([e.num_turns for e in episodes]),
        success=np.array([e.success for e in episodes]),
    )


def bench_baseline(subject: Subject, plan, init_states, key, repeats: int, bucket: int, bar) -> tuple[dict, Episodes]:
    """A first run that compiles what it meets, then ``repeats`` timed runs with the same inputs."""
    host_envs = [HostEnv.of(t.env) for t in plan.tags]
    compile_s: dict[int, float] = {}
    run = lambda: host_rollout(subject, plan, host_envs, init_states, key, bucket, compile_s)  # noqa: E731
    _, first_s = timed(run)
    bar.update()
    runs = []
    for _ in range(repeats):
        runs.append(timed(run))
        bar.update()
    result = summarise(runs, compile_s=sum(compile_s.values()))
    result["prompt_buckets"] = sorted(compile_s)
    result["first_run_s"] = first_s
    return result, runs[-1][0]


# ---- roofline ------------------------------------------------------------------------------------


def decode_roofline(traj, subject: Subject, plan: RolloutPlan, wall_s: float, bandwidth: float) -> dict:
    """HBM-bound time of the compiled rollout's decode (see the module docstring)."""
    config = subject.model.merge().config
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(subject.model.params))
    kv_itemsize = jnp.dtype(config.dtype).itemsize
    kv_bytes_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * kv_itemsize
    played = np.asarray(traj.turn_played)
    response_len = np.where(played, np.asarray(traj.turn_end) - np.asarray(traj.turn_start), 0)
    decode_steps = int(response_len.max(axis=0).sum())
    kv_token_reads = int(np.nonzero(np.asarray(traj.loss_mask))[1].sum())
    ideal_s = (decode_steps * weight_bytes + kv_token_reads * kv_bytes_per_token) / bandwidth
    full_cache_s = decode_steps * (weight_bytes + plan.batch_size * plan.max_len * kv_bytes_per_token) / bandwidth
    return {
        "hbm_bytes_per_s": bandwidth,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_bytes_per_token,
        "decode_steps": decode_steps,
        "kv_token_reads": kv_token_reads,
        "ideal_s": ideal_s,
        "ceiling_tokens_per_s": int(traj.response_tokens.sum()) / ideal_s,
        "fraction": ideal_s / wall_s,
        "fraction_full_cache": full_cache_s / wall_s,
    }


# ---- the command line ----------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
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
    row = {"model": name, "weights": subject.weights, "num_params": subject.num_params, "max_len": plan.max_len}
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
    report = {
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
    main()
