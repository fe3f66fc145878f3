"""Evaluation on fixed levels, one way for every caller: the run's validation, ``experiments.evaluate``
and the peer benchmark. RAGEN's levels from a first seed on (``initial_states_from_seeds``: seed 123
gives the paper's), played as a few calls of one compiled rollout (``chunked_rollout``: the same
rows in a fraction of the memory), measured by ``rollout_metrics`` over every level at once."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, NamedTuple

import jax

from starpo_jax.diagnostics.metrics import jitted_rollout_metrics
from starpo_jax.rollout.multi_turn import (
    RolloutPlan,
    RolloutTables,
    Trajectories,
    chunked_rollout,
    distinct_first_prompts,
    initial_states_from_seeds,
)
from starpo_jax.runtime import distributed


@dataclasses.dataclass(frozen=True)
class FixedLevels:
    """A plan's fixed levels, ready to play: built once, played at every evaluation (one compile)."""

    plan: RolloutPlan
    tables: RolloutTables
    init_states: tuple
    rollout: Callable  # chunked_rollout's: (policy, tables, init_states, key, temperature, progress)


class LevelResults(NamedTuple):
    traj: Trajectories
    metrics: dict[str, float]  # rollout_metrics under the caller's prefix
    seconds: float  # the rollout's, metrics apart


def fixed_levels(plan: RolloutPlan, tables: RolloutTables, first_seed: int, chunks: int,
                 responder=None) -> FixedLevels:
    """``plan``'s levels of seeds ``first_seed``, ``first_seed + 1``, ... (continuing across tags),
    played in ``chunks`` calls. ``responder`` (built for ``multi_turn.chunk_plan``) answers instead of the
    policy; the policy prefills each distinct first prompt once (fixed levels repeat boards)."""
    init = initial_states_from_seeds(plan, first_seed)
    first = None if responder is not None else distinct_first_prompts(plan, tables, init)
    return FixedLevels(plan, tables, init, chunked_rollout(plan, chunks, responder, first_prompts=first))


def evaluate_levels(levels: FixedLevels, policy, key, temperature: float, prefix: str,
                    progress: Callable[[int], object] | None = None) -> LevelResults:
    """``policy`` on every level, sampling at ``temperature`` (chunk ``i`` with ``fold_in(key, i)``,
    one chunk with ``key``): the trajectories and their metrics. ``progress(1)`` is called as each
    chunk finishes (a progress bar's ``update``)."""
    t0 = time.perf_counter()
    traj = jax.block_until_ready(levels.rollout(policy, levels.tables, levels.init_states, key, temperature, progress))
    seconds = time.perf_counter() - t0
    metrics = {k: float(v) for k, v in distributed.to_host(jitted_rollout_metrics(traj, levels.plan, prefix)).items()}
    return LevelResults(traj, metrics, seconds)
