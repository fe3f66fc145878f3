"""The benchmarks, each a command (``python -m experiments.bench.NAME``): envs, generate, rollout,
train, step, peer; and what they share: common, charts, rollout_timing, generation_timing, hlo_bytes."""
