"""Where each training step's rollout batch comes from (``trainer.staleness``; docs/scaling.md,
"Rollout and update at once").

- 0, ``sample_now``: step t samples batch t with the weights update t then starts from, and waits
  for it (RAGEN's loop).
- 1, ``OneStepOff``: batch t+1 is dispatched before update t, sampled by the weights update t
  starts from; JAX's asynchronous dispatch then runs that rollout and update t at once where the
  devices allow (devices of their own: ``mesh.rollout_devices``). Every batch is at most one update
  old, and the first is fresh.

The rollout reads only the policy's weights and the step (its keys) of a train state. The update
donates its state, so the sampler works on a copy of those, in buffers of its own on its own mesh
(``sharding.move``: ``jax.device_put``, asynchronous, device to device, across processes when
the parts lie on different hosts); its batch moves to the trainer's mesh the same way. A batch's
step index, not its weights, picks its levels and sampling keys, so batch t plays the levels of a
synchronous run's batch t.
"""

from __future__ import annotations

import contextlib
from typing import Callable, NamedTuple

import jax
from jax.sharding import Mesh

from starpo_jax.rollout.multi_turn import Trajectories
from starpo_jax.runtime import sharding
from starpo_jax.train import TrainState


class Batch(NamedTuple):
    """A rollout batch and what sampled it."""

    traj: Trajectories  # on the trainer's mesh: what the update takes
    sampled: Trajectories  # where it was sampled (the same arrays when the trainer sampled it)
    sampler: TrainState  # the weights that sampled it (of a stale batch, only what the rollout reads)
    mesh: Mesh | None  # the sampler's mesh; None: the current one

    def on_sampler(self):
        """A context in which a program reading ``sampled`` and ``sampler`` runs on their mesh."""
        return sharding.use_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()


def sample_now(collect: Callable, state: TrainState, tables, key) -> Batch:
    """Staleness 0: batch ``state.step`` sampled by ``state``'s weights, waited for."""
    traj = jax.block_until_ready(collect(state, tables, key))
    return Batch(traj, traj, state, None)


def sampler_view(state: TrainState, step) -> TrainState:
    """What the rollout reads of ``state`` (``train.collect``: the policy's weights, and the step
    that seeds its levels and keys, here ``step``); the rest is left out, so nothing else is copied."""
    return state.replace(step=step, actor_opt=None, critic=None, critic_opt=None, ref=None, skipped_steps=None,
                         critic_skipped_steps=None, base=None)


def whole_on(mesh: Mesh, tree):
    """The sharding of every array of ``tree`` whole on each device of ``mesh``: where the sampler
    keeps the rollout's tables and key (``OneStepOff``, and the planner's inputs for its rollout)."""
    return jax.tree.map(lambda _: jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), tree)


class OneStepOff:
    """Staleness 1: ``next(state)`` returns batch ``state.step``, dispatched by the call before
    (the first call samples its own), and first dispatches batch ``state.step + 1`` with
    ``state``'s weights, which the update of this batch starts from.

    ``pending_actor`` are the weights of the next batch, in flight or not yet dispatched: a
    checkpoint taken after the update holds them, and a run resumed from it passes them to
    ``resume``, which samples that batch again exactly (a rollout is a function of its weights, step
    and key)."""

    def __init__(self, collect: Callable, tables, key, trainer_mesh: Mesh, sampler_mesh: Mesh | None = None):
        self.collect = collect
        self.trainer_mesh = trainer_mesh
        self.sampler_mesh = sampler_mesh or trainer_mesh
        self.tables, self.key = jax.device_put((tables, key), whole_on(self.sampler_mesh, (tables, key)))
        self.base = None  # LoRA's frozen base on the sampler's mesh, copied once
        self.pending: tuple[Trajectories, TrainState] | None = None  # the next batch, dispatched
        self.next_sampler: TrainState | None = None  # the weights of the next batch (on the sampler's mesh)

    @property
    def pending_actor(self):
        return None if self.next_sampler is None else self.next_sampler.actor

    def resume(self, state: TrainState, actor) -> None:
        """Dispatch batch ``state.step`` with ``actor``, the weights a stopped run had sampled it with."""
        self.next_sampler = self._sampler(state.replace(actor=actor), state.step)
        self.pending = self._dispatch(self.next_sampler)

    def next(self, state: TrainState, more: bool = True) -> Batch:
        """Batch ``state.step``; ``more``: a later step follows, so dispatch its batch now."""
        sampled, sampler = self.pending or self._dispatch(self._sampler(state, state.step))
        self.next_sampler = self._sampler(state, state.step + 1)
        self.pending = self._dispatch(self.next_sampler) if more else None
        traj = jax.block_until_ready(sharding.move(sampled, sharding.row_shardings(sampled, self.trainer_mesh)))
        return Batch(traj, sampled, sampler, self.sampler_mesh)

    def _sampler(self, state: TrainState, step) -> TrainState:
        """What the rollout of batch ``step`` reads of ``state``, copied to the sampler's mesh."""
        weights = sharding.shard(sampler_view(state, step), self.sampler_mesh, copy=True)
        if state.base is not None and self.base is None:
            self.base = sharding.shard(state.base, self.sampler_mesh, copy=True)
        return weights.replace(base=self.base)

    def _dispatch(self, weights: TrainState) -> tuple[Trajectories, TrainState]:
        """The batch ``weights`` sample on the sampler's mesh, not waited for."""
        with sharding.use_mesh(self.sampler_mesh):
            return self.collect(weights, self.tables, self.key), weights


def describe(ahead: OneStepOff) -> str:
    """One line saying where a one-step-off run samples and trains."""
    sampler, trainer = (sorted(d.id for d in mesh.devices.flat) for mesh in (ahead.sampler_mesh, ahead.trainer_mesh))
    where = "on the same devices" if sampler == trainer else f"sampling on devices {sampler}, training on {trainer}"
    return f"one step off (trainer.staleness=1): each batch is sampled while the update before it runs, {where}"
