"""Countdown (RAGEN ``countdown``, ragen-reference.md §1.4): use each of 3-4 numbers once in an arithmetic
expression that equals the target.

The answer is the expression itself (a language action: RAGEN passes the raw action string), so
``step(state, answer)`` takes the answer's bytes, ``(uint8[answer_width], length)``, and scores
them in the graph with RAGEN's rule (``envs_jax.countdown_score``): 0 if the answer's numbers are
not the task's, 1.0 if it evaluates to the target, else 0.1. One answer ends the episode.

Tasks:

- ``tasks=""`` (default): drawn in JAX by ``reset(key)``: 3 or 4 numbers from 1 to 99, and a
  target that some choice of signs reaches (``+-n1 +-n2 ...``), from 1 to 99. RAGEN keeps only
  data set rows solvable that way (its ``has_solution`` filter, a quirk), so these are tasks of
  the same kind.
- ``tasks="path.jsonl"`` (or ``.json``, ``.parquet``): rows with ``target`` and ``nums`` as in the
  Countdown-Tasks-3to4 data set; the first ``max_instances`` rows, filtered by ``has_solution``
  as RAGEN does. ``reset(key)`` draws a row, ``reset_from_seed(seed)`` is RAGEN's row
  ``seed % len(tasks)``. ``tasks="hub:Jiayi-Pan/Countdown-Tasks-3to4"`` downloads the data set
  (network, and pyarrow for parquet); offline it fails with a message saying to pass a local file.

Observation: ``"Target: {target}, nums: [3, 5, 2]"`` (RAGEN's, the list as Python prints it); after
the answer, ``"Your answer get {reward} points."``.
"""

from __future__ import annotations

import itertools
import json
from functools import cached_property
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jumanji import specs

from envs_jax.base import TextEnv, first_timestep, make_timestep, step_extras
from envs_jax.countdown_score import FORMAT_SCORE, SCORE, score_answer

INSTRUCTION = (
    "You are solving the Countdown puzzle. You should use the num list to create an equation that "
    "equals the target. Example answer format: <think> To find an equation using [3, 5, 2] to get 4. "
    "Let's check 2 + 5 = 7, 7 - 3 = 4. So the answer is 2 + 5 - 3 = 4. </think><answer>2 + 5 - 3</answer>"
)
MAX_NUMS = 4
VALUE_LIMIT = 1000  # numbers and targets below this have observation pieces
STEP_REWARDS = (0, FORMAT_SCORE, SCORE)  # RAGEN pays an int 0 for wrong numbers: "Reward:\n0"
HUB_PREFIX = "hub:"


class CountdownState(struct.PyTreeNode):
    nums: jnp.ndarray  # int32[4], padded with 0
    num_count: jnp.ndarray  # int32[]: 3 or 4
    target: jnp.ndarray  # int32[]
    reward_id: jnp.ndarray  # int32[]: index into STEP_REWARDS once answered, else -1


def has_solution(nums, target) -> bool:
    """RAGEN's filter: some assignment of signs to the numbers (padded to 4 with 0) sums to target."""
    nums = list(nums) + [0] * (MAX_NUMS - len(nums))
    return any(sum(s * n for s, n in zip(signs, nums)) == target for signs in itertools.product([1, -1], repeat=MAX_NUMS))


def read_task_rows(source: str) -> list[dict]:
    """Rows with ``target`` and ``nums`` from a .jsonl / .json / .parquet file or ``hub:<dataset id>``."""
    if source.startswith(HUB_PREFIX):
        return _hub_rows(source[len(HUB_PREFIX):])
    path = Path(source)
    if not path.is_file():
        raise ValueError(f"Countdown tasks file {source!r} does not exist.")
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if path.suffix == ".json":
        rows = json.loads(path.read_text())
        return rows if isinstance(rows, list) else [dict(zip(rows, v)) for v in zip(*rows.values())]
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ValueError(
                f"Reading {source!r} needs pyarrow (pip install pyarrow), or pass the tasks as .jsonl."
            ) from err
        return pq.read_table(path).to_pylist()
    raise ValueError(f"Countdown tasks file {source!r}: use .jsonl, .json or .parquet.")


def _hub_rows(dataset: str) -> list[dict]:
    try:
        from huggingface_hub import snapshot_download

        # A snapshot fails at once when the hub cannot be reached, where listing the files first
        # retries for many seconds; the first parquet file by name is the tasks.
        folder = Path(snapshot_download(dataset, repo_type="dataset", allow_patterns="*.parquet", etag_timeout=5))
        local = str(sorted(folder.rglob("*.parquet"), key=lambda p: p.relative_to(folder).as_posix())[0])
    except Exception as err:  # offline, unknown data set, no parquet file
        raise ValueError(
            f"Could not download the Countdown data set {dataset!r} from the Hugging Face hub ({type(err).__name__}); "
            "offline, download it elsewhere and pass the local file, e.g. tasks='train.parquet' or a .jsonl."
        ) from err
    return read_task_rows(local)


def task_table(rows: list[dict], max_instances: int, source: str = "tasks"):
    """``(nums int32[N, 4], counts int32[N], targets int32[N])`` of RAGEN's rows: the first
    ``max_instances``, kept if ``has_solution``."""
    kept = []
    for i, row in enumerate(rows[:max_instances]):
        try:
            row_nums, target = [int(n) for n in row["nums"]], int(row["target"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"Countdown {source} row {i} needs integer 'target' and a 'nums' list, got {row!r}.") from err
        if not 1 <= len(row_nums) <= MAX_NUMS or not all(0 <= v < VALUE_LIMIT for v in row_nums + [target]):
            raise ValueError(
                f"Countdown {source} row {i}: {row!r} has {len(row_nums)} numbers "
                f"or a value outside 0..{VALUE_LIMIT - 1}; "
                f"this env takes up to {MAX_NUMS} numbers below {VALUE_LIMIT}."
            )
        if has_solution(row_nums, target):
            kept.append((row_nums, target))
    if not kept:
        raise ValueError(f"Countdown {source}: none of the first {max_instances} rows is solvable with + and -.")
    nums = np.array([n + [0] * (MAX_NUMS - len(n)) for n, _ in kept], np.int32)
    counts = np.array([len(n) for n, _ in kept], np.int32)
    targets = np.array([t for _, t in kept], np.int32)
    return nums, counts, targets


class Countdown(TextEnv):
    instruction = INSTRUCTION
    lists_actions = False  # RAGEN's Countdown config has no action_lookup
    default_max_actions_per_traj = 1
    step_reward_values = STEP_REWARDS
    action_names: tuple[str, ...] = ()  # a language action: the answer text itself
    success_meaning = (f"the answer uses the task's numbers and equals the target (reward {SCORE}); "
                       f"a well-formed wrong answer's {FORMAT_SCORE} is a failure")

    def __init__(self, tasks: str = "", max_instances: int = 20000, answer_width: int = 64, max_value: int = 99):
        if answer_width < 8:
            raise ValueError(f"Countdown answer_width must be at least 8 bytes, got {answer_width}.")
        if not 2 <= max_value < VALUE_LIMIT:
            raise ValueError(f"Countdown max_value must be in 2..{VALUE_LIMIT - 1}, got {max_value}.")
        self.tasks = tasks
        self.answer_width = int(answer_width)
        self.max_value = int(max_value)
        self.table = None
        if tasks:
            self.table = tuple(jnp.asarray(a) for a in task_table(read_task_rows(tasks), max_instances, tasks))
        super().__init__()

    def __repr__(self) -> str:
        return f"Countdown(tasks={self.tasks or 'procedural'!r})"

    # ---- jumanji API -------------------------------------------------------------------------

    def reset(self, key):
        """A task from the table, or drawn: numbers, signs, and a target the signs reach."""
        if self.table is not None:
            index = jax.random.randint(key, (), 0, self.table[0].shape[0])
            return self._start(*(a[index] for a in self.table))

        def draw(carry):
            key, *_ = carry
            key, count_key, nums_key, signs_key = jax.random.split(key, 4)
            count = jnp.where(jax.random.bernoulli(count_key), 4, 3)
            nums = jax.random.randint(nums_key, (MAX_NUMS,), 1, self.max_value + 1)
            nums = jnp.where(jnp.arange(MAX_NUMS) < count, nums, 0)
            signs = jnp.where(jax.random.bernoulli(signs_key, shape=(MAX_NUMS,)), 1, -1)
            return key, nums, count, jnp.sum(signs * nums)

        def bad(carry):
            target = carry[3]
            return (target < 1) | (target > self.max_value)

        _, nums, count, target = jax.lax.while_loop(bad, draw, draw((key, None, None, None)))
        return self._start(nums, count, target)

    def _start(self, nums, count, target):
        state = CountdownState(
            nums=nums.astype(jnp.int32), num_count=jnp.asarray(count, jnp.int32),
            target=jnp.asarray(target, jnp.int32), reward_id=jnp.asarray(-1, jnp.int32),
        )
        return state, first_timestep(self.observation_pieces(state))

    def step(self, state: CountdownState, answer):
        """Score the answer ``(uint8[answer_width], length)``; the episode ends."""
        data, length = answer
        reward = score_answer(data, length, state.nums, state.num_count, state.target)
        reward_id = jnp.where(reward == SCORE, 2, jnp.where(reward > 0, 1, 0)).astype(jnp.int32)
        state = state.replace(reward_id=reward_id)
        timestep = make_timestep(
            self.observation_pieces(state),
            reward=reward,
            terminated=jnp.asarray(True),
            truncated=jnp.asarray(False),
            extras=step_extras(success=reward == SCORE, effective=reward > 0),
        )
        return state, timestep

    @cached_property
    def observation_spec(self):
        return specs.Array((2 + MAX_NUMS,), jnp.int32, name="pieces")

    @cached_property
    def action_spec(self):
        return specs.Array((self.answer_width,), jnp.uint8, name="answer")

    # ---- text --------------------------------------------------------------------------------

    def render_text(self, state: CountdownState) -> str:
        reward_id = int(state.reward_id)
        if reward_id >= 0:
            return f"Your answer get {STEP_REWARDS[reward_id]} points."
        nums = [int(n) for n in np.asarray(state.nums)[: int(state.num_count)]]
        return f"Target: {int(state.target)}, nums: {nums}"

    @cached_property
    def piece_texts(self) -> tuple[str, ...]:
        """Targets (with the text up to the list), first numbers, later numbers, the list's end,
        then the three answer verdicts."""
        values = range(VALUE_LIMIT)
        return (
            *(f"Target: {t}, nums: [" for t in values),
            *(f"{n}" for n in values),
            *(f", {n}" for n in values),
            "]\n",
            *(f"Your answer get {r} points.\n" for r in STEP_REWARDS),
        )

    def observation_pieces(self, state: CountdownState):
        """int32[6]: target, first number, up to three more, "]\\n"; or the verdict and -1s."""
        later = jnp.where(jnp.arange(1, MAX_NUMS) < state.num_count, 2 * VALUE_LIMIT + state.nums[1:], -1)
        task = jnp.concatenate([
            jnp.stack([state.target, VALUE_LIMIT + state.nums[0]]), later, jnp.array([3 * VALUE_LIMIT]),
        ])
        verdict = jnp.full((2 + MAX_NUMS,), -1, jnp.int32).at[0].set(3 * VALUE_LIMIT + 1 + state.reward_id)
        return jnp.where(state.reward_id >= 0, verdict, task).astype(jnp.int32)

    def sample_observation_pieces(self, rng, num_pieces: int) -> list[int]:
        """A random task with values of one to three digits, or a verdict."""
        if rng.random() < 0.2:
            return [3 * VALUE_LIMIT + 1 + int(rng.integers(len(STEP_REWARDS)))] + [-1] * (num_pieces - 1)
        values = [int(rng.integers(10 ** int(rng.integers(1, 4)))) for _ in range(1 + MAX_NUMS)]
        later = [2 * VALUE_LIMIT + v for v in values[2:]]
        if rng.random() < 0.5:
            later[-1] = -1  # three numbers
        return [values[0], VALUE_LIMIT + values[1], *later, 3 * VALUE_LIMIT]

    # ---- RAGEN seeds -------------------------------------------------------------------------

    def reset_from_seed(self, seed: int) -> CountdownState:
        """RAGEN's task for ``seed`` (row ``seed % len(tasks)``) with a task table; else ``reset``'s."""
        if self.table is None:
            return self.reset(jax.random.PRNGKey(seed))[0]
        index = seed % self.table[0].shape[0]
        return self._start(*(a[index] for a in self.table))[0]
