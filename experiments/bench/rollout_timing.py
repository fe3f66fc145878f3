"""Timing a multi-turn rollout, shared by ``bench.rollout`` and ``bench.step``: the model under
test (``Subject``), what a rollout did per row and its rates (``Episodes``, ``summarise``), the
host-orchestrated baseline (``bench_baseline``: RAGEN's loop of re-rendered prompts, fresh prefills
and host env steps, described in ``experiments/bench/rollout.py``) and the HBM roofline of the
compiled rollout's decode (``decode_roofline``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jumanji.types import StepType

from envs_jax.base import GridEnv, symbols_to_text
from experiments.bench.common import timed
from starpo_jax.models import ModelState
from starpo_jax.rollout import prompts, sampling
from starpo_jax.rollout.multi_turn import RolloutPlan
from starpo_jax.rollout.parsing import decode_response, parse_response_text
from starpo_jax.runtime.planning import kv_bytes_per_token, kv_cache_bytes


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
        if int(ts.step_type) == StepType.LAST:
            env_done, episode.success = True, bool(ts.extras["success"])
            break
    episode.num_actions += len(step_rewards)
    episode.num_turns += 1
    response = prompts.forced_prefix(plan.enable_think) + text
    episode.history[-1].update(llm_response=response, reward=prompts.accumulated_reward(step_rewards))
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
    """HBM-bound time of the compiled rollout's decode (see ``experiments/bench/rollout.py``'s docstring)."""
    config = subject.model.merge().config
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(subject.model.params))
    kv_per_token = kv_bytes_per_token(config)
    played = np.asarray(traj.turn_played)
    response_len = np.where(played, np.asarray(traj.turn_end) - np.asarray(traj.turn_start), 0)
    decode_steps = int(response_len.max(axis=0).sum())
    kv_token_reads = int(np.nonzero(np.asarray(traj.loss_mask))[1].sum())
    ideal_s = (decode_steps * weight_bytes + kv_token_reads * kv_per_token) / bandwidth
    full_cache_s = decode_steps * (weight_bytes + kv_cache_bytes(config, plan.batch_size, plan.max_len)) / bandwidth
    return {
        "hbm_bytes_per_s": bandwidth,
        "weight_bytes": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        "decode_steps": decode_steps,
        "kv_token_reads": kv_token_reads,
        "ideal_s": ideal_s,
        "ceiling_tokens_per_s": int(traj.response_tokens.sum()) / ideal_s,
        "fraction": ideal_s / wall_s,
        "fraction_full_cache": full_cache_s / wall_s,
    }
