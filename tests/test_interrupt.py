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

from helpers import REPO, TINY_MODEL_FLAGS, command_env, config_flags, read_metrics, train_lines

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
    """Start ``args`` (stderr to ``tmp_path / "stderr"``), wait for each ``(ready, late, seconds)`` of
    ``waits`` in turn (``wait_until``), send ``sig``; the process's exit status and stderr."""
    with open(tmp_path / "stderr", "w") as stderr:
        proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr, env=command_env(), **popen)
        try:
            for ready, late, seconds in waits:
                wait_until(proc, ready, late, seconds, tmp_path / "stderr", poll)
            proc.send_signal(sig)
            status = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return status, (tmp_path / "stderr").read_text()


def stopped(tmp_path, sig, overrides: dict, until_saved: bool) -> tuple[int, str]:
    """Start a long tiny run into ``tmp_path / "run"``, send ``sig`` once it has logged a training
    step (and, ``until_saved``, written a checkpoint); its exit status and stderr."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "experiments.run", *long_run(overrides), f"--config.trainer.output_dir={out}"]
    metrics = out / "metrics.jsonl"
    waits = [(lambda: metrics.exists() and "train/reward/mean" in metrics.read_text(),
              "no training step logged in 10 minutes", 600)]
    if until_saved:  # steps take seconds
        waits.append((lambda: saved(out), "no checkpoint a minute after the first step", 60))
    return signalled(tmp_path, args, sig, waits)


def the_line(stderr: str, marker: str) -> str:
    lines = [line for line in stderr.splitlines() if marker in line]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def test_ctrl_c_stops_at_once_with_one_line_whose_command_resumes(tmp_path):
    out = tmp_path / "run"
    # Saved by time alone (every step takes longer than 6 ms), not by steps.
    status, stderr = stopped(tmp_path, signal.SIGINT, {"trainer.save_freq": "-1",
                                                        "trainer.save_every_minutes": "0.0001"}, until_saved=True)
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
    resumed = subprocess.run([*command, "--max_steps=1"], cwd=REPO, capture_output=True, text=True, timeout=600,
                             env=command_env())
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {step} in {out}" in resumed.stdout
    # Steps the interrupted run logged past its checkpoint are dropped, then trained again once.
    assert [r["step"] for r in train_lines(read_metrics(out))] == list(range(1, step + 2))


def test_sigterm_saves_the_step_it_finishes_and_stops(tmp_path):
    out = tmp_path / "run"
    # No schedule would save before step 1000: only SIGTERM does.
    status, stderr = stopped(tmp_path, signal.SIGTERM, {"trainer.save_freq": "-1", "trainer.save_every_minutes": "0"},
                             until_saved=False)
    assert status == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    line = the_line(stderr, "resume with: ")
    found = re.match(r"terminated \(SIGTERM\) after step (\d+): the last checkpoint is step (\d+) in ", line)
    assert found and found[1] == found[2], line
    step = int(found[1])
    assert saved(out) == [step] and step >= 1
    assert [r["step"] for r in train_lines(read_metrics(out))] == list(range(1, step + 1))  # nothing unsaved
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
