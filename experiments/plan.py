"""Will a run fit? Compile its rollout and update for a mesh of N devices, allocating no weights.

    python -m experiments.plan --config configs/quickstart.py --devices 1 --device-memory 80GiB
    python -m experiments.plan --config configs/presets.py:starpo_ppo+qwen2.5_7b_instruct+fsdp_8 \\
        --devices 8 --device-memory 80GiB

The planner builds the run's real programs (``make_train_step``'s rollout and update, as
``experiments.run`` jits them) over N simulated CPU devices, with every weight, moment and batch an
abstract shape (``nnx.eval_shape``, ``jax.ShapeDtypeStruct`` with its mesh sharding), and reads
XLA's ``compiled.memory_analysis()`` of each. It prints per device: the train state (actor,
critic, reference, Adam moments), the rollout's KV cache, the update's working memory, and the peak
against the budget; when the peak does not fit it names the knob to turn. The model's shapes come
from the checkpoint's ``config.json`` or, for Qwen2.5 hub ids and the bundled SmolLM2, from
``starpo_jax.models.preset`` (nothing is downloaded).

It exits 0 when the run fits and 1 when it does not. It also prints what a CPU run would hold: its
own resident memory once compiled (Python, JAX, XLA's programs, tokenizer, tables) plus the peak,
and one line on what that leaves out. ``experiments.run`` makes the same check on its real devices
before loading the model (``starpo_jax.runtime.planning.check_fits``); on CPU against the host's available
memory (MemAvailable). The library is ``starpo_jax/runtime/planning.py``.
"""

from __future__ import annotations

from experiments import bootstrap

if __name__ == "__main__":  # first: the simulated devices, which XLA's backend makes as the imports below start it
    bootstrap.command("experiments.plan", bootstrap.simulate_cpu_devices)

import sys

import jax
from absl import app, flags, logging

from experiments import cli
from starpo_jax.runtime.experiment import ConfigError, build_experiment
from starpo_jax.runtime.planning import PlanError, abstract_policy, parse_bytes, plan_memory

_CONFIG = cli.define_config_flag()
flags.DEFINE_integer("devices", 1, "Number of devices to plan for (simulated CPU devices).")
_DEVICE_MEMORY = flags.DEFINE_string("device-memory", "80GiB", "Memory of one device, e.g. 80GiB, 24GB, 16e9.")
FLAGS = flags.FLAGS


def main(argv) -> int:
    del argv
    logging.set_verbosity(logging.WARNING)  # absl shows INFO, e.g. jax's "Unable to initialize backend 'tpu'"
    try:
        budget = parse_bytes(_DEVICE_MEMORY.value)
        if FLAGS.devices < 1:
            raise PlanError(f"--devices must be at least 1, not {FLAGS.devices}.")
    except PlanError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if len(jax.devices()) != FLAGS.devices:  # made by bootstrap.simulate_cpu_devices, before the backend started
        print(f"error: JAX started before the planner could simulate {FLAGS.devices} devices.", file=sys.stderr)
        return 2
    try:
        exp = build_experiment(_CONFIG.value, load=abstract_policy)
    except (ConfigError, PlanError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"compiling the rollout and the update for {FLAGS.devices} device(s)...", file=sys.stderr, flush=True)
    plan = plan_memory(exp)
    print(plan.report(budget), flush=True)
    if exp.model.merge().config.dtype == "bfloat16":
        print("note: XLA:CPU widens bf16 matrix products and all-gathers to float32, so these working-memory "
              "figures overstate a GPU's (docs/scaling.md).", file=sys.stderr)
    return 0 if plan.peak <= budget else 1


def run() -> None:
    app.run(lambda argv: sys.exit(main(argv)), flags_parser=cli.parse_flags)  # --help exits 0; errors in one line
