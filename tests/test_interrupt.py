"""Stopping a run (``experiments.run``, real signals to a real process): Ctrl-C (SIGINT) stops at once
with one line naming the last checkpoint and the command that resumes it, status 130 and no
traceback; SIGTERM (SLURM, preemption) first saves the step it finishes, whatever the save
schedule, status 143."""

import re
import shlex
import signal
import subprocess
import sys
import time

from experiments.report import read_jsonl
from helpers import REPO, TINY_MODEL_FLAGS, command_env, config_flags, train_lines

# The quick start on the tiny model (one Bandit turn, GRPO: little for a process to trace and
# compile before its first step, and the programs tests/test_readme.py's tiny quick start compiles
# into the suite's cache; signals are handled by the loop around the programs, whatever they hold),
# long enough to be still training when the signal comes; no validation to wait for.
LONG = {"trainer.total_steps": "1000", "trainer.test_freq": "0"}


def long_run(overrides: dict) -> list[str]:
    return ["--config=configs/quickstart.py", *TINY_MODEL_FLAGS, *config_flags(LONG | overrides)]


def saved(out) -> list[int]:
    folder = out / "checkpoints"
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit()) if folder.is_dir() else []


def wait_until(proc, ready, late: str, seconds: float, stderr_path, poll: float = 0.2) -> None:
    """Wait until ``ready()`` while ``proc`` runs; fail with its stderr if it ends first, or with
    ``late`` after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not ready():
        assert proc.poll() is None, stderr_path.read_text()[-3000:]
        assert time.monotonic() < deadline, late
        time.sleep(poll)


def signalled(tmp_path, args: list[str], sig, waits, poll: float = 0.2, **popen) -> tuple[int, str]:
    """Start ``args`` (stdout to ``tmp_path / "stdout"``, stderr to ``tmp_path / "stderr"``), wait for
    each ``(ready, late, seconds)`` of ``waits`` in turn (``wait_until``), send ``sig``; the process's
    exit status and stderr."""
    with open(tmp_path / "stdout", "w") as stdout, open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(args, cwd=REPO, stdout=stdout, stderr=stderr, env=command_env(), **popen)
        try:
            for ready, late, seconds in waits:
                wait_until(proc, ready, late, seconds, tmp_path / "stderr", poll)
            proc.send_signal(sig)
            status = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return status, (tmp_path / "stderr").read_text()


def the_line(stderr: str, marker: str) -> str:
    lines = [line for line in stderr.splitlines() if marker in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def logged_steps(out) -> list[int]:
    """The training steps of ``out``'s metrics log, read while the run writes it (a line cut short,
    being written or where the resume rewrote the log, is skipped)."""
    metrics = out / "metrics.jsonl"
    return [r["step"] for r in train_lines(read_jsonl(metrics, []))] if metrics.exists() else []


def test_ctrl_c_stops_at_once_and_sigterm_after_its_resume_saves_the_step_it_finishes(tmp_path):
    """One run stopped twice: Ctrl-C, then SIGTERM in the run its one line's command resumes (each
    signal's own run would start, plan and train a tiny run once more)."""
    out = tmp_path / "run"
    # Saved by time alone (every step takes longer than 6 ms), not by steps.
    args = [sys.executable, "-m", "experiments.run", *long_run({"trainer.save_freq": "-1",
                                                                "trainer.save_every_minutes": "0.0001"}),
            f"--config.trainer.output_dir={out}"]
    status, stderr = signalled(tmp_path, args, signal.SIGINT, [  # steps take seconds
        (lambda: logged_steps(out), "no training step logged in 10 minutes", 600),
        (lambda: saved(out), "no checkpoint a minute after the first step", 60)])
    assert status == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    line = the_line(stderr, "resume with: ")
    found = re.match(r"interrupted \(SIGINT\) after step \d+: the last checkpoint is step (\d+) in (\S+); resume with: ",
                     line)
    assert found, line
    step = int(found[1])
    assert found[2] == str(out / "checkpoints") and step == saved(out)[-1] >= 1
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[-1] == "--config.trainer.resume=True"

    # The command resumes; with no save schedule (as if none would save before step 1000), only
    # SIGTERM saves, the step it finishes. Signalled once the log shows step + 2, which only the
    # resumed run can have logged (the interrupted one may have logged step + 1 past its checkpoint).
    resumed = [*command[:-1], "--config.trainer.save_every_minutes=0", command[-1]]
    status, stderr = signalled(tmp_path, resumed, signal.SIGTERM, [
        (lambda: max(logged_steps(out), default=0) > step + 1, "no two steps after the resume in 10 minutes", 600)])
    assert status == 143, stderr[-3000:]
    assert "Traceback" not in stderr and f"resumed from step {step} in {out}" in (tmp_path / "stdout").read_text()
    line = the_line(stderr, "resume with: ")
    found = re.match(r"terminated \(SIGTERM\) after step (\d+): the last checkpoint is step (\d+) in ", line)
    assert found and found[1] == found[2], line
    last = int(found[1])
    assert [s for s in saved(out) if s > step] == [last] and last > step
    # Steps the interrupted run logged past its checkpoint were dropped, then trained again once;
    # nothing logged is unsaved.
    assert logged_steps(out) == list(range(1, last + 1))
    assert line.endswith("--config.trainer.resume=True")


def test_sigterm_during_the_format_warm_up_ends_it_between_steps(tmp_path):
    """Preemption gives seconds, not the minutes a warm-up and the first validation take: SIGTERM
    before the first training step ends the run at the next warm-up step, with nothing to save."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "experiments.run", *long_run({"actor.format_warmup_steps": "100000"}),
            f"--config.trainer.output_dir={out}"]
    status, stderr = signalled(tmp_path, args, signal.SIGTERM, [
        (lambda: "nll=" in (tmp_path / "stderr").read_text(), "no warm-up step in 10 minutes", 600)])
    assert status == 143 and "Traceback" not in stderr, stderr[-3000:]
    line = the_line(stderr, "terminated (SIGTERM)")
    assert line.startswith("terminated (SIGTERM) before training started: no checkpoint was saved"), line
    assert saved(out) == [] and not (out / "metrics.jsonl").exists()


def test_ctrl_c_while_the_model_loads_is_one_line(tmp_path):
    """Before training starts (here: while the bundled SmolLM2's weights load, seconds after the
    plan's memory line) Ctrl-C is the same one line, status 130, and the command to start again:
    this run wrote nothing, so it is the command as typed. (The quick start with LoRA: the real
    weights in the least memory, ~2.5 GiB planned.)"""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "experiments.run", "--config", "configs/quickstart.py", "--config.lora.rank=2",
            f"--config.trainer.output_dir={out}"]
    # Ctrl-C as a terminal delivers it: a test runner started in the background (CI) passes SIGINT on
    # ignored, and Python keeps an ignored SIGINT ignored until the run sets its own handler.
    status, stderr = signalled(tmp_path, args, signal.SIGINT, [
        (lambda: "host memory:" in (tmp_path / "stderr").read_text(), "no plan in 10 minutes", 600)], poll=0.05,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert status == 130 and "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    line = the_line(stderr, "interrupted (SIGINT)")
    assert line.startswith("interrupted (SIGINT) before training started: no checkpoint was saved"), line
    command = shlex.split(line.split("start again with: ", 1)[1])
    assert command[3:] == args[3:] and not out.exists()


# The run as a launcher imports it, its second batch failing as XLA fails an allocation it cannot
# have: the error as jax raises it, at a known step, in a run of any size.
OUT_OF_MEMORY = """
import sys
import jax
from experiments import run
sampled = []
sample_now = run.batches.sample_now
def second_fails(*args, **kwargs):
    sampled.append(1)
    if len(sampled) == 2:
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes.")
    return sample_now(*args, **kwargs)
run.batches.sample_now = second_fails
sys.exit(run.run())
"""


def test_out_of_memory_is_one_line_naming_the_checkpoint_and_the_settings(tmp_path):
    out = tmp_path / "run"
    args = [sys.executable, "-c", OUT_OF_MEMORY, *long_run({"trainer.save_freq": "1"}), f"--config.trainer.output_dir={out}"]
    done = subprocess.run(args, cwd=REPO, capture_output=True, text=True, env=command_env(), timeout=900)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr[-3000:]
    line = the_line(done.stderr, "out of memory")
    assert line.startswith("out of memory (RESOURCE_EXHAUSTED: Out of memory allocating 123 bytes.): lower "
                           "actor.micro_batch_size or rollout.max_model_len"), line
    assert f"after step 1: the last checkpoint is step 1 in {out / 'checkpoints'}; resume with: " in line
    assert saved(out) == [1]
