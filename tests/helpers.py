"""What several test modules share: the tiny model's and the tiny run's settings (as config
overrides and as flags), starting a command in a subprocess with the suite's environment, reading a
run folder, and a responder that answers from a script.
(Fixtures live in conftest.py.) Importing it imports no jax: conftest.py sets jax's environment
after importing it."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # for the annotations only: importing this module imports no jax or numpy
    import numpy as np

REPO = Path(__file__).resolve().parents[1]

# A random tiny-llama over the bundled SmolLM2 tokenizer, in float32 (CPU): config overrides, as
# ``configs.base.with_overrides`` takes them; ``config_flags`` writes them as a command's flags.
TINY_MODEL = {
    "model.source": "smollm2-135m-instruct",  # its tokenizer; the weights are random
    "model.random_init_preset": "tiny-llama",
    "model.dtype": "float32",
}

# One Bandit turn of 6 tokens for 2 groups of 2 on the tiny model, as config overrides.
TINY_BANDIT = {
    **TINY_MODEL,
    "envs.train.tags": ("Bandit",), "envs.train.n_groups": (2,), "envs.train.group_size": 2,
    "envs.val.tags": ("Bandit",), "envs.val.n_groups": (2,),
    "rollout.max_turn": 1, "rollout.response_length": 6, "rollout.max_model_len": 320,
    "filter.ratio": 1.0,
    "actor.ppo_mini_batch_size": 4, "actor.micro_batch_size": 2,
}


def tiny_llama_for(tokenizer):
    """A random tiny-llama (float32, seed 0) whose vocabulary is ``tokenizer``'s, as a ``ModelState``,
    built in the test's process."""
    from flax import nnx

    from starpo_jax.models import Decoder, ModelState, preset

    config = dataclasses.replace(preset("tiny-llama"), vocab_size=len(tokenizer))
    return ModelState.split(Decoder(config, rngs=nnx.Rngs(0)))


def config_flags(overrides: dict) -> list[str]:
    """``{"section.key": value}`` as command-line flags (a tuple as its Python literal)."""
    return [f"--config.{key}={value}" for key, value in overrides.items()]


TINY_MODEL_FLAGS = config_flags(TINY_MODEL)

# The tiny run of experiments.run: three envs, two steps, validation at 0 and 2, a checkpoint each step.
TINY = [
    "--config=configs/base.py",
    *TINY_MODEL_FLAGS,
    "--config.envs.train.tags=('SimpleSokoban','FrozenLake','Bandit')",
    "--config.envs.train.n_groups=(1,1,1)",
    "--config.envs.train.group_size=2",
    "--config.envs.val.tags=('FrozenLake',)",
    "--config.envs.val.n_groups=(2,)",
    "--config.rollout.max_turn=2",
    "--config.rollout.response_length=6",
    "--config.rollout.max_model_len=640",
    "--config.filter.ratio=0.5",
    "--config.actor.ppo_mini_batch_size=2",
    "--config.actor.micro_batch_size=2",
    "--config.trainer.total_steps=2",
    "--config.trainer.test_freq=2",
    "--config.trainer.save_freq=1",
    "--config.trainer.log_trajectories=1",
]

# The session's run of TINY (conftest.py's ``full_run``) validates greedily, two levels in two calls from
# seed 200 (not the default 123), so that evaluating its folder plays its last validation again
# (tests/test_run.py); flags after TINY's, which a test resuming that run passes too.
FULL_RUN = ["--config.rollout.val_temperature=0.0", "--config.trainer.val_chunks=2", "--config.envs.val.seed=200"]


def tiny_with(overrides: dict) -> list[str]:
    """``TINY`` with ``{"section.key": value}`` in place of its own values."""
    kept = [arg for arg in TINY if arg.split("=", 1)[0].removeprefix("--config.") not in overrides]
    return kept + config_flags(overrides)


# The caches' settings (conftest.py points them at the session's cache folder).
CACHE_VARS = ("STARPO_JAX_CACHE", "JAX_COMPILATION_CACHE_DIR",
              "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES")


# Test processes compile for compile time. XLA:CPU's code generation is most of the compile time of
# the suite's tiny programs, which run for milliseconds either way. So: LLVM's optimisations off,
# its expensive passes off, and XLA's older elemental emitters instead of its MLIR fusion emitters
# (together they roughly halve a tiny run's compile; docs/benchmarks.md; the programs run as fast). Matrix products call the same library kernels; elementwise code may
# round differently from an optimised build (fused multiply-adds), which the suite's tolerances
# allow, and exact comparisons are between processes compiled alike. A flag this jaxlib does not
# know is left out (XLA aborts on an unknown flag, and flags come and go between releases).
def _known_to_jaxlib(flags: list[str]) -> str:
    import importlib.util
    import mmap

    known = set()
    spec = importlib.util.find_spec("jaxlib")
    assert spec is not None and spec.origin is not None, "jaxlib is not installed"
    for library in Path(spec.origin).parent.glob("*.so"):
        with open(library, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as text:
            known |= {flag for flag in flags if text.find(flag[2:].split("=")[0].encode() + b"\0") >= 0}
    return " ".join(flag for flag in flags if flag in known)


XLA_TEST_FLAGS = _known_to_jaxlib(["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true",
                                   "--xla_cpu_use_fusion_emitters=false"])

# Compiler options that undo XLA_TEST_FLAGS where they change a program's HLO, for a test that reads
# a compiled program as a run compiles it (the fusion emitters decide which slices fuse into their
# consumers; LLVM's settings change only the machine code).
AS_A_RUN_COMPILES: dict[str, str | bool] = {"xla_cpu_use_fusion_emitters": True}  # jax's compiler_options


def simulated_devices(devices: int) -> dict[str, str]:
    """The environment of a process with ``devices`` simulated CPU devices.

    XLA:CPU runs a program's independent operations concurrently on one thread pool, as many
    threads as cores. A collective holds its thread until every device reaches it, and two
    independent collectives (say a gather beside a loop that gathers inside) may start in a
    different order on each device; on 2 cores both threads can then wait at different
    collectives, each for the other's device, until XLA aborts (a rendezvous timeout, seen on
    2-device steps). Enough threads that a blocked one never starves the rest: ``PJRT_NPROC``
    sizes the pool."""
    return {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices} {XLA_TEST_FLAGS}",
            "PJRT_NPROC": str(max(os.cpu_count() or 1, 4 * devices))}


def command_env(devices: int | None = None, **extra: str) -> dict[str, str]:
    """A clean environment for a command (CPU, the suite's XLA flags, none inherited), with the
    suite's compilation cache; ``devices`` simulated CPU devices."""
    env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "HOME": str(Path.home()), "XLA_FLAGS": XLA_TEST_FLAGS}
    env |= {k: os.environ[k] for k in CACHE_VARS if k in os.environ}
    if devices is not None:
        env |= simulated_devices(devices)
    return env | extra


def run(*args, check=True, devices=1, module="experiments.run", tiny=True, timeout=900, env=None):
    """``python -m experiments.run`` (or ``module``) with the tiny run's flags, then ``args``;
    ``env``: variables added to ``command_env``'s."""
    proc = subprocess.run(
        [sys.executable, "-m", module, *(TINY if tiny else ()), *args],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=command_env(devices, **(env or {})),
    )
    if check and proc.returncode != 0:
        raise AssertionError(proc.stderr[-4000:])
    return proc


def evaluate(*args):
    return run(*args, check=False, devices=None, module="experiments.evaluate", tiny=False)


def assert_bandit_suite(results: dict, levels: int) -> None:
    """``experiments.evaluate --suite bandit``'s results on ``levels`` levels are consistent."""
    assert set(results) == {"Bandit", "BanditTest"}
    for r in results.values():
        assert r["levels"] == levels and r["success"] * levels in range(levels + 1)  # a share of the levels
        # One pull at most, always effective, and success means pulling the risky arm.
        assert r["success"] <= r["num_actions"] == r["action_is_effective"] <= 1


def read_metrics(path):
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


def train_lines(rows):
    return [r for r in rows if "train/reward/mean" in r]


def tensorboard_scalars(out) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} as TensorBoard shows them (it honours purge_step)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tb"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@dataclasses.dataclass(frozen=True, eq=False)  # hashed by identity: a static argument of the rollout
class ScriptedResponder:
    """Answers ``script[b, turn]`` (token ids, padded) as row b's response, ignoring the prompt and
    the model; every answer token's log-prob is -1."""

    script: "np.ndarray"  # int32[B, T, R]
    lengths: "np.ndarray"  # int32[B, T]

    def init(self, model, batch_size):
        import jax.numpy as jnp

        return jnp.zeros((), jnp.int32)

    def respond(self, model, cache, prompt_ids, num_new, key, temperature, active, turn):
        import jax.numpy as jnp

        from starpo_jax.rollout.sampling import DecodeOutput

        tokens = jnp.asarray(self.script)[:, turn]
        lengths = jnp.where(active, jnp.asarray(self.lengths)[:, turn], 0)
        return DecodeOutput(tokens=tokens, logprobs=-jnp.ones(tokens.shape, jnp.float32), lengths=lengths, cache=cache,
                            last_logits=None)


def assert_refused_in_one_line(parse_args, argv: str, message: str, capsys) -> None:
    """``parse_args(argv.split())`` exits with status 2, ``message`` on stderr (argparse's one line)."""
    import pytest

    with pytest.raises(SystemExit) as exit_:
        parse_args(argv.split())
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def script_module(path: Path):
    """A script that runs as a file, not from its package (``experiments/bench/turn.py``), imported
    as a module for in-process calls."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---- the decode loop with a stand-in step -------------------------------------------------------


def fake_decode_state(budgets: "np.ndarray", steps: int):
    """A ``sampling.DecodeState`` of len(budgets) rows whose cache is a stand-in (``decode_loop``
    only moves it)."""
    import jax.numpy as jnp

    from starpo_jax.rollout import sampling

    n = len(budgets)
    cache = sampling.KVCache(k=(jnp.zeros((n, 1, 2, 1)),), v=(jnp.zeros((n, 1, 2, 1)),), lengths=jnp.zeros(n, jnp.int32),
                             prefix_group=jnp.arange(n, dtype=jnp.int32), prefix_length=jnp.zeros(n, jnp.int32))
    return sampling.DecodeState(
        step=jnp.int32(0), cache=cache, next_token=jnp.zeros(n, jnp.int32), next_logprob=jnp.zeros(n),
        last_hidden=jnp.zeros((n, 1)), tokens=jnp.zeros((n, steps), jnp.int32), logprobs=jnp.zeros((n, steps)),
        lengths=jnp.zeros(n, jnp.int32), budgets=jnp.asarray(budgets, jnp.int32), done=jnp.asarray(budgets) <= 0)


def recording_step(s, per_row):
    """A ``sampling.decode_loop`` step that records, for each live row, the batch it ran in
    (``tokens``) and the row ``per_row`` named for it (``logprobs``), and stops rows at their
    budgets."""
    import jax.numpy as jnp

    live = ~s.done
    lengths = s.lengths + live
    return s.replace(step=s.step + 1, lengths=lengths, done=s.done | (lengths >= s.budgets),
                     tokens=s.tokens.at[:, s.step].set(jnp.where(live, s.done.shape[0], 0)),
                     logprobs=s.logprobs.at[:, s.step].set(jnp.where(live, per_row, -1)))
