"""Environment throughput: the pure-JAX envs under ``jit`` + ``vmap`` against plain NumPy.

For every env, batch size and mode, a compiled loop steps the whole batch with uniformly random
actions (``random_actions``: a hash, as cheap as the envs' own draws; for Countdown, whose action is
the answer text, random expressions of the task's numbers, a quarter with a stray byte:
``random_expressions``), and we report environment
steps per second (median of ``--repeats`` timed runs of about ``--seconds`` each; compile time
reported apart). Two modes:

- ``step``: dynamics only. A row that finishes restarts from its own first state (same level), so
  every step is a live one and no level is generated.
- ``reset``: auto-reset, so procedural level generation is inside the timed loop. Each step
  generates a fixed number of fresh levels, ``reset capacity = ceil(reset_share × batch)`` (split
  evenly over the devices), and hands them to the rows that finished (rows already waiting first);
  finished rows beyond the capacity wait (they are stepped but not counted). Generating a level
  for *every* row at every step, as a select-based auto-reset does, would cost a level per
  row-step; the capacity is set from how often episodes end under random actions
  (``RESET_SHARE``), and ``--reset-share 1`` gives the select-everything behaviour.
  ``active_share`` in the JSON is the fraction of row-steps counted.

The timed loop consumes every step's reward, step type and info flags and carries the state on;
like the NumPy baseline, it does not render observations, which the envs compute from the state
(``render_symbols``) and XLA drops when nothing reads them. ``--observe`` adds them (the symbol
grid of every row at every step) for the cost of a step as the rollout sees it.

The batch is split evenly over the local devices, each running the loop on its own rows. On CPU,
JAX makes one host device by default, and XLA splits the larger loops of a step over its threads;
``JAX_NUM_CPU_DEVICES=N`` makes N host devices, each stepping its own rows, which keeps N cores
busy. The JSON records per measurement the ``devices`` used and ``cpu_per_wall``, the cores busy
on average (process CPU time over wall time). The NumPy baseline runs on one core.

The runs continue one another (warm-up, then the timed repeats), so ``reset`` mode measures the
steady state where episodes are at all stages.

The baseline is a straightforward single-environment NumPy implementation of the same rules, stepped
one action at a time from Python (``NUMPY_BASELINES``; Sokoban's is ``sokoban_reference``, whose
level generator is RAGEN's exhaustive reverse-play search, while the JAX generator runs a fixed
number of random reverse walks). Countdown's is plain Python, as RAGEN scores answers: tasks drawn
as ``Countdown.reset`` draws them, answers like ``random_expressions``', scored by RAGEN's
``eval``-based scorer (``countdown_score.ragen_score``). ``speedup`` is JAX steps/s over NumPy
steps/s for the same env and mode.

    python -m experiments.bench.envs                       # full grid, writes bench_results/bench_envs.json
    python -m experiments.bench.envs --quick               # smoke run
    python -m experiments.bench.envs --envs FrozenLake --batch-sizes 256,4096 --modes reset
    JAX_NUM_CPU_DEVICES=2 python -m experiments.bench.envs  # both cores of a 2-core machine
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

import envs_jax
from envs_jax import sokoban_reference
from envs_jax.countdown import MAX_NUMS, Countdown
from envs_jax.countdown_score import ragen_score
from envs_jax.frozen_lake import DIRECTION_DELTAS, draw_random_map
from envs_jax.hashing import hash_words
from experiments.bench.common import machine, require_positive, write_report
from starpo_jax.runtime import allocator

DEFAULT_ENVS = ("Bandit", "FrozenLake", "SimpleSokoban", "Countdown")
DEFAULT_BATCH_SIZES = (1, 16, 256, 4096, 65536)
MODES = ("step", "reset")

#: Fresh levels generated per step, as a share of the batch: the rate at which episodes end
#: under random actions, with about 3x slack (Bandit and Countdown: every step; FrozenLake: mean
#: episode ≈ 10 steps; Sokoban: most episodes run to the 100-step limit).
RESET_SHARE = {"Bandit": 1.0, "FrozenLake": 1 / 4, "SimpleSokoban": 1 / 32, "LargerSokoban": 1 / 32, "Countdown": 1.0}

#: Countdown's random answers: the share with one byte replaced by a random printable character.
CORRUPT_SHARE = 1 / 4
OPERATORS = "+-*/"


# --------------------------------------------------------------------------- NumPy baselines


class Baseline:
    """One env stepped from Python; its random action is a uniform action id."""

    def __init__(self, env):
        self.env = env

    def random_action(self, rng):
        return int(rng.integers(self.env.action_spec.num_values))


class NumpyBandit(Baseline):
    """One bandit: the arm order is a coin flip, the risky arm pays ``hiscore`` with probability."""

    def reset(self, rng):
        self.hi_first = rng.random() >= 0.5

    def restart(self):
        pass

    def step(self, action, rng) -> tuple[float, bool]:
        env = self.env
        if (action == 0) == self.hi_first:
            reward = env.hi_arm_hiscore if rng.random() < env.hi_arm_hiscore_prob else env.hi_arm_loscore
        else:
            reward = env.lo_arm_score
        return reward, True


class NumpyFrozenLake(Baseline):
    """One FrozenLake: RAGEN's map generator, gymnasium's slips and moves."""

    def reset(self, rng):
        self.desc = np.array([list(row) for row in draw_random_map(rng, self.env.size, self.env.p)])
        self.restart()

    def restart(self):
        self.pos = np.argwhere(self.desc == "S")[0]
        self.steps = 0

    def step(self, action, rng) -> tuple[float, bool]:
        self.steps += 1
        if self.desc[tuple(self.pos)] in "GH":  # absorbing
            return 0.0, True
        direction = (action + rng.integers(-1, 2)) % 4 if self.env.is_slippery else action
        self.pos = np.clip(self.pos + DIRECTION_DELTAS[direction], 0, self.env.size - 1)
        cell = self.desc[tuple(self.pos)]
        return float(cell == "G"), cell in "GH" or self.steps >= self.env.max_steps


class NumpySokoban(Baseline):
    """One Sokoban: RAGEN's level generator and gym_sokoban's step (``sokoban_reference``)."""

    def reset(self, rng):
        env = self.env
        seed = int(rng.integers(2**31))
        self.room_fixed, self.first_room_state = sokoban_reference.ragen_level(
            seed, env.dim_room, env.num_boxes, env.search_depth
        )
        self.restart()

    def restart(self):
        self.room_state = self.first_room_state.copy()
        self.steps = 0

    def step(self, action, rng) -> tuple[float, bool]:
        _, reward, solved = sokoban_reference.numpy_step(self.room_state, self.room_fixed, action)
        self.steps += 1
        return reward, solved or self.steps >= self.env.max_steps


class PythonCountdown(Baseline):
    """One Countdown task: drawn as ``Countdown.reset`` draws them, answered as ``random_expressions``
    answers, scored by RAGEN's plain-Python scorer (``countdown_score.ragen_score``, ``eval``)."""

    def reset(self, rng):
        while True:
            count = 4 if rng.random() < 0.5 else 3
            nums = rng.integers(1, self.env.max_value + 1, count)
            target = int(np.sum(rng.choice((-1, 1), count) * nums))
            if 1 <= target <= self.env.max_value:
                self.nums, self.target = nums.tolist(), target
                return

    def restart(self):
        pass

    def random_action(self, rng) -> str:
        order = rng.permutation(self.nums)
        ops = rng.choice(list(OPERATORS), len(order) - 1)
        text = str(order[0]) + "".join(f" {op} {n}" for op, n in zip(ops, order[1:]))
        if rng.random() < CORRUPT_SHARE:
            at = int(rng.integers(len(text)))
            text = text[:at] + chr(int(rng.integers(32, 127))) + text[at + 1 :]
        return text

    def step(self, answer: str, rng) -> tuple[float, bool]:
        return ragen_score(answer, self.nums, self.target), True


NUMPY_BASELINES = {
    "Bandit": NumpyBandit,
    "FrozenLake": NumpyFrozenLake,
    "SimpleSokoban": NumpySokoban,
    "LargerSokoban": NumpySokoban,
    "Countdown": PythonCountdown,
}


def numpy_rate(baseline, auto_reset: bool, seconds: float, seed: int) -> float:
    """Steps/s of one NumPy env stepped from Python with random actions for about ``seconds``.

    A finished episode starts on a fresh level (``auto_reset``) or restarts the same one.
    """
    rng = np.random.default_rng(seed)
    baseline.reset(rng)
    steps, start = 0, time.perf_counter()
    while True:
        for _ in range(64):
            _, done = baseline.step(baseline.random_action(rng), rng)
            if done and auto_reset:
                baseline.reset(rng)
            elif done:
                baseline.restart()
        steps += 64
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return steps / elapsed


# --------------------------------------------------------------------------- JAX loop


def select_rows(mask, on_true, on_false):
    """Per row of a batched pytree: ``on_true`` where ``mask`` else ``on_false``."""

    def pick(a, b):
        return jnp.where(mask.reshape(mask.shape + (1,) * (a.ndim - 1)), a, b)

    return jax.tree.map(pick, on_true, on_false)


def random_actions(key, step_index, batch: int, num_actions: int):
    """int32[batch] uniform actions for one step: a hash of (key, step, row), no PRNG key splits.

    ``jax.random`` here would cost more than the cheaper env steps themselves.
    """
    step_word = hash_words(hash_words(key[0], key[1]), step_index)
    bits = hash_words(jnp.arange(batch, dtype=jnp.uint32), step_word)
    # floor(num_actions * u) for u = the top 24 bits / 2**24, in integers (exact for < 256 actions)
    return (((bits >> 8) * jnp.uint32(num_actions)) >> 24).astype(jnp.int32)


def random_expressions(key, step_index, states, width: int):
    """A step's random Countdown answers, ``(uint8[batch, width], int32[batch])``, one per task.

    Each row joins its own numbers, in a random order, with random ``+ - * /`` (``"7 * 3 - 5 + 2"``),
    so RAGEN's number check passes and the expression is evaluated, as for a model that has learnt
    the format; ``CORRUPT_SHARE`` of the rows then have one byte replaced by a random printable
    character, which may break a number or the syntax. A hash of (key, step, row), as in
    ``random_actions``.
    """
    step_word = hash_words(hash_words(key[0], key[1]), step_index)
    rows = hash_words(jnp.arange(states.nums.shape[0], dtype=jnp.uint32), step_word)
    return jax.vmap(lambda nums, count, word: _expression(nums, count, word, width))(
        states.nums, states.num_count, rows
    )


def _expression(nums, count, word, width: int):
    """One row of ``random_expressions``: seven pieces of up to 3 bytes (number, " op ", number, ...)
    written one after the other."""
    draws = hash_words(word, jnp.arange(2 * MAX_NUMS, dtype=jnp.uint32))  # order keys, operators, corruption
    slot = jnp.arange(MAX_NUMS)
    ordered = nums[jnp.argsort(jnp.where(slot < count, draws[:MAX_NUMS], jnp.uint32(2**32 - 1)))]
    digits = jnp.stack([ordered // 100, ordered // 10 % 10, ordered % 10], axis=1)
    num_len = jnp.where(slot < count, 1 + (ordered >= 10) + (ordered >= 100), 0)
    # left-aligned digits: byte c of a k-digit number is digit 3 - k + c
    digit_bytes = jnp.take_along_axis(digits, jnp.clip(3 - num_len[:, None] + jnp.arange(3), 0, 2), axis=1) + ord("0")
    ops = jnp.asarray(np.frombuffer(OPERATORS.encode(), np.uint8))[draws[MAX_NUMS : 2 * MAX_NUMS - 1] >> 30]
    op_bytes = jnp.stack([jnp.full_like(ops, ord(" ")), ops, jnp.full_like(ops, ord(" "))], axis=1)
    op_len = jnp.where(slot[:-1] < count - 1, 3, 0)
    pieces = jnp.concatenate([digit_bytes, op_bytes.astype(digit_bytes.dtype)])[jnp.array([0, 4, 1, 5, 2, 6, 3])]
    lengths = jnp.concatenate([num_len, op_len])[jnp.array([0, 4, 1, 5, 2, 6, 3])]
    at = (jnp.cumsum(lengths) - lengths)[:, None] + jnp.arange(3)
    at = jnp.where(jnp.arange(3) < lengths[:, None], at, width)  # past the end: dropped
    data = jnp.zeros((width,), jnp.uint8).at[at.ravel()].set(pieces.ravel().astype(jnp.uint8), mode="drop")
    length = jnp.minimum(jnp.sum(lengths), width)
    corrupt = draws[-1] < jnp.uint32(CORRUPT_SHARE * 2**32)
    garbage = (32 + (draws[-1] >> 8) % 95).astype(jnp.uint8)
    data = jnp.where(corrupt, data.at[(draws[-1] & 0xFF).astype(jnp.int32) % length].set(garbage), data)
    return data, length.astype(jnp.int32)


def action_sampler(env, rows: int):
    """``draw(key, step_index, states)``: a step's random actions for ``rows`` rows: uniform action
    ids, or for Countdown's language action, answers (``random_expressions``)."""
    if isinstance(env, Countdown):
        return lambda key, i, states: random_expressions(key, i, states, env.answer_width)
    num_actions = env.action_spec.num_values
    return lambda key, i, states: random_actions(key, i, rows, num_actions)


def checksum(timestep, batch: int, observe: bool):
    """float32[batch]: each row's reward plus its info flags, and its observation's cells if
    ``observe``. Accumulated over the steps and summed once at the end, it keeps that part of the
    step live (the state is carried to the next step, so its update always is). Per row, in int32
    first: on XLA:CPU a good deal cheaper than reducing over the whole batch at every step."""
    counts = jax.tree.leaves((timestep.observation, timestep.extras) if observe else timestep.extras)
    per_row = sum((jnp.sum(x.reshape(batch, -1), axis=1, dtype=jnp.int32) for x in counts),
                  jnp.zeros((batch,), jnp.int32))
    return timestep.reward + per_row.astype(jnp.float32)


def row_mesh(batch: int) -> jax.sharding.Mesh:
    """A 1-D mesh (axis ``rows``) over as many local devices as evenly split ``batch``."""
    devices = jax.devices()
    count = max(n for n in range(1, len(devices) + 1) if batch % n == 0)
    return jax.sharding.Mesh(np.array(devices[:count]), ("rows",))


def make_loop(env, batch: int, reset_capacity: int | None, observe: bool = False, mesh=None):
    """``loop(first, states, waiting, key, num_steps) -> (states, waiting, counted_steps, checksum)``:
    ``num_steps`` (a runtime value) random steps of the batch, one compiled ``fori_loop``.

    ``reset_capacity=None``: finished rows restart from ``first``. Otherwise each step generates
    ``reset_capacity`` fresh levels per device; finished rows take them, those already waiting
    first, and the others wait (``waiting``) and are not counted. ``checksum`` (see ``checksum``)
    keeps the step's outputs live, its observations too if ``observe``.

    The rows are split over the devices of ``mesh`` (default ``row_mesh(batch)``; on CPU, see
    ``JAX_NUM_CPU_DEVICES`` in the module docstring): each device runs the loop on its own rows
    (``shard_map``), with no communication until the final sums.
    """
    mesh = row_mesh(batch) if mesh is None else mesh
    rows = batch // mesh.size
    draw_actions = action_sampler(env, rows)
    step = jax.vmap(env.step)
    reset = jax.vmap(env.reset)

    def advance(first, states, waiting, key, i):
        actions = draw_actions(key, i, states)
        states, timestep = step(states, actions)
        row_sums = checksum(timestep, rows, observe)
        if reset_capacity is None:
            return select_rows(timestep.last(), first, states), waiting, row_sums
        # Rows already waiting are served first, then the newly finished, each in row order.
        newly = timestep.last() & ~waiting
        rank = jnp.where(waiting, jnp.cumsum(waiting), jnp.sum(waiting) + jnp.cumsum(newly)) - 1
        finished = waiting | newly
        takes = finished & (rank < reset_capacity)
        fresh, _ = reset(jax.random.split(jax.random.fold_in(key, i), reset_capacity))
        fresh_rows = jax.tree.map(lambda x: x[jnp.clip(rank, 0, reset_capacity - 1)], fresh)
        return select_rows(takes, fresh_rows, states), finished & ~takes, row_sums

    def device_loop(first, states, waiting, key, num_steps):
        key = jax.random.fold_in(key, jax.lax.axis_index("rows"))  # each device its own draws

        def body(i, carry):
            states, waiting, counted, total = carry
            counted += ~waiting
            states, waiting, row_sums = advance(first, states, waiting, key, i)
            return states, waiting, counted, total + row_sums

        init = (states, waiting, jnp.zeros((rows,), jnp.int32), jnp.zeros((rows,), jnp.float32))
        states, waiting, counted, total = jax.lax.fori_loop(0, num_steps, body, init)
        return states, waiting, jnp.sum(counted)[None], jnp.sum(total)[None]

    split, whole = jax.sharding.PartitionSpec("rows"), jax.sharding.PartitionSpec()
    sharded_loop = jax.shard_map(
        device_loop, mesh=mesh, in_specs=(split, split, split, whole, whole),
        out_specs=(split, split, split, split), check_vma=False,
    )

    def loop(first, states, waiting, key, num_steps):
        states, waiting, counted, total = sharded_loop(first, states, waiting, key, num_steps)
        return states, waiting, jnp.sum(counted), jnp.sum(total)

    return jax.jit(loop)


def first_states(batched_reset, key, batch: int, chunk: int = 4096):
    """``batch`` reset states, generated ``chunk`` at a time to bound the generators' memory.

    Waits for them: JAX dispatches asynchronously, and generating Sokoban levels takes about a
    millisecond each on CPU, which must not land in the first (calibration) run of the loop.
    """
    keys = jax.random.split(key, batch)
    parts = [batched_reset(keys[i : i + chunk])[0] for i in range(0, batch, chunk)]
    return jax.block_until_ready(jax.tree.map(lambda *xs: jnp.concatenate(xs), *parts))


def jax_measurement(env, first, batch, mode, repeats, reset_share, seconds, max_steps, seed,
                    observe=False) -> dict:
    """Compile time and median steps/s of the compiled loop, run from the ``batch`` states ``first``.

    Warm-up runs of growing length calibrate the number of steps per timed run to about ``seconds``
    (between 2 and ``max_steps``); all runs continue one another.
    """
    key = jax.random.PRNGKey(seed)
    mesh = row_mesh(batch)
    by_row = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("rows"))
    first = jax.device_put(first, by_row)
    states, waiting = first, jax.device_put(jnp.zeros((batch,), bool), by_row)
    capacity = None if mode == "step" else max(1, math.ceil(reset_share * batch / mesh.size))

    start = time.perf_counter()
    loop = make_loop(env, batch, capacity, observe, mesh)
    loop = loop.lower(first, states, waiting, key, 2).compile()
    compile_s = time.perf_counter() - start

    run_keys = (jax.random.fold_in(key, r) for r in itertools.count())

    def run(states, waiting, num_steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        states, waiting, n, _ = jax.block_until_ready(
            loop(first, states, waiting, next(run_keys), num_steps)
        )
        elapsed = time.perf_counter() - start
        return states, waiting, int(n), elapsed, (time.process_time() - cpu_start) / elapsed

    # Warm up and calibrate: grow the run until it takes a quarter of the target time.
    num_steps = 2
    while True:
        states, waiting, _, elapsed, _ = run(states, waiting, num_steps)
        if elapsed >= seconds / 4 or num_steps >= max_steps:
            break
        num_steps = min(max_steps, num_steps * 8)
    num_steps = int(min(max_steps, max(2, round(num_steps * seconds / elapsed))))
    times, counted, cores = [], [], []
    for _ in range(repeats):
        states, waiting, n, elapsed, busy = run(states, waiting, num_steps)
        times.append(elapsed)
        counted.append(n)
        cores.append(busy)
    return {
        "steps_per_s": statistics.median(n / t for n, t in zip(counted, times)),
        "compile_s": compile_s,
        "run_s": statistics.median(times),
        # Process CPU time over wall time: the cores busy on average (XLA:CPU also splits large
        # loops over its own threads, so this can exceed the device count).
        "cpu_per_wall": statistics.median(cores),
        "num_steps": num_steps,
        "reset_capacity": capacity,
        "devices": mesh.size,
        "active_share": sum(counted) / (repeats * batch * num_steps),
    }


# --------------------------------------------------------------------------- driver


QUICK = {"batch_sizes": "1,16", "seconds": 0.05, "repeats": 2, "numpy_seconds": 0.05}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m experiments.bench.envs",
        description="Steps/s of the JAX envs under jit+vmap versus a single-env NumPy baseline.",
        epilog="The batch is split over the local devices; on CPU, JAX_NUM_CPU_DEVICES=N in the "
               "environment makes N host devices (N cores stepping rows side by side).",
    )
    parser.add_argument("--envs", default=",".join(DEFAULT_ENVS),
                        help=f"comma-separated env names from: {', '.join(NUMPY_BASELINES)}")
    parser.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                        help="comma-separated batch sizes")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated: step, reset")
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="target duration of one timed run (sets its number of steps)")
    parser.add_argument("--max-steps", type=int, default=10_000, help="most steps in one timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs; the median is reported")
    parser.add_argument("--numpy-seconds", type=float, default=1.0,
                        help="duration of each NumPy baseline run (3 runs, median)")
    parser.add_argument("--reset-share", type=float, default=None,
                        help="fresh levels per step as a share of the batch (default: per env)")
    parser.add_argument("--observe", action="store_true",
                        help="also render every step's observation (symbol grid) in the timed loop")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench_results/bench_envs.json", help="JSON output path")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: batch sizes 1,16, 2 repeats of 0.05 s, 0.05 s baselines")
    args = parser.parse_args(argv)
    if args.quick:  # smaller defaults; explicit flags still win
        for name, value in QUICK.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    args.envs = [e for e in args.envs.split(",") if e]
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    args.modes = [m for m in args.modes.split(",") if m]
    unknown = [e for e in args.envs if e not in NUMPY_BASELINES]
    if unknown:
        parser.error(f"unknown env(s) {', '.join(unknown)}; choose from {', '.join(NUMPY_BASELINES)}")
    bad_modes = [m for m in args.modes if m not in MODES]
    if bad_modes:
        parser.error(f"unknown mode(s) {', '.join(bad_modes)}; choose from {', '.join(MODES)}")
    if not args.batch_sizes or min(args.batch_sizes) < 1 or args.max_steps < 2 or args.repeats < 1:
        parser.error("batch sizes and --repeats must be positive, --max-steps at least 2")
    require_positive(parser, args, "seconds", "numpy_seconds")

    return args


def run(args) -> dict:
    envs = {name: envs_jax.make(name) for name in args.envs}
    numpy_rates: dict[str, dict[str, float]] = {name: {} for name in args.envs}  # env -> mode -> steps/s
    results = []
    total = len(args.envs) * len(args.modes) * (1 + len(args.batch_sizes))
    with tqdm(total=total, desc="bench_envs") as bar:
        for name, env in envs.items():
            for mode in args.modes:
                bar.set_postfix_str(f"numpy {name} {mode}")
                baseline = NUMPY_BASELINES[name](env)
                rates = [numpy_rate(baseline, mode == "reset", args.numpy_seconds, args.seed + r) for r in range(3)]
                numpy_rates[name][mode] = statistics.median(rates)
                bar.update()
        for name, env in envs.items():
            share = args.reset_share if args.reset_share is not None else RESET_SHARE[name]
            batched_reset = jax.jit(jax.vmap(env.reset))
            for batch in args.batch_sizes:
                first = first_states(batched_reset, jax.random.PRNGKey(args.seed), batch)
                for mode in args.modes:
                    bar.set_postfix_str(f"jax {name} batch={batch} {mode}")
                    row = jax_measurement(env, first, batch, mode, args.repeats, share,
                                          args.seconds, args.max_steps, args.seed, args.observe)
                    row = {"env": name, "batch": batch, "mode": mode, **row}
                    row["speedup_vs_numpy"] = row["steps_per_s"] / numpy_rates[name][mode]
                    results.append(row)
                    bar.update()
    return {
        "meta": {**machine(), "date": time.strftime("%Y-%m-%d %H:%M:%S"), "args": dict(vars(args))},
        "numpy": numpy_rates,
        "results": results,
    }


def format_table(report: dict) -> str:
    header = (f"{'env':<14} {'batch':>6} {'mode':<6} {'steps/s':>14} {'vs NumPy':>10} "
              f"{'compile s':>9} {'devices':>7} {'cpu/wall':>8}")
    lines = [header, "-" * len(header)]
    for name, modes in report["numpy"].items():
        for mode, rate in modes.items():
            lines.append(f"{name:<14} {'numpy':>6} {mode:<6} {rate:>14,.0f} {'1.0x':>10} {'':>9}")
    for r in report["results"]:
        lines.append(
            f"{r['env']:<14} {r['batch']:>6} {r['mode']:<6} {r['steps_per_s']:>14,.0f} "
            f"{r['speedup_vs_numpy']:>9,.1f}x {r['compile_s']:>9.2f} {r['devices']:>7} "
            f"{r['cpu_per_wall']:>8.2f}"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run(args)
    print(format_table(report))
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    allocator.restart_with_tcmalloc()  # first, before XLA starts: the process is replaced
    main()
