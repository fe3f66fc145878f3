"""Every command and code block of README.md runs, so the README cannot drift from the code.

Each command the README shows is listed in ``COMMANDS`` with how this test runs it: as written, or
shrunk (a tiny random model and a few trajectories instead of the bundled 135M or the paper's
0.5B, one step), or not at all with the reason. The list is reviewed by hand: a README command that
is not in it, or an entry that is no longer in the README, fails ``test_every_readme_command_is_listed``.
Shrinking only adds flags after the README's own, and an output folder under tmp; the command's
module, config, preset and its own flags run as written. Python blocks run as written.

The quick start, the sweep and the evaluation of the quick start's run folder run by default (a few
minutes); the five training commands and the benchmarks' smoke runs are ``slow``
(``pytest -m slow``, as the README says).
"""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import TINY_MODEL_FLAGS, assert_bandit_suite

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()

# configs/sokoban.py and its presets: 2 groups x 2 Sokoban rollouts, 2 validation levels, 1 step.
TINY_SOKOBAN = (*TINY_MODEL_FLAGS, "--config.envs.train.n_groups=(2,)", "--config.envs.train.group_size=2",
                "--config.envs.val.n_groups=(2,)", "--config.rollout.response_length=6",
                "--config.rollout.max_model_len=1024", "--config.actor.ppo_mini_batch_size=2",
                "--config.actor.micro_batch_size=2", "--config.trainer.test_freq=1", "--config.trainer.save_freq=1",
                "--config.trainer.log_trajectories=1", "--config.trainer.total_steps=1")
# configs/quickstart.py already runs on a CPU; only the model shrinks, one step, no validation.
TINY_QUICKSTART = (*TINY_MODEL_FLAGS, "--config.trainer.total_steps=1", "--config.trainer.test_freq=0")
QUICK_BENCH = ("--quick",)

# configs/learn_bandit.py: 2 groups (one kept), 4 + 4 validation levels (its 4 chunks of one), 2 steps.
TINY_LEARN = (*TINY_MODEL_FLAGS, "--config.envs.train.n_groups=(2,)", "--config.envs.val.n_groups=(4,4)",
              "--config.actor.ppo_mini_batch_size=8", "--config.actor.micro_batch_size=8", "--config.trainer.total_steps=2",
              "--config.trainer.test_freq=2")
LEARN = ".venv/bin/python -m experiments.run --config configs/learn_bandit.py"
CURVES = ".venv/bin/python -m experiments.curves runs/learn_bandit --out runs/learn_bandit/curves.png"
ONE_STEP_OFF = ("JAX_NUM_CPU_DEVICES=2 .venv/bin/python -m experiments.run --config configs/quickstart.py "
                "--config.trainer.staleness=1 --config.rollout.use_sampler_logprobs=True --config.mesh.rollout_devices=1 "
                "--config.trainer.output_dir=runs/quickstart_one_step_off")
# configs/learn_frozen_lake.py: 2 groups of 8 (one kept), 2 validation levels, 1 step.
TINY_LEARN_FL = (*TINY_MODEL_FLAGS, "--config.envs.train.n_groups=(2,)", "--config.envs.val.n_groups=(2,)",
                 "--config.actor.ppo_mini_batch_size=8", "--config.trainer.total_steps=1", "--config.trainer.test_freq=1")

SKIP = "skip"
# README command (comments stripped) -> (flags appended to shrink it, () as written, or SKIP; why; slow).
COMMANDS = {
    "bash setup.sh": (SKIP, "builds the .venv these tests run in; CI runs it", False),
    ".venv/bin/python -m pytest -q": (SKIP, "this test suite itself", False),
    ".venv/bin/python -m pytest -q -m slow": (SKIP, "this test suite's slow part", False),
    ".venv/bin/python -m experiments.run --config configs/quickstart.py": (TINY_QUICKSTART, "tiny model, 1 step", False),
    ".venv/bin/python -m experiments.run --config configs/sokoban.py": (TINY_SOKOBAN, "0.5B on a GPU", True),
    ".venv/bin/python -m experiments.run --config configs/presets.py:starpo_grpo": (TINY_SOKOBAN, "0.5B on a GPU", True),
    ".venv/bin/python -m experiments.run --config configs/sokoban.py --config.rollout.max_turn=3 --config.actor.lr=3e-6":
        (TINY_SOKOBAN, "0.5B on a GPU", True),
    ".venv/bin/python -m experiments.run --config configs/sokoban.py --config.trainer.resume=True":
        ((*TINY_SOKOBAN[:-1], "--config.trainer.total_steps=2"), "continues the tiny configs/sokoban.py run", True),
    ".venv/bin/python -m experiments.run --config configs/presets.py:sokoban+lora": (TINY_SOKOBAN, "0.5B on a GPU", True),
    ".venv/bin/python -m experiments.sweep --config configs/quickstart.py --sweep actor.lr=1e-6,3e-6 --sweep filter.ratio=0.5,1.0":
        ((*TINY_MODEL_FLAGS, "--config.trainer.total_steps=1"), "tiny model, 1 step", False),
    ".venv/bin/python -m experiments.evaluate --model runs/quickstart --suite bandit":
        (("--levels", "2", "--batch", "2", "--response-length", "8"), "the tiny quick start's run folder, 2 levels", False),
    ".venv/bin/python -m experiments.evaluate --model runs/quickstart --suite bandit --policy random-valid":
        (("--levels", "2", "--batch", "2"), "the tiny quick start's run folder, 2 levels", False),
    ".venv/bin/python -m experiments.evaluate --model smollm2-135m-instruct --suite sokoban_generalisation --levels 256":
        (("--levels", "1", "--batch", "1", "--max-turn", "1", "--response-length", "8"), "1 level per env", True),
    "JAX_NUM_CPU_DEVICES=2 .venv/bin/python -m experiments.bench.envs": (QUICK_BENCH, "smoke run", True),
    ".venv/bin/python -m experiments.bench.generate": (QUICK_BENCH, "smoke run", True),
    ".venv/bin/python -m experiments.bench.rollout": (QUICK_BENCH, "smoke run", True),
    ".venv/bin/python -m experiments.bench.decode_attention":
        (QUICK_BENCH, "smoke run (tests/test_bench_decode_attention.py runs it by default)", True),
    ".venv/bin/python -m experiments.bench.train": (QUICK_BENCH, "smoke run", True),
    ".venv/bin/python -m experiments.bench.template_collapse":
        (("--repeats", "1", *TINY_MODEL_FLAGS, "--config.envs.train.n_groups=(2,)", "--config.actor.ppo_mini_batch_size=8"),
         "tiny model (tests/test_bench_template_collapse.py runs a smaller one by default)", True),
    ".venv/bin/python -m experiments.bench.format_warmup --steps 20":
        (("--steps", "2", "--lr", "1e-3", *TINY_MODEL_FLAGS, "--config.envs.train.n_groups=(2,)",
          "--config.actor.ppo_mini_batch_size=8"),
         "tiny model, 2 steps (tests/test_bench_format_warmup.py runs a smaller one by default)", True),
    ".venv/bin/python -m experiments.bench.imitation":
        (("--steps", "1", "--levels", "2", *TINY_MODEL_FLAGS, "--config.envs.val.n_groups=(2,)", "--config.rollout.max_turn=1"),
         "tiny model, 1 step (tests/test_bench_imitation.py runs a smaller one by default)", True),
    ".venv/bin/python -m experiments.bench.ceilings": (QUICK_BENCH, "smoke run (tests/test_bench_ceilings.py runs one by default)", True),
    ".venv/bin/python -m experiments.bench.step": (("--tiny",), "CPU smoke run (tests/test_bench_step.py runs it by default)", True),
    ".venv/bin/python -m experiments.plan --config configs/quickstart.py --devices 1 --device-memory 80GiB":
        ((), "compiles the quick start's programs for abstract shapes (tests/test_plan.py checks the figures)", True),
    ".venv/bin/python -m experiments.report runs/quickstart": ((), "on the tiny quick start's run folder", False),
    "bash setup.sh --download-wheels wheelhouse --python 3.12":
        (SKIP, "downloads ~5 GB of wheels for another machine; its pip resolution was checked with --dry-run", False),
    "bash setup.sh --wheelhouse wheelhouse": (SKIP, "needs the wheelhouse the command above builds", False),
    ".venv/bin/pip install -e '.[peer]'": (SKIP, "installs trl, which CI does not (it installs .[test])", False),
    ".venv/bin/python -m experiments.bench.peer":
        (SKIP, "needs trl; tests/test_bench_peer.py's slow test runs it for 2 steps", False),
    ".venv/bin/python -m experiments.bench.peer --rounds 2 --out bench_results/peer_abba":
        (SKIP, "needs trl; tests/test_bench_peer.py tests the alternation and the ratio by default", False),
    LEARN: (TINY_LEARN, "tiny model, 2 groups, 2 steps", False),
    ONE_STEP_OFF: ((*TINY_MODEL_FLAGS, "--config.trainer.total_steps=2", "--config.trainer.test_freq=0",
                    "--config.trainer.mi_freq=1", "--config.trainer.export_hf=False"),
                   "tiny model, 2 steps, template collapse scored on the sampler's device", False),
    CURVES: ((), "on the tiny learning run's folder", False),
    ".venv/bin/python -m experiments.run --config configs/learn_frozen_lake.py":
        (TINY_LEARN_FL, "tiny model, 2 groups, 1 step", True),
    ".venv/bin/python -m experiments.baselines --config configs/learn_frozen_lake.py":
        (("--levels", "2"), "2 levels (tests/test_baselines.py runs 4 by default)", True),
}


def readme_blocks(language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", README, flags=re.M | re.S)


def readme_commands() -> list[str]:
    """Lines of the bash blocks, and the commands in the benchmark table's first column."""
    lines = [line.split(" #")[0].strip() for block in readme_blocks("bash") for line in block.splitlines()]
    table = re.findall(r"^\| `([^`]*python -m [^`]*)` \|", README, flags=re.M)
    return [c for c in lines + table if c]


def test_every_readme_command_is_listed():
    shown = readme_commands()
    assert sorted(set(shown)) == sorted(COMMANDS), "review the README's commands against COMMANDS"
    # The default-run commands each have a test of their own below (the slow ones run shrunk by
    # test_readme_command_slow); a new one needs its test.
    default = {c for c, (how, _, slow) in COMMANDS.items() if how is not SKIP and not slow}
    assert default == {QUICKSTART, EVAL_QUICKSTART, RANDOM_QUICKSTART, REPORT_QUICKSTART, LEARN, CURVES, SWEEP,
                       ONE_STEP_OFF}


def test_readme_commands_run_as_written_after_setup():
    """No bare ``python``: it is not the .venv's interpreter unless the venv is activated."""
    assert re.findall(r"(?<![/\w])python -m [\w.]+", README) == []


def run_command(command: str, tmp: Path, extra=(), replace=None) -> subprocess.CompletedProcess:
    """``command`` with the repository's interpreter, its env assignments applied, ``extra`` flags
    appended, ``runs/...`` and ``bench_results/`` paths redirected under ``tmp``."""
    words = shlex.split(command)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(REPO)}
    while "=" in words[0]:
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    assert words[0] in ("python", ".venv/bin/python"), command
    words = [sys.executable, *[(replace or {}).get(w, w) for w in words[1:]], *extra]
    module = words[2]
    if module in ("experiments.run", "experiments.sweep"):
        words.append(f"--config.trainer.output_dir={tmp / 'run'}")
    elif module == "experiments.evaluate" or module.startswith("experiments.bench."):
        words += ["--out", str(tmp / "out.json")]
    proc = subprocess.run(words, cwd=REPO, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, f"{command}\n{proc.stderr[-3000:]}"
    return proc


def shrunk(command: str) -> tuple[str, ...]:
    how = COMMANDS[command][0]
    assert isinstance(how, tuple), f"{command!r} is not run ({how})"
    return how


def cases(slow: bool):
    return [pytest.param(c, marks=[pytest.mark.slow] if s else [], id=short(c))
            for c, (how, _, s) in COMMANDS.items() if how is not SKIP and s == slow]


def short(command: str) -> str:
    """A test id: the module and its flags, without the interpreter."""
    return command.split(" -m ", 1)[-1].replace(" ", "_")


QUICKSTART = ".venv/bin/python -m experiments.run --config configs/quickstart.py"
EVAL_QUICKSTART = ".venv/bin/python -m experiments.evaluate --model runs/quickstart --suite bandit"
RANDOM_QUICKSTART = f"{EVAL_QUICKSTART} --policy random-valid"
REPORT_QUICKSTART = ".venv/bin/python -m experiments.report runs/quickstart"
RESUME = ".venv/bin/python -m experiments.run --config configs/sokoban.py --config.trainer.resume=True"
SWEEP = ".venv/bin/python -m experiments.sweep --config configs/quickstart.py --sweep actor.lr=1e-6,3e-6 --sweep filter.ratio=0.5,1.0"


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quickstart")
    run_command(QUICKSTART, tmp, shrunk(QUICKSTART))
    return tmp / "run"


def test_quickstart_and_evaluating_its_run_folder(quickstart_run, tmp_path):
    assert (quickstart_run / "hf_policy" / "config.json").is_file()
    run_command(EVAL_QUICKSTART, tmp_path, shrunk(EVAL_QUICKSTART), replace={"runs/quickstart": str(quickstart_run)})
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert_bandit_suite(results, levels=2)
    run_command(RANDOM_QUICKSTART, tmp_path, shrunk(RANDOM_QUICKSTART), replace={"runs/quickstart": str(quickstart_run)})
    results = json.loads((tmp_path / "out.json").read_text())["results"]
    assert_bandit_suite(results, levels=2)
    assert all(r["action_is_valid"] == 1.0 for r in results.values())  # every random answer names an arm
    run_command(REPORT_QUICKSTART, tmp_path, replace={"runs/quickstart": str(quickstart_run)})
    assert "train/Bandit/success" in (quickstart_run / "report.html").read_text()  # the run's curves embedded


def test_learning_preset_and_its_curves(tmp_path):
    """The learning preset's two tiny steps validate before and after, and its curves draw."""
    run_command(LEARN, tmp_path, shrunk(LEARN))
    run = tmp_path / "run"
    proc = run_command(CURVES, tmp_path, replace={"runs/learn_bandit": str(run),
                                                   "runs/learn_bandit/curves.png": str(tmp_path / "curves.png")})
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((tmp_path / "curves.json").read_text())["run"]["validation"]
    assert [p["step"] for p in summary["Bandit"]] == [0, 2] and summary["BanditTest"][0]["levels"] == 4
    assert "Bandit" in proc.stdout and "step   0" in proc.stdout


def test_the_sweep_trains_its_grid_in_one_program(tmp_path):
    """The README's sweep: its four settings, in grid order, each trained with its own learning rate
    and filter (the quick start's 2 groups: ratio 0.5 keeps one, 1.0 both)."""
    run_command(SWEEP, tmp_path, shrunk(SWEEP))
    rows = [json.loads(line) for line in (tmp_path / "run" / "sweep.jsonl").read_text().splitlines()]
    assert [r["setting"] for r in rows] == [
        {"actor.lr": 1e-6, "filter.ratio": 0.5}, {"actor.lr": 1e-6, "filter.ratio": 1.0},
        {"actor.lr": 3e-6, "filter.ratio": 0.5}, {"actor.lr": 3e-6, "filter.ratio": 1.0},
    ]
    assert [r["actor/lr"] for r in rows] == pytest.approx([1e-6, 1e-6, 3e-6, 3e-6])
    assert [r["rollout/filter_kept_groups"] for r in rows] == [1, 2, 1, 2]


def test_one_step_off_on_split_devices(tmp_path):
    """The README's one-step-off command on two simulated devices: the second samples, the first
    trains, for two steps (tests/test_batches.py checks which weights sampled each batch)."""
    proc = run_command(ONE_STEP_OFF, tmp_path, shrunk(ONE_STEP_OFF))
    assert "one step off (trainer.staleness=1): each batch is sampled while the update before it runs, sampling on " \
           "devices [1], training on [0]" in proc.stdout
    train = [r for r in map(json.loads, (tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
             if "train/reward/mean" in r]
    assert [r["step"] for r in train] == [1, 2] and all("train/Bandit/mi" in r for r in train)


@pytest.mark.parametrize("command", [c for c in cases(slow=True) if c.values[0] != RESUME])
def test_readme_command_slow(command, tmp_path):
    run_command(command, tmp_path, shrunk(command))
    if command == ".venv/bin/python -m experiments.run --config configs/sokoban.py":
        run_command(RESUME, tmp_path, shrunk(RESUME))  # continues this run for a second step
        steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert steps[-1] == 2 and steps.count(1) == steps.count(2), steps  # step 2 added, step 1 kept


@pytest.mark.parametrize("block", readme_blocks("python"))
def test_readme_python_block(block):
    exec(compile(block, "README.md", "exec"), {})


def test_setup_installs_quietly(tmp_path):
    """setup.sh's pip calls drop pip's notices about this machine's pip.conf index folders, keep
    errors and exit statuses; the project builds without setuptools' deprecation banner."""
    found = re.search(r"^export PYTHONWARNINGS=.*?^}\n", (REPO / "setup.sh").read_text(), re.M | re.S)
    assert found is not None, "setup.sh's pip wrapper is gone"
    pip_ = found.group(0)
    fake = tmp_path / "fakepython"  # a python whose pip prints the notice, then fails
    fake.write_text("#!/bin/sh\necho \"WARNING: Location 'file:///opt/x/simple/pip/' is ignored: it is neither a file "
                    "nor a directory.\" >&2\necho 'ERROR: no matching distribution' >&2\nexit 1\n")
    fake.chmod(0o755)
    proc = subprocess.run(["bash", "-c", f"set -euo pipefail\n{pip_}\npip_ {fake} install x"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and proc.stderr == "ERROR: no matching distribution\n"
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    for package in ("starpo_jax", "envs_jax", "experiments", "configs"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(tmp_path / "wheel"), str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0 and "deprecated" not in build.stderr, build.stderr


def test_setup_installs_the_browser_only_when_asked():
    """apt installs chromium only under --browser (CI passes it), and tcmalloc only as root, its
    failure not setup's; --help lists --browser, an unknown option is one line."""
    text = (REPO / "setup.sh").read_text()
    chromium = text[text.index("if ! command -v chromium"):]
    assert 'if [[ -n "$browser" ]]' in chromium[:chromium.index("apt-get update")]
    tcmalloc = text[text.index("allocator.library()"):text.index("if ! command -v chromium")]
    assert "libtcmalloc-minimal4" in tcmalloc and "exit" not in tcmalloc
    assert '[[ $EUID -eq 0 ]] && command -v apt-get' in tcmalloc[:tcmalloc.index("apt-get update")]
    for block in (chromium, tcmalloc):
        assert ">\"$log\" 2>&1" in block[block.index("apt-get update"):]
    assert "bash setup.sh --browser" in (REPO / ".ci" / "run").read_text()
    shown = subprocess.run(["bash", str(REPO / "setup.sh"), "--help"], capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0 and "--browser" in shown.stdout
    bad = subprocess.run(["bash", str(REPO / "setup.sh"), "--bogus"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == ["setup.sh: unknown option --bogus (see bash setup.sh --help)"]


def test_each_documented_module_command_names_itself_as_it_is_run():
    """A command documented as ``python -m experiments.X`` that parses with argparse says so in its
    usage and errors (argparse would name the file, ``X.py``, which does not run as written)."""
    docs = README + "".join(p.read_text() for p in (REPO / "docs").glob("*.md"))
    checked = []
    for path in sorted((REPO / "experiments").rglob("*.py")):
        module = ".".join(path.relative_to(REPO).with_suffix("").parts)
        source = path.read_text()
        if "argparse.ArgumentParser(" in source and re.search(rf"python -m {re.escape(module)}\b", docs):
            assert f'prog="python -m {module}"' in source, f"{module}: ArgumentParser(prog=...) names another command"
            checked.append(module)
    assert {"experiments.evaluate", "experiments.baselines", "experiments.bench.ceilings"} <= set(checked)
