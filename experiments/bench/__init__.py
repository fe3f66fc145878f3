"""The benchmarks and what they share.

Commands, each with a ``main`` (``python -m experiments.bench.NAME``): envs, ceilings, generate,
decode_attention, rollout, train, step, peer, template_collapse, format_warmup, imitation, append_window, and
charts (redraws the PNG charts of JSON reports already written). ``decode_hlo.py`` is a command run
as a file (``python experiments/bench/decode_hlo.py``) so that ``--tree`` picks the source tree
imported: it imports that tree's ``step``, swaps ``jax.devices`` so that ``step.decode_cost``'s CPU
compile targets the accelerator, and wraps ``step.hlo_bytes`` to keep the HLO text. It is the only
benchmark that imports another. ``turn.py`` is run as a file for the same reason: it times one
rollout turn (append, decode) with this tree's packages and with ``--tree``'s, each side in a
process of its own, alternating (ABBA).

Libraries, without a ``main``: common (the machine, the clock, writing the JSON report and its chart
through charts), generation_timing (for generate, step, append_window), rollout_timing (for rollout
and step), hlo_bytes (for step and ceilings: the bytes and the products' FLOPs of a compiled program).

GPU lease scripts (bash, not Python): gpu_window.sh (a whole lease in priority order),
gpu_decode_check.sh (its decode checks alone), and gpu_lib.sh, which both source."""
