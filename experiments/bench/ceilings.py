"""This machine's two ceilings, which every phase of an iteration is read against.

- **Compute**: float32 matrix products of two ``--size`` × ``--size`` operands (2·n³ FLOPs each),
  as XLA runs them on its device (on a CPU: every core, its threads splitting the product).
- **Memory**: copy bandwidth, a float32 array of ``--copy-mib`` MiB read and written in place
  (``x + 1``, its buffer donated: 2 × its bytes a pass, the whole array far larger than the caches).

Beside them, what reading alone reaches: the same array read once by a matrix-vector product
(``--copy-mib`` MiB as rows of 4,096 floats times one vector), as a decode step reads its weights
and its cache. It is reported, not read against: the in-place pass is the memory ceiling of every
account. On a VM the two can differ by 2× and vary apart within minutes (docs/benchmarks.md), so a
reader of a bytes-bound phase sees both.

A phase whose products dominate cannot run faster than the first; one that streams its operands
(a decode step reading every weight for a few rows) cannot beat the second times its arithmetic
intensity, FLOPs per byte moved. Each ceiling is the fastest of ``--repeats`` timed runs, after a
compile and a warm-up run (its median beside it): on a shared host other work only slows a run, and
a ceiling read from slowed runs would pass for the machine's; ``cpu_per_wall`` is the process's CPU
time over wall time (the cores kept busy). Other work on the machine lowers both: the report records
the load average, and a figure taken under load is not this machine's ceiling.

``--config PATH`` (repeatable; ``--config.KEY=VALUE`` overrides apply to each) adds the account of
one training iteration of that config, as ``experiments.run`` runs it (its bundled weights, its
compiled ``collect`` and ``learn``, its seed's first batches; a format warm-up, where the config asks
for one, is not run), phase by phase: the first turn's prefill, the later turns' appends, the
decode, and the update (forward, backward and rematerialisation in one program).
``--steps`` warm iterations are timed (median); ``collect`` is one program, so its phases are timed
as programs of their own on the first iteration's batch (each the median of ``--repeats`` calls: a
call that meets fresh pages takes several times longer), before the update is compiled
(``sampling.append``, ``sampling.decode``
for as many steps as that turn's longest answer, each row stopping where its answer did,
``LLMResponder.prefill_first_prompts``), and what the rollout spends besides (env steps, parsing,
buffer writes) is the rest. Per phase:

- FLOPs from the shapes (``product_flops``, ``attention_flops``: the products of the real tokens,
  a prompt counted once where the program shares it (the rollout's first prompts once each and
  the head they begin with once, the update's once per group); an update's backward twice its
  forward, and the rematerialised products once more), and from XLA: the matrix products of the
  compiled program, those it hands to the CPU products kernel included (``hlo_bytes.hlo_flops``,
  loops counted by their trip counts: what is computed,
  padding and masked cache slots included; for a decode, its loop with every row kept to the end,
  an upper bound, since the rows that stop early move out of the loop's batch), and
  ``compiled.cost_analysis()`` as XLA reports it (a loop's body counted once);
- bytes: weights and KV cache read and written (the least the phase must move: where the CPU
  kernel attends, a first prompt that rows share read once a step for them all, as the kernel
  can, and the later phases' caches marked so, as the rollout's are) and what the compiled program
  accesses (``hlo_bytes.hlo_bytes``);
- the ceiling that binds: the time the least work would take at the measured peak FLOP/s or copy
  bandwidth, whichever is longer, as a fraction of the measured time ("of ceiling"); and the same
  for what XLA computes ("XLA work");
- the same least work in sequence ("in sequence"): each kind of the phase's work at the
  ceiling that binds it, one after the other. The weight products (and the logits) are bound by the
  peak; the attention to a KV cache, in a decode step, by reading the cache. A decode step cannot
  overlap them: each layer's attention waits for its queries and the next product for its output,
  and the next token waits for the last layer. The first bound assumes they overlap in full; this
  one is the roofline of each kind, summed. The update's third kind, its passes over the weights
  (accumulating each micro-batch's gradients, the optimiser's step), is bound by the bandwidth and
  waits for the products too. Where one kind dominates (a prompt block's products, the update's)
  the two bounds agree within the other kinds' share;
- the same in sequence with the decode's weight products at the rate products of its rows reach
  ("at its rows"; ``products_at_rows``: a decode step's products at the batch's rows, timed alone,
  by the program the decode runs them with: the CPU kernel's where it takes them, else XLA's):
  products of 64 or 128 rows, each layer's weights read from memory, fall well short of the large
  product's peak on a CPU, so this column parts what the decode's shapes cost on this machine from
  what the program loses beside them. The other phases' products have thousands of rows: their
  column is "in sequence". The decode's rows shrink as its rows stop, to slower products: for a
  decode whose rows end at different steps this bound is the more optimistic.

The rollout's phases are also summed: the rollout's least time at the ceilings over its measured
phases, all three ways. And the rollout as it runs: each timed iteration's least time (in sequence,
and at the decode's rows), counted from its own batch, over its ``collect`` time (median): the phases
timed apart each pay for a program of their own (a fresh cache for each), the rollout does not.

    python -m experiments.bench.ceilings                   # writes bench_results/bench_ceilings.json
    python -m experiments.bench.ceilings --quick           # smoke run
    python -m experiments.bench.ceilings --config configs/learn_bandit.py --config configs/learn_frozen_lake.py
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from experiments.bench.common import (
    built_or_exit,
    checked_or_exit,
    machine,
    markdown_table,
    parse_with_overrides,
    require_positive,
    write_markdown,
    write_report,
)
from experiments.bench.hlo_bytes import hlo_bytes, hlo_flops
from starpo_jax.forward import policy_tokens_per_row
from starpo_jax.models import cpu_kernels, decoder
from starpo_jax.rollout import sampling
from starpo_jax.rollout.multi_turn import (
    LLMResponder,
    distinct_prompt_of_rows,
    first_rows_of_distinct_prompts,
    prefill_batch_sizes,
)
from starpo_jax.runtime import allocator
from starpo_jax.runtime.planning import iteration_program, kv_bytes_per_token
from starpo_jax.train import init_train_state, jit_iteration, make_train_step, policy_weights


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m experiments.bench.ceilings", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", type=int, help="rows and columns of each matrix (default 2048; --quick 256)")
    p.add_argument("--copy-mib", type=int, help="MiB of the array copied in place (default 512; --quick 16)")
    p.add_argument("--repeats", type=int, help="timed runs of each: a ceiling is the fastest, a phase the median (default 5; --quick 2)")
    p.add_argument("--quick", action="store_true", help="smoke run: smaller sizes, fewer repeats")
    p.add_argument("--config", action="append", default=[],
                   help="also account one iteration of this config (file[:preset]) phase by phase; repeatable")
    p.add_argument("--steps", type=int, default=3, help="warm iterations timed per --config (median)")
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else ran)")
    p.add_argument("--out", default="bench_results/bench_ceilings.json")
    args = parse_with_overrides(p, argv)
    if args.overrides and not args.config:
        p.error(f"{args.overrides[0]} overrides a config: give the --config it applies to")
    defaults = {"size": 256, "copy_mib": 16, "repeats": 2} if args.quick else {"size": 2048, "copy_mib": 512, "repeats": 5}
    for name, default in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    require_positive(p, args, "size", "copy_mib", "repeats", "steps")
    return args


def timed_runs(run, repeats: int) -> tuple[list[float], float]:
    """Wall seconds of ``repeats`` calls of ``run`` (each blocked on), after one untimed warm-up
    call, and the process's CPU seconds per wall second over the timed calls."""
    jax.block_until_ready(run())
    seconds, cpu0, wall0 = [], time.process_time(), time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run())
        seconds.append(time.perf_counter() - t0)
    return seconds, (time.process_time() - cpu0) / (time.perf_counter() - wall0)


def matmul_ceiling(size: int, repeats: int) -> dict:
    """GFLOP/s of one float32 ``size`` × ``size`` product."""
    a, b = jax.random.normal(jax.random.PRNGKey(0), (2, size, size), jnp.float32)
    product = jax.jit(jnp.matmul)
    seconds, cpu_per_wall = timed_runs(lambda: product(a, b), repeats)
    flops = 2 * size**3
    return {"size": size, "flops": flops, "runs_s": seconds, "gflop_per_s": flops / min(seconds) / 1e9,
            "median_gflop_per_s": flops / statistics.median(seconds) / 1e9, "cpu_per_wall": cpu_per_wall}


def memory_rates(moved: int, seconds: list[float]) -> dict:
    """GB/s of moving ``moved`` bytes in each timed run: the fastest (the figure) and the median."""
    return {"gb_per_s": moved / min(seconds) / 1e9, "median_gb_per_s": moved / statistics.median(seconds) / 1e9}


def copy_ceiling(mib: int, repeats: int) -> dict:
    """GB/s of an in-place pass over a float32 array of ``mib`` MiB: read once, written once."""
    x = jnp.zeros((mib * 2**20 // 4,), jnp.float32)
    add_one = jax.jit(lambda y: y + 1.0, donate_argnums=0)  # donated: written where it was read

    def run():
        nonlocal x
        x = add_one(x)
        return x

    seconds, cpu_per_wall = timed_runs(run, repeats)
    moved = 2 * x.size * 4
    return {"bytes": x.size * 4, "bytes_moved": moved, "runs_s": seconds, **memory_rates(moved, seconds),
            "cpu_per_wall": cpu_per_wall}


READ_ROW = 4096  # floats a row of the read's matrix: a whole MiB is 64 rows


def read_rate(mib: int, repeats: int) -> dict:
    """GB/s of reading a float32 array of ``mib`` MiB once: a matrix-vector product over it."""
    x = jnp.zeros((mib * 2**20 // 4,), jnp.float32)
    ones = jnp.ones((READ_ROW,), jnp.float32)
    read = jax.jit(lambda y: y.reshape(-1, READ_ROW) @ ones)
    seconds, cpu_per_wall = timed_runs(lambda: read(x), repeats)
    return {"bytes": x.size * 4, "runs_s": seconds, **memory_rates(x.size * 4, seconds), "cpu_per_wall": cpu_per_wall}


def memory_ceilings(mib: int, repeats: int) -> dict:
    """The copy bandwidth (the memory ceiling) and what reading alone reaches, one after the other."""
    return {"copy": copy_ceiling(mib, repeats), "read": read_rate(mib, repeats)}


# ---- one iteration of a config, phase by phase -----------------------------------------------------


def linear_params(config) -> int:
    """Weights of one token's products through the blocks (attention and MLP projections)."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return c.num_layers * (2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size)


def product_flops(config, tokens: int, logits: int) -> int:
    """FLOPs of the weight products of ``tokens`` positions through the blocks and of ``logits``
    vocabulary projections."""
    return 2 * linear_params(config) * tokens + 2 * config.hidden_size * config.vocab_size * logits


def attention_flops(config, attended: int) -> int:
    """FLOPs of ``attended`` (query, key) pairs: the scores and the weighted sum of values, every
    head and layer."""
    return 4 * config.num_layers * config.num_heads * config.head_dim * attended


def work(**kinds: tuple[int, int]) -> dict:
    """A phase's least work: (FLOPs, bytes) of each kind (its weight products, its attention, the
    update's passes over the weights), and their sums (``flops``, ``least_bytes``)."""
    return {"flops": sum(f for f, _ in kinds.values()), "least_bytes": sum(b for _, b in kinds.values()),
            "kinds": {name: list(kind) for name, kind in kinds.items()}}


def least_seconds(phase: dict, peak_flops: float, bandwidth: float) -> tuple[float, float]:
    """The least time of a phase's work at the ceilings: the whole at the ceiling that binds it (its
    kinds overlapped), and each kind at its own, one after the other (the docstring)."""
    in_sequence = in_sequence_seconds(phase, peak_flops, bandwidth)
    # Overlapped is never slower than in sequence; the two divide and sum in different orders, so
    # where one ceiling binds every kind they differ in the last bits, and min() keeps the order.
    whole = min(max(phase["flops"] / peak_flops, phase["least_bytes"] / bandwidth), in_sequence)
    return whole, in_sequence


def in_sequence_seconds(phase: dict, peak_flops: float, bandwidth: float, products_flops: float | None = None) -> float:
    """Each kind of a phase's work at the ceiling that binds it, one after the other; the weight
    products at ``products_flops`` FLOP/s where given (the rate products of the phase's rows reach),
    else at the peak."""
    rate = {"products": products_flops or peak_flops}
    return sum(max(flops / rate.get(kind, peak_flops), moved / bandwidth) for kind, (flops, moved) in phase["kinds"].items())


def products_at_rows(config, rows: int, repeats: int) -> dict:
    """GFLOP/s of one decode step's weight products at ``rows`` rows, as ``Decoder.extend`` computes
    them (``decoder.block_products``: the CPU kernel's where a decode step takes it, else XLA's):
    each block's products with the model's shapes, grouped as a block groups them (q, k and v; o;
    gate and up; down), each layer's weights its own (read from memory, as a decode step reads
    them), each product waiting for the one before, then the vocabulary projection. A decode step
    of that many rows cannot run its products faster than this on the machine; products of few rows
    fall short of the large product's peak (docs/benchmarks.md). Its fastest run, as the ceilings'."""
    c = config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"q_proj": (c.hidden_size, q), "k_proj": (c.hidden_size, kv), "v_proj": (c.hidden_size, kv),
              "o_proj": (q, c.hidden_size), "gate_proj": (c.hidden_size, c.intermediate_size),
              "up_proj": (c.hidden_size, c.intermediate_size), "down_proj": (c.intermediate_size, c.hidden_size)}
    keys = iter(jax.random.split(jax.random.PRNGKey(1), c.num_layers * len(shapes) + 2))
    normal = lambda shape: 0.02 * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    layers = [{name: normal(shape) for name, shape in shapes.items()} for _ in range(c.num_layers)]
    embed = normal((c.vocab_size, c.hidden_size))
    x = normal((rows, 1, c.hidden_size))  # a decode step: one token a row
    products = decoder.block_products(x, layers)

    @jax.jit
    def step(x, layers, embed):
        for w in layers:
            q, k, v = products(x, (w["q_proj"], w["k_proj"], w["v_proj"]))
            (o,) = products(q + 1e-3 * jnp.sum(k + v, axis=-1, keepdims=True), (w["o_proj"],))
            x = x + o
            gate, up = products(x, (w["gate_proj"], w["up_proj"]))
            (down,) = products(jax.nn.silu(gate) * up, (w["down_proj"],))
            x = x + down
        return jnp.einsum("btd,vd->btv", x, embed)

    seconds, _ = timed_runs(lambda: step(x, layers, embed), repeats)
    flops = product_flops(config, rows, rows)
    return {"rows": rows, "products": "kernel" if products is decoder.kernel_products else "xla", "flops": flops,
            "runs_s": seconds,
            "gflop_per_s": flops / min(seconds) / 1e9}


def decode_schedule(answers, steps: int, sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(rows computed, rows still answering) at each step of ``sampling.decode_loop`` on one device
    for answers of these lengths: the loop moves its live rows into the next of ``sizes``
    (descending) once they fit it with ``sampling.MIN_STEPS_AFTER_MOVE`` steps of the budget left,
    and ends when the longest answer does."""
    answers = np.asarray(answers)
    schedule, size = [], 0
    for step in range(steps):
        live = answers > step
        most = int(live.sum())
        if not most:
            break
        while size + 1 < len(sizes) and most <= sizes[size + 1] and step + sampling.MIN_STEPS_AFTER_MOVE <= steps:
            size += 1
        schedule.append((sizes[size], most))
    return schedule


def products_rate(schedule: list[tuple[int, int]], gflop_per_s: dict[int, float]) -> float:
    """FLOP/s of a decode's products, each step's live rows at the rate products of the rows it
    computes reach (``gflop_per_s`` by rows)."""
    return sum(live for _, live in schedule) / sum(live / (gflop_per_s[rows] * 1e9) for rows, live in schedule)


def reachable_seconds(phase: dict, peak_flops: float, bandwidth: float, gflop_per_s: dict[int, float]) -> float:
    """A phase's least time in sequence, a decode's products at the rates of its rows (``products_rate``
    of its schedule); the other phases' products have thousands of rows, at the peak."""
    rate = products_rate(phase["schedule"], gflop_per_s) if phase["phase"] == "decode" else None
    return in_sequence_seconds(phase, peak_flops, bandwidth, rate)


def _triangle(start, count):
    """Sum of ``start + 1 .. start + count`` per element: the slots attended by ``count`` tokens
    appended after ``start`` held ones."""
    start, count = np.asarray(start, np.int64), np.asarray(count, np.int64)
    return int(np.sum(count * start + count * (count + 1) // 2))


def xla_counts(compiled, unknown_trips: int = 1) -> dict:
    """What XLA says a compiled program does: its products' FLOPs and the bytes it accesses, loops
    counted by their trip counts (``unknown_trips`` for the decode loop), and ``cost_analysis()``."""
    text = compiled.as_text()
    cost = compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    return {"flops": hlo_flops(text, unknown_trips), "bytes": hlo_bytes(text, unknown_trips)[0],
            "cost_analysis_flops": float(cost.get("flops", 0.0)),
            "cost_analysis_bytes": float(cost.get("bytes accessed", 0.0))}


def shared_reads_saved(reads, group, shared) -> int:
    """Cache slots that ``reads`` [B] passes over each row's cache need not read from memory: a
    prefix group's ``shared`` first slots (its rows' first prompt) are read once a pass for all of
    its rows, not once for each (the CPU kernel's, ``KVCache.prefix_group``)."""
    reads, group, shared = (np.asarray(x, np.int64) for x in (reads, group, shared))
    once = sum(int(shared[group == g].max() * reads[group == g].max()) for g in np.unique(group))
    return int(np.sum(reads * shared)) - once


def append_trips(rows: int, width: int, num_new) -> int:
    """Trips of ``sampling.append``'s chunk loop for a block of ``width`` tokens of ``rows`` rows,
    ``num_new`` of them real: the loop ends on its data, so XLA's count needs them told."""
    _, size = sampling.even_chunks(width, sampling.chunk_tokens(rows, sampling.CHUNK_SIZE))
    return int(sampling.chunks_used(int(np.max(num_new)), size))


def _timed_median(run, repeats: int) -> list[float]:
    return timed_runs(run, repeats)[0]


def rollout_phases(exp, state, traj, repeats: int, timed: bool = True) -> list[dict]:
    """The rollout's prefill, appends and decode as programs of their own on ``traj``'s shapes:
    their FLOPs and bytes from the shapes and from XLA, and their seconds (median of ``repeats``).
    ``timed=False``: the shapes' counts only, nothing compiled or run."""
    plan, settings = exp.train_plan, exp.settings
    policy = sampling.sampling_policy(exp.model.graphdef, policy_weights(settings, state))
    config = policy.merge().config
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(policy.params))
    kv = kv_bytes_per_token(config)
    B, G = plan.batch_size, plan.num_groups
    start, end, played = (np.asarray(x) for x in jax.device_get((traj.turn_start, traj.turn_end, traj.turn_played)))
    held = np.concatenate([np.zeros((B, 1), np.int32), end[:, :-1]], axis=1)  # tokens before each turn's prompt
    prompt = np.where(played, start - held, 0)
    answer = np.where(played, end - start, 0)
    rng = np.random.default_rng(0)
    vocab = config.vocab_size

    def new_cache(rows: int, held: int = 0):
        """A cache of ``rows`` rows holding ``held`` tokens each; only its shapes where nothing runs
        (the arguments' shapes are all a count needs)."""
        make = functools.partial(sampling.init_cache, config, rows, plan.max_len)
        return (make() if timed else jax.eval_shape(make)).replace(lengths=np.full(rows, held, np.int32))

    empty = new_cache(B)
    phases: list[dict] = []

    def add(name, turn, program, args, least: dict, trips=1, counted=None):
        """``program``: a jitted function, compiled and timed here where the phase is timed. XLA counts
        it, or ``counted``: the programs that do its work, ``(jitted, args, trips)`` each."""
        phases.append({"phase": name, "turn": turn, **least})
        if timed:
            compiled = program.lower(*args).compile()
            parts = [xla_counts(f.lower(*a).compile(), n) for f, a, n in counted or [(program, args, trips)]]
            phases[-1] |= {"xla": {k: sum(part[k] for part in parts) for k in parts[0]},
                           "runs_s": _timed_median(lambda: compiled(*args), repeats)}

    # The first turn: each distinct first prompt of the batch computed once, in the smallest batch
    # that holds them (LLMResponder.prefill_first_prompts), on the batch's own prompts.
    first_width = max(t.prompts.first_len for t in exp.train_tables.tags)
    n0 = prompt[:, 0]
    ids = np.asarray(jax.device_get(traj.tokens))[:, :first_width]
    first_rows = first_rows_of_distinct_prompts(ids, n0)
    leaders = n0[first_rows]
    # The later phases' caches hold each row's first prompt copied from one prefill, as the rollout's
    # do: one prefix group per distinct prompt, whose slots the CPU kernel reads once for its rows.
    group = distinct_prompt_of_rows(ids, n0).astype(np.int32)
    shared = n0.astype(np.int32) if cpu_kernels.available() else np.zeros_like(n0, np.int32)

    def cache_of(lengths):
        return empty.replace(lengths=lengths.astype(np.int32), prefix_group=group, prefix_length=shared)

    rows = min(n for n in prefill_batch_sizes(G) if n >= len(leaders))
    prefill = jax.jit(LLMResponder(plan).prefill_first_prompts)
    args: tuple = (policy, ids, n0, empty)
    # The head every first prompt begins with once, then each distinct prompt's own tokens
    # (LLMResponder.prefill). XLA's count reads every branch of the program's switch: counted on the
    # appends of the one that runs, each loop with its own trips.
    head = plan.shared_head
    own = leaders - head
    computed = head + int(own.sum())
    lead = np.resize(first_rows, rows)
    counted = [(sampling.append, (policy, new_cache(rows, head), ids[lead, head:], n0[lead] - head),
                append_trips(rows, first_width - head, own))]
    if head:
        counted.append((sampling.append, (policy, new_cache(1), ids[:1, :head], np.array([head], np.int32)),
                        append_trips(1, head, head)))
    add("prefill", 1, prefill, args,
        work(products=(product_flops(config, computed, len(leaders)), weights),
             attention=(attention_flops(config, _triangle(0, head) + _triangle(np.full_like(own, head), own)),
                        computed * kv)),
        counted=counted)
    next_width = max(t.prompts.next_len for t in exp.train_tables.tags)
    for t in range(start.shape[1]):
        active = played[:, t]
        if not active.any():
            break
        if t:  # a later turn's prompt appended to every row still playing
            args = (policy, cache_of(held[:, t]), rng.integers(0, vocab, (B, next_width), np.int32),
                    prompt[:, t].astype(np.int32))
            n = prompt[:, t]
            read = int((held[:, t] * active).sum() + n.sum()) - shared_reads_saved(active, group, shared)
            add("appends", t + 1, sampling.append, args,
                work(products=(product_flops(config, int(n.sum()), int(active.sum())), weights),
                     attention=(attention_flops(config, _triangle(held[:, t], n)), read * kv)),
                trips=append_trips(B, next_width, n))
        steps = int(answer[:, t].max())
        if steps == 0:
            continue
        cache = cache_of(start[:, t])
        logits = np.zeros((B, vocab), np.float32)

        def decode(model, cache, logits, key, budgets, steps=steps, min_live_rows=sampling.MIN_LIVE_ROWS):
            return sampling.decode(model, cache, logits, key, max_new_tokens=steps, temperature=settings.rollout_temperature,
                                   top_k=plan.top_k, top_p=plan.top_p, stop_tokens=jnp.asarray([-1], jnp.int32),
                                   active=budgets > 0, budgets=budgets, pad_id=plan.pad_id, min_live_rows=min_live_rows)

        # each row stops where its answer ended (random weights never stop on their own), and the
        # loop where the longest did
        a = answer[:, t]
        schedule = decode_schedule(a, steps, sampling.live_batch_sizes(B, sampling.MIN_LIVE_ROWS)[::-1])
        args = (policy, cache, logits, jax.random.key(t), jnp.asarray(a, jnp.int32))
        # XLA's count of a loop that ends on its data takes every trip as ``steps``: counted on the loop
        # that keeps every row to the end (the decode's moves into smaller batches off), an upper bound
        every_row = functools.partial(decode, min_live_rows=B + 1)
        add("decode", t + 1, jax.jit(decode), args,
            work(products=(product_flops(config, int(a.sum()), int(a.sum())), steps * weights),
                 attention=(attention_flops(config, _triangle(start[:, t], a)),
                            (_triangle(start[:, t], a) - shared_reads_saved(a, group, shared)) * kv),
                 ) | {"schedule": schedule},
            counted=[(jax.jit(every_row), args, steps)])
    return phases


def update_phase(exp, learn, traj, layout, seconds: list[float]) -> dict:
    """The update (``learn``, compiled for ``layout``): its FLOPs from the shapes, forward,
    backward and rematerialisation apart, and from XLA; the least bytes (weights, gradients and
    the optimiser's moments)."""
    plan, settings = exp.train_plan, exp.settings
    config = exp.model.merge().config
    M = settings.kept_groups * plan.group_size
    length, split = (np.asarray(x) for x in jax.device_get((traj.length, traj.turn_start[:, 0])))
    # The kept rows are the filter's; every row of the batch stands in for them at its mean size.
    first = float(split.mean())  # a first prompt, computed once for each micro-batch that holds it
    rest = float((length - split).mean())  # the rest of a row
    answers = float(np.asarray(traj.response_tokens).mean())
    prompts = layout.prompts * (M // settings.micro_batch_size) if layout.prefix else M
    tokens = prompts * first + M * rest
    attended = prompts * first * (first + 1) / 2 + M * (rest * first + rest * (rest + 1) / 2)
    products = product_flops(config, int(tokens), int(M * answers))
    attention = attention_flops(config, int(attended))
    logits = product_flops(config, 0, int(M * answers))
    # what the backward recomputes: the logits' chunks, with "dots" the attention, with "layer" all
    remat_products, remat_attention = {"none": (logits, 0), "dots": (logits, attention),
                                       "layer": (products, attention)}[config.remat]
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(exp.model.params))
    micro = M // settings.micro_batch_size * settings.ppo_epochs
    steps = M // settings.ppo_mini_batch_size * settings.ppo_epochs
    forward = products + attention
    return {"phase": "update", "turn": None,
            # the products read the weights while they compute; accumulating the gradients (3 passes per
            # micro-batch) and the optimiser's step (7 per step) are passes of their own
            **work(products=(3 * products + remat_products, 0), attention=(3 * attention + remat_attention, 0),
                   weight_passes=(0, micro * 3 * weights + steps * 7 * weights)),
            "flops_parts": {"forward": forward, "backward": 2 * forward, "remat": remat_products + remat_attention},
            "layout": {"prefix": layout.prefix, "width": layout.width, "prompts": layout.prompts,
                       "rows": M, "logit_positions": policy_tokens_per_row(plan)},
            "xla": xla_counts(learn), "runs_s": seconds}


def account(path: str, overrides: list[str], config, steps: int, before: dict, measure, bar, repeats: int = 5) -> dict:
    """One iteration of a config (``path`` plus ``overrides``, checked: ``config``) as
    ``experiments.run`` runs it, phase by phase (the docstring); the decode's products timed at its
    rows ``repeats`` times. Read against the ceilings measured ``before`` it (``{"matmul": ...,
    "copy": ..., "read": ...}``, the read reported, not read against) and again after it
    (``measure()``), the faster of the two: a shared host's speed drifts over the minutes an account
    takes, and a slow minute at the start would pass a phase for faster than the machine."""
    exp = built_or_exit(config)
    plan, settings = exp.train_plan, exp.settings
    iteration = jit_iteration(make_train_step(*iteration_program(exp)), settings, plan)
    # The run's own first batches: its seed's train state and its rollout key, into which ``collect``
    # folds the step (``experiments.run``). How long a rollout takes depends on when its answers end,
    # which the weights and the key decide.
    state = init_train_state(settings, exp.model, exp.seed_key())
    key = exp.seed_key()
    jitted_learn: Any = iteration.learn
    collect = jax.jit(iteration.collect).lower(state, exp.train_tables, key).compile()
    learns: dict = {}
    times: dict[str, list[float]] = {"rollout": [], "update": []}
    as_run = []  # each timed iteration's rollout phases, by the shapes alone
    for i in range(steps + 1):  # the first iteration warms up
        t0 = time.perf_counter()
        traj = jax.block_until_ready(collect(state, exp.train_tables, key))
        rollout_s = time.perf_counter() - t0
        if not i:
            # The phases on the run's first batch, compiled and timed before the update is: compiling
            # them beside the iterations' programs and buffers ran a FrozenLake account out of 24 GB.
            phases = rollout_phases(exp, state, traj, repeats)
        layout = iteration.layout(traj)
        if layout not in learns:  # the run compiles the update once per layout too
            learns[layout] = jitted_learn.lower(state, traj, exp.hyper, layout).compile()
        kept = traj  # learn donates the state, not the trajectories
        t0 = time.perf_counter()
        state, _ = jax.block_until_ready(learns[layout](state, traj, exp.hyper))
        if i:
            times["rollout"].append(rollout_s)
            times["update"].append(time.perf_counter() - t0)
            as_run.append(rollout_phases(exp, state, kept, steps, timed=False))
        bar.update()
    phases.append(update_phase(exp, learns[layout], kept, layout, times["update"]))
    config = exp.model.merge().config
    decode_products = {n: products_at_rows(config, n, repeats)
                       for n in sampling.live_batch_sizes(plan.batch_size, sampling.MIN_LIVE_ROWS)}
    rates = {n: r["gflop_per_s"] for n, r in decode_products.items()}
    after = measure()
    peak_flops = max(before["matmul"]["gflop_per_s"], after["matmul"]["gflop_per_s"]) * 1e9
    bandwidth = max(before["copy"]["gb_per_s"], after["copy"]["gb_per_s"]) * 1e9
    bar.update()
    for p in phases:
        seconds = statistics.median(p["runs_s"])
        least, in_sequence = least_seconds(p, peak_flops, bandwidth)
        xla = max(p["xla"]["flops"] / peak_flops, p["xla"]["bytes"] / bandwidth)
        p |= {"seconds": seconds, "bound": "FLOPs" if p["flops"] / peak_flops >= p["least_bytes"] / bandwidth else "bytes",
              "least_s": least, "least_in_sequence_s": in_sequence, "of_ceiling": least / seconds,
              "of_ceiling_in_sequence": in_sequence / seconds, "xla_of_ceiling": xla / seconds}
        reachable = reachable_seconds(p, peak_flops, bandwidth, rates)
        p |= {"reachable_s": reachable, "of_reachable": reachable / seconds}
    rollout = [p for p in phases if p["phase"] != "update"]
    measured = sum(p["seconds"] for p in rollout)
    # The rollout as it runs (``collect``: one program, env steps and all), each iteration's least
    # time over its own time; the phases timed apart each pay for a program of their own.
    run = [{"rollout_s": seconds, "in_sequence_s": sum(in_sequence_seconds(p, peak_flops, bandwidth) for p in ph),
            "reachable_s": sum(reachable_seconds(p, peak_flops, bandwidth, rates) for p in ph)}
           for seconds, ph in zip(times["rollout"], as_run)]
    return {
        "config": path, "overrides": overrides, "seed": exp.config.trainer.seed, "model": f"{config.num_layers} layers x {config.hidden_size}, {config.dtype}",
        "rows": plan.batch_size, "max_turn": plan.max_turn, "response_length": plan.response_length,
        "max_len": plan.max_len, "remat": config.remat, "steps": steps,
        "iteration_s": {k: statistics.median(v) for k, v in times.items()}, "runs_s": times,
        "rollout_rest_s": statistics.median(times["rollout"]) - measured, "rollout_phases_s": measured,
        "rollout_of_ceiling": sum(p["least_s"] for p in rollout) / measured,
        "rollout_of_ceiling_in_sequence": sum(p["least_in_sequence_s"] for p in rollout) / measured,
        "ceilings_after": after, "peak_gflop_per_s": peak_flops / 1e9, "bandwidth_gb_per_s": bandwidth / 1e9,
        "rollout_of_reachable": sum(p["reachable_s"] for p in rollout) / measured,
        "rollout_as_run": {"iterations": run,
                           "of_ceiling_in_sequence": statistics.median(r["in_sequence_s"] / r["rollout_s"] for r in run),
                           "of_reachable": statistics.median(r["reachable_s"] / r["rollout_s"] for r in run)},
        "decode_products": list(decode_products.values()),
        "generated_tokens": int(np.asarray(kept.response_tokens).sum()), "phases": phases,
    }  # fmt: skip


def markdown(report: dict) -> str:
    m, mm, cp, rd = report["machine"], report["matmul"], report["copy"], report["read"]
    head = (f"bench_ceilings, {m['device_kind']} ({m['jax_platform']}, {m['cpu_count']} cores, jax {m['jax']}), "
            f"load average {m['load_average'][0]:.1f} at the start")
    rows = [
        [f"float32 product {mm['size']} x {mm['size']}", f"{mm['gflop_per_s']:.1f} GFLOP/s",
         f"{mm['median_gflop_per_s']:.1f}", f"{min(mm['runs_s']):.4f}-{max(mm['runs_s']):.4f}", f"{mm['cpu_per_wall']:.2f}"],
        [f"in-place pass over {cp['bytes'] / 2**20:.0f} MiB", f"{cp['gb_per_s']:.1f} GB/s",
         f"{cp['median_gb_per_s']:.1f}", f"{min(cp['runs_s']):.4f}-{max(cp['runs_s']):.4f}", f"{cp['cpu_per_wall']:.2f}"],
        [f"read alone, {rd['bytes'] / 2**20:.0f} MiB (not a ceiling)", f"{rd['gb_per_s']:.1f} GB/s",
         f"{rd['median_gb_per_s']:.1f}", f"{min(rd['runs_s']):.4f}-{max(rd['runs_s']):.4f}", f"{rd['cpu_per_wall']:.2f}"],
    ]  # fmt: skip
    parts = [head, markdown_table(["ceiling", "fastest run", "median", "runs (s)", "cores busy"], rows)]
    for a in report.get("accounts", []):
        it = a["iteration_s"]
        after = a["ceilings_after"]
        parts.append(f"{a['config']}: {a['rows']} rows x {a['max_turn']} turns, answers <= {a['response_length']}, "
                     f"context {a['max_len']}, {a['model']}, remat {a['remat']}; read against "
                     f"{a['peak_gflop_per_s']:.1f} GFLOP/s and {a['bandwidth_gb_per_s']:.1f} GB/s, the faster of the "
                     f"ceilings before it and after it ({after['matmul']['gflop_per_s']:.1f} GFLOP/s, "
                     f"{after['copy']['gb_per_s']:.1f} GB/s; reads alone {after['read']['gb_per_s']:.1f} GB/s); "
                     f"iteration {it['rollout']:.1f} s "
                     f"rollout + {it['update']:.1f} s update (median of {a['steps']}), rollout besides its phases "
                     f"{a['rollout_rest_s']:.1f} s, {a['generated_tokens']} tokens generated; the rollout's phases "
                     f"{a['rollout_phases_s']:.1f} s, {100 * a['rollout_of_ceiling']:.0f}% of ceiling, "
                     f"{100 * a['rollout_of_ceiling_in_sequence']:.0f}% in sequence, "
                     f"{100 * a['rollout_of_reachable']:.0f}% of what the decode's rows reach; the decode's products "
                     f"at " + ", ".join(f"{r['rows']} rows {r['gflop_per_s']:.1f} ({r['products']})"
                                        for r in a["decode_products"])
                     + f" GFLOP/s. The rollout as run (`collect`, each iteration's least time over its time, median): "
                     f"{100 * a['rollout_as_run']['of_ceiling_in_sequence']:.0f}% in sequence, "
                     f"{100 * a['rollout_as_run']['of_reachable']:.0f}% at the decode's rows")
        rows = [[p["phase"], p["turn"] or "", f"{p['flops'] / 1e9:.1f}", f"{p['xla']['flops'] / 1e9:.1f}",
                 f"{p['xla']['cost_analysis_flops'] / 1e9:.1f}", f"{p['least_bytes'] / 1e9:.2f}",
                 f"{p['xla']['bytes'] / 1e9:.2f}", f"{p['seconds']:.2f}", p["bound"], f"{100 * p['of_ceiling']:.0f}%",
                 f"{100 * p['of_ceiling_in_sequence']:.0f}%", f"{100 * p['of_reachable']:.0f}%",
                 f"{100 * p['xla_of_ceiling']:.0f}%"] for p in a["phases"]]  # fmt: skip
        parts.append(markdown_table(["phase", "turn", "GFLOP (shapes)", "GFLOP (XLA)", "GFLOP (cost_analysis)", "GB least",
                                     "GB (XLA)", "s", "bound", "of ceiling", "in sequence", "at its rows", "XLA work"], rows))
    return "\n\n".join(parts)


def main(argv=None) -> dict:
    args = parse_args(argv)
    checked = [checked_or_exit(path, args.overrides) for path in args.config]  # before the ceilings' minutes of work
    report: dict[str, Any] = {"machine": machine(args.note), "matmul": matmul_ceiling(args.size, args.repeats),
                              **memory_ceilings(args.copy_mib, args.repeats)}
    report["machine_balance_flop_per_byte"] = report["matmul"]["gflop_per_s"] / report["copy"]["gb_per_s"]
    if args.config:
        def measure() -> dict:
            return {"matmul": matmul_ceiling(args.size, args.repeats), **memory_ceilings(args.copy_mib, args.repeats)}

        with tqdm(total=len(args.config) * (args.steps + 2), desc="iterations", unit="it") as bar:
            report["accounts"] = [account(path, args.overrides, config, args.steps, report, measure, bar, args.repeats)
                                  for path, config in zip(args.config, checked)]
        report["load_average_after"] = list(os.getloadavg())
    text = markdown(report)
    print(text, flush=True)
    write_report(report, args.out)
    write_markdown(text, args.out)
    return report


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
