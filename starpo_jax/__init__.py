"""starpo-jax: StarPO / StarPO-S multi-turn RL for LLM agents in JAX.

``train`` is the iteration (collect → filter → learn), read top-down; ``forward`` its forward passes
over the update batch. The rest is grouped by role: ``algo`` (the update maths), ``rollout`` (the
compiled multi-turn rollout), ``models`` (the decoder and its checkpoints), ``runtime`` (settings,
experiment, planner, mesh, many hosts, checkpoints, caches) and ``diagnostics`` (metrics, the
collapse watch, dumps). ``format_warmup`` is the optional supervised warm-up before RL.
"""
