"""Exact solvers used by tests and benchmarks: Sokoban BFS and FrozenLake finite-horizon DP."""

from envs_jax.solvers.frozen_lake_dp import optimal_success_probability
from envs_jax.solvers.sokoban_bfs import shortest_solution

__all__ = ["optimal_success_probability", "shortest_solution"]
