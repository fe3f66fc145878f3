"""``python -m experiments.run`` end to end on a tiny random model: logs, validation dumps, checkpoints,
exact resume, the exported Hugging Face folder, and clear errors for bad config and checkpoints."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import (
    FULL_RUN,
    REPO,
    TINY,
    assert_bandit_suite,
    command_env,
    evaluate,
    read_metrics,
    run,
    script_module,
    tensorboard_scalars,
    train_lines,
)
from starpo_jax.runtime import allocator


def test_outputs(full_run):
    rows = read_metrics(full_run)
    train = train_lines(rows)
    assert [r["step"] for r in train] == [1, 2]
    for key in ("train/SimpleSokoban/success", "train/FrozenLake/success", "train/Bandit/pass@2", "rollout/in_group_std", "actor/entropy_loss",
                "actor/grad_norm", "critic/vf_loss", "critic/vf_explained_var", "actor/pg_clipfrac",
                "actor/ppo_kl", "train/response_length", "timing_s/gen", "timing_s/update",
                "perf/generated_tokens_per_s", "perf/env_steps_per_s", "perf/host_peak_gib"):
        assert key in train[0], key
    val = [r for r in rows if "val-env/FrozenLake/success" in r]
    assert [r["step"] for r in val] == [0, 2]
    # Template collapse at every validation: two distinct boards, so chance is 1/2 and MI <= log 2.
    for r in val:
        assert r["val-env/FrozenLake/retrieval_chance"] == 0.5 and r["val-env/FrozenLake/retrieval_acc"] in (0, 0.5, 1)
        assert abs(r["val-env/FrozenLake/mi"]) <= math.log(2) + 1e-6 and "timing_s/val-env_mi" in r
    dump = [json.loads(line) for line in (full_run / "val" / "step_2.jsonl").read_text().splitlines()]
    assert len(dump) == 2 and dump[0]["turns"] and {"observation", "think", "answer", "actions", "reward"} <= set(dump[0]["turns"][0])
    assert "State:" in dump[0]["turns"][0]["observation"]
    # trainer.log_trajectories (1 here) training trajectories of every step, as the validation's.
    for step in (1, 2):
        [record] = [json.loads(line) for line in (full_run / "train" / f"step_{step}.jsonl").read_text().splitlines()]
        assert record["turns"] and record["tag"] == "SimpleSokoban" and "response" in record["turns"][0]
    # The logged validation metrics are those of the dumped trajectories.
    mean = lambda field: sum(d[field] for d in dump) / len(dump)  # noqa: E731
    assert val[1]["val-env/FrozenLake/success"] == mean("success")  # exact: 0, 1/2 or 1
    assert val[1]["val-env/FrozenLake/num_actions"] == mean("num_actions")  # exact: a whole count over 2
    assert val[1]["val-env/reward/mean"] == pytest.approx(mean("env_reward") + mean("format_penalty_sum"), abs=1e-6)
    assert "train/Bandit/pass@2" in tensorboard_scalars(full_run)  # verbatim, as in metrics.jsonl
    assert (full_run / "hf_policy" / "config.json").exists() and (full_run / "hf_policy" / "model.safetensors").exists()
    # Its bars written to a file (not a terminal): the validation inside the training bar leaves no
    # cursor-up codes in the log.
    log = (full_run / "stderr.txt").read_text()
    assert "validation @ step 2" in log and "\x1b[A" not in log
    # Restarted on tcmalloc where it is installed, with its heap limited, which the plan's line says.
    [plan] = [line for line in log.splitlines() if line.startswith("host memory: about ")]
    assert (f"; tcmalloc's heap limit {allocator.HEAP_LIMIT}=" in plan) == (allocator.library() is not None), plan


def test_resume_reproduces_the_uninterrupted_run(full_run, tmp_path):
    # An earlier run's files in the folder: overwrite=True must delete them (else resume picks step 5),
    # its report and curves too, and say so in one line; a file of no run stays.
    (tmp_path / "checkpoints" / "5").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text('{"step": 5}\n')
    for name in ("report.html", "curves.png", "curves.json", "notes.txt"):
        (tmp_path / name).write_text("earlier")
    proc = run(*FULL_RUN, f"--config.trainer.output_dir={tmp_path}", "--max_steps=1", "--config.trainer.overwrite=True")
    assert not (tmp_path / "checkpoints" / "5").exists()
    assert not any((tmp_path / name).exists() for name in ("report.html", "curves.png", "curves.json"))
    assert (tmp_path / "notes.txt").exists()
    [line] = [line for line in proc.stderr.splitlines() if line.startswith("overwrite: ")]
    assert line == f"overwrite: deleting the earlier run's metrics.jsonl, checkpoints/, report.html, curves.png, curves.json in {tmp_path}"
    # A killed run logged step 2 after its checkpoint at step 1: resume must not show step 2 twice.
    from tensorboardX import SummaryWriter

    with SummaryWriter(str(tmp_path / "tb")) as w:
        w.add_scalar("train/reward/mean", 123.0, 2)
    proc = run(*FULL_RUN, f"--config.trainer.output_dir={tmp_path}", "--config.trainer.resume=True",
               env={"JAX_DEBUG_LOG_MODULES": "jax._src.compiler"})
    # The validation rollout reads the restored state as the first process read the fresh one: the
    # program compiled then is found in the persistent cache (minutes of compiling at the paper's size).
    assert "Persistent compilation cache hit for 'jit_rollout'" in proc.stderr
    assert "CACHE MISS for 'jit_rollout'" not in proc.stderr
    full, resumed = train_lines(read_metrics(full_run)), train_lines(read_metrics(tmp_path))
    assert len(resumed) == 2
    # Exact: the resumed process compiles the same programs for the same shapes on the same machine
    # and feeds them the checkpointed state bit for bit, so nothing may differ (not even rounding).
    for a, b in zip(full, resumed):
        for key in ("train/reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "train/response_length"):
            assert a[key] == b[key], key
    shown = tensorboard_scalars(tmp_path)["train/reward/mean"]
    assert shown == [(r["step"], pytest.approx(r["train/reward/mean"])) for r in resumed]


def test_fresh_run_refuses_a_folder_holding_an_earlier_run(full_run):
    before = {p: p.read_bytes() for p in full_run.rglob("*") if p.is_file()}
    proc = run(f"--config.trainer.output_dir={full_run}", "--config.model.source=/no/model.gguf", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert str(full_run) in proc.stderr and "--config.trainer.resume=True" in proc.stderr
    assert "--config.trainer.overwrite=True" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert {p: p.read_bytes() for p in full_run.rglob("*") if p.is_file()} == before  # nothing touched


def test_resume_with_another_config_names_the_settings_and_changes_nothing(full_run, tmp_path):
    """A checkpoint of other arrays (here full fine-tuning, resumed with LoRA) is no damage: the
    error names the settings that differ from the run's config.json, and the folder stays as it was."""
    import shutil

    shutil.copytree(full_run / "checkpoints", tmp_path / "checkpoints")
    shutil.copy(full_run / "config.json", tmp_path / "config.json")
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = run(*FULL_RUN, f"--config.trainer.output_dir={tmp_path}", "--config.trainer.resume=True",
               "--config.lora.rank=2", check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith("error: Checkpoint step 2 ") and "other arrays than this run builds" in error
    assert "lora.rank 0 -> 2" in error and "damaged" not in error
    assert 'output_dir "' not in error  # the folder's own path differs from full_run's without mattering
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before  # config.json too


def truncate_every_step(checkpoints: Path) -> None:
    """Halve the largest file of every saved step's state: nothing intact to fall back to."""
    for step in checkpoints.iterdir():
        data = max((p for p in (step / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def error_lines(stderr: str) -> list[str]:
    """stderr without blank lines and progress bars."""
    return [line for line in stderr.splitlines() if line.strip() and "%|" not in line]


def test_resume_from_a_truncated_checkpoint_is_one_line(full_run, tmp_path):
    import shutil

    shutil.copytree(full_run / "checkpoints", tmp_path / "checkpoints")
    truncate_every_step(tmp_path / "checkpoints")
    proc = run(*FULL_RUN, f"--config.trainer.output_dir={tmp_path}", "--config.trainer.resume=True", check=False)
    assert proc.returncode == 2
    errors = error_lines(proc.stderr)
    assert errors[-1].startswith("error: Checkpoint step 1 ") and "No intact checkpoint" in errors[-1]
    assert "TensorStore" not in proc.stderr and "Traceback" not in proc.stderr and "Event loop" not in proc.stderr


def test_evaluate_of_a_truncated_checkpoint_is_one_line(full_run, tmp_path, capsys, monkeypatch):
    """Every saved step truncated: evaluate says so in one line, status 2, in words that fit it
    (not resuming's), before it loads the model."""
    import shutil

    from experiments import evaluate as evaluate_command

    run_dir = tmp_path / "run"
    shutil.copytree(full_run, run_dir)
    truncate_every_step(run_dir / "checkpoints")
    monkeypatch.setattr(evaluate_command, "load_policy", lambda config: pytest.fail("the model was loaded"))
    status, _, stderr = evaluated_here(capsys, "--model", str(run_dir), "--suite", "bandit", "--levels", "2")
    errors = error_lines(stderr)
    assert status == 2 and errors[-1].startswith("error: Checkpoint step ") and errors[-1].endswith(
        "No intact checkpoint is left."), stderr
    assert "resume" not in errors[-1] and "Traceback" not in stderr


def one_line_error(proc) -> str:
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    return lines[0]


def test_help_and_config_errors_come_first_in_one_line(tmp_path):
    """Errors that need no model are reported before it loads: a model source that does not exist
    is named in none of them. A failed start writes nothing."""
    env = command_env()
    for module in ("experiments.run", "experiments.sweep"):
        proc = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0 and "--config" in proc.stdout, module
    out = tmp_path / "out"
    no_model = ["--config.model.source=/no/model.gguf", f"--config.trainer.output_dir={out}"]
    line = one_line_error(run(*no_model, "--config.rollout.max_trun=3", check=False))
    assert "rollout.max_trun" in line and 'Did you mean "max_turn"' in line
    # Without --config the default config is read, with the overrides, as the flag is defined (at import).
    line = one_line_error(run(*no_model, "--config.foo.bar=1", check=False, tiny=False))
    assert "config.foo.bar" in line and "'foo' does not exist" in line
    # An unknown env, as the command says it; values of the wrong type and settings that do not fit
    # together are checked in the test's process (tests/test_configs.py).
    line = one_line_error(run(*no_model, "--config.envs.train.tags=('Sokobon',)", "--config.envs.train.n_groups=(2,)",
                              check=False))
    assert "Sokobon" in line and "Known envs" in line
    line = one_line_error(run(*no_model, "--config.trainer.resume=True", check=False))
    assert "No checkpoint" in line and "without --config.trainer.resume=True" in line
    assert not out.exists()  # no config.json, no empty checkpoints/
    # A run that stopped before its first checkpoint: resume names the ways on, not "without resume".
    stopped = tmp_path / "stopped"
    stopped.mkdir()
    (stopped / "metrics.jsonl").write_text('{"step": 1}\n')
    line = one_line_error(run("--config.model.source=/no/model.gguf", f"--config.trainer.output_dir={stopped}",
                              "--config.trainer.resume=True", check=False))
    assert "nothing to resume" in line and "--config.trainer.overwrite=True" in line
    assert "--config.trainer.output_dir" in line and "without" not in line


@pytest.mark.slow  # two 2-device runs, ~1.5 min on 2 cores; tests/test_any_mesh.py's FSDP run covers a 2-device run's validation, checkpoints and export, and restores them across meshes
def test_run_on_two_devices_checkpoints_and_resumes(tmp_path):
    """Data parallel over 2 simulated devices (mesh.data=-1 takes both): the sharded state is
    checkpointed, resumed and exported."""
    run(f"--config.trainer.output_dir={tmp_path}", "--config.trainer.test_freq=0", "--max_steps=1", devices=2)
    run(f"--config.trainer.output_dir={tmp_path}", "--config.trainer.resume=True", devices=2)  # validates at 2
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in train_lines(rows)] == [1, 2]
    assert [r["step"] for r in rows if "val-env/FrozenLake/success" in r] == [2]
    assert (tmp_path / "hf_policy" / "model.safetensors").exists()


def evaluated_here(capsys, *args) -> tuple[int | str | None, str, str]:
    """``experiments.evaluate``'s ``main`` in this process, for what it refuses before it plays a level
    (what ``python -m experiments.evaluate`` exits with, without starting an interpreter): (status,
    stdout, stderr)."""
    from experiments import evaluate as evaluate_command

    capsys.readouterr()  # what came before
    status: int | str | None
    try:
        status = evaluate_command.main(list(args))
    except SystemExit as exit:  # argparse's usage errors
        status = exit.code
    out, err = capsys.readouterr()
    return status, out, err


def test_bench_peer_scores_a_folder_on_the_configs_validation_levels(full_run):
    """bench_peer's ``evaluate_folder``: the evaluate command's scorer (``evaluate_tags``) with the
    config's validation tags, levels and temperature, on an exported Hugging Face folder (this
    module's tiny run, here so that one test process starts that run once)."""
    from configs import base
    from experiments.bench import peer as bench_peer

    config = base.saved_config(full_run / "config.json")
    success = bench_peer.evaluate_folder(config, full_run / "hf_policy", levels=2)
    assert set(success) == {"FrozenLake"} and success["FrozenLake"] in (0, 0.5, 1)  # a share of 2 levels


def test_random_valid_baseline_plays_the_runs_levels_without_its_weights(full_run, tmp_path):
    """--policy random-valid: the run's config and tokenizer, every answer valid and random, no
    checkpoint read (here the folder has none), results named apart from the policy's. A config.json
    written before a setting existed still reads (the setting takes its default)."""
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    saved = json.loads((full_run / "config.json").read_text())
    del saved["trainer"]["export_dtype"]
    (run_dir / "config.json").write_text(json.dumps(saved))
    proc = evaluate("--model", str(run_dir), "--suite", "frozen_lake", "--levels", "4", "--batch", "4",
                    "--response-length", "48", "--policy", "random-valid")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((run_dir / "evaluate_random-valid_frozen_lake_4levels.json").read_text())
    result = report["results"]["FrozenLake"]
    assert report["policy"] == "random-valid" and result["action_is_valid"] == 1.0 and result["num_actions"] >= 1
    short = evaluate("--model", str(run_dir), "--suite", "frozen_lake", "--levels", "4", "--policy", "random-valid")
    assert short.returncode == 2 and "raise rollout.response_length" in short.stderr  # the run's 6 tokens


def test_validation_and_evaluate_play_the_fixed_levels_alike(full_run, tmp_path, monkeypatch):
    """One evaluation on fixed levels (``diagnostics.fixed_levels``) for the run and the evaluate
    command: greedy, where the sampling keys do not matter, evaluating a run folder plays its last
    validation again, level by level, on the config's levels (from ``envs.val.seed``) and at its
    temperature, both in two calls (``helpers.FULL_RUN``: the session's run validates so)."""
    from experiments import evaluate as evaluate_command
    from starpo_jax.diagnostics import dumps, fixed_levels

    played, tokenizers = [], []
    tag_levels, evaluate_levels = evaluate_command.tag_levels, fixed_levels.evaluate_levels

    def recorded_levels(config, tag, levels, batch, tokenizer, *args):
        tokenizers.append(tokenizer)
        return tag_levels(config, tag, levels, batch, tokenizer, *args)

    def recorded_results(levels, *args, **kwargs):
        played.append((levels.plan, evaluate_levels(levels, *args, **kwargs)))
        return played[-1][1]

    monkeypatch.setattr(evaluate_command, "tag_levels", recorded_levels)
    monkeypatch.setattr(fixed_levels, "evaluate_levels", recorded_results)
    out = tmp_path / "eval.json"  # not beside the model: the session's run folder is read, never changed
    assert evaluate_command.main(["--model", str(full_run), "--suite", "frozen_lake", "--levels", "2", "--batch", "1",
                                  "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["temperature"] == 0 and report["first_seed"] == 200
    # The same trajectories as the validation's dump: the levels' boards, the answers, the outcomes.
    [(plan, result)], [tokenizer] = played, tokenizers
    records = json.loads(json.dumps(dumps.trajectory_records(result.traj, plan, tokenizer, 200)))
    assert records == [json.loads(line) for line in (full_run / "val" / "step_2.jsonl").read_text().splitlines()]
    [val] = [r for r in read_metrics(full_run) if "val-env/FrozenLake/success" in r and r["step"] == 2]
    scored = report["results"]["FrozenLake"]
    for field in ("success", "num_actions", "action_is_effective", "action_is_valid"):
        assert scored[field] == val[f"val-env/FrozenLake/{field}"], field
    assert scored["reward"] == val["val-env/reward/mean"] and scored["response_length"] == val["val-env/response_length"]


def test_bench_turn_times_the_validation_rollout_that_evaluate_plays(full_run, tmp_path):
    """``experiments/bench/turn.py --policy``: one side plays the run's validation levels in one
    batch from key 0, as the evaluate command does with ``--batch`` equal to ``--levels``: the same
    program, so the same outcome exactly; every timed call samples the same tokens (the side checks)."""
    from experiments import evaluate as evaluate_command

    turn = script_module(REPO / "experiments" / "bench" / "turn.py")
    record = turn.main(["--policy", str(full_run), "--levels", "2", "--repeats", "2", "--side", str(REPO)])
    out = tmp_path / "eval.json"
    assert evaluate_command.main(["--model", str(full_run), "--suite", "frozen_lake", "--levels", "2", "--batch", "2",
                                  "--out", str(out)]) == 0
    scored = json.loads(out.read_text())["results"]["FrozenLake"]
    assert record["env"] == "FrozenLake" and record["success"] == scored["success"]
    assert len(record["rollout_s"]) == 2 and min(record["rollout_s"]) > 0 and record["compile_s"] > 0
    playing = record["rows_playing_per_turn"]
    assert len(playing) == 2 and playing[0] == 2 and playing[1] <= playing[0]  # TINY's 2 turns, 2 levels
    assert record["response_tokens"] == 2 * scored["response_length"]  # the mean over the 2 levels


@pytest.mark.slow  # the real 135M model, ~35 s; tests/test_readme.py checks the Bandit suite's results on the quick start's folder, tests/envs/test_countdown.py evaluates the bundled model
def test_evaluate_the_bundled_model_on_bandit(tmp_path):
    out = tmp_path / "eval.json"
    proc = evaluate("--model", "smollm2-135m-instruct", "--suite", "bandit", "--levels", "2", "--batch", "2",
                    "--max-turn", "1", "--response-length", "24", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())["results"]
    assert_bandit_suite(results, levels=2)


def test_evaluate_writes_beside_the_model_and_says_when_it_replaces(tmp_path):
    from experiments.evaluate import default_out, out_note

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    (run_dir / "config.json").write_text("{}")
    assert default_out(str(run_dir), "bandit", 256) == run_dir / "evaluate_bandit_256levels.json"
    assert default_out(str(run_dir), "bandit", 16) != default_out(str(run_dir), "bandit", 256)  # both kept
    assert default_out("Qwen/Qwen2.5-0.5B-Instruct", "guess_digit:GuessDigit", 4) == Path(
        "bench_results/evaluate_Qwen_Qwen2.5-0.5B-Instruct_guess_digit_GuessDigit_4levels.json")
    out = run_dir / "evaluate_bandit_256levels.json"
    assert out_note(out) == f"results go to {out}"
    out.write_text("{}")
    assert out_note(out) == f"results go to {out} (replacing the earlier evaluation there)"


def test_evaluate_errors(full_run, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # where the relative path below is looked up, as the command's own folder
    status, stdout, stderr = evaluated_here(capsys, "--model", str(full_run), "--suite", "chess",
                                            "--out", str(tmp_path / "eval.json"))
    # Where the results go is said once the inputs are checked, not before (an error says nothing else).
    assert status == 2 and "Unknown suite 'chess'" in stderr and "results go to" not in stdout
    status, _, stderr = evaluated_here(capsys, "--model", "/nonexistent/model.gguf", "--suite", "bandit")
    assert status == 2 and "/nonexistent/model.gguf" in stderr
    # a folder's path, not a hub id
    status, _, stderr = evaluated_here(capsys, "--model", "tests/nonexistent", "--suite", "bandit")
    assert status == 2 and "No checkpoint folder or GGUF file exists at tests/nonexistent" in stderr


def test_evaluate_refuses_bad_input_before_the_model_loads(tmp_path, capsys):
    """Counts below 1, a run folder without a saved step or with a damaged config.json: one line,
    status 2, before the model (here one that does not exist) is looked for."""
    from configs import base

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    config = base.with_overrides(base.get_config(), {"model.source": str(tmp_path / "no-model")})
    (run_dir / "config.json").write_text(config.to_json())
    for args, message in ((["--levels", "0"], "--levels must be at least 1, not 0."),
                          (["--batch", "0"], "--batch must be at least 1, not 0."),
                          ([], f"{run_dir / 'checkpoints'} holds no saved step")):
        status, _, stderr = evaluated_here(capsys, "--model", str(run_dir), "--suite", "bandit", *args)
        assert status == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, stderr
    (run_dir / "config.json").write_text('{"model": ')
    status, _, stderr = evaluated_here(capsys, "--model", str(run_dir), "--suite", "bandit")
    assert status == 2 and f"{run_dir / 'config.json'} is not a run's config: it is not valid JSON" in stderr


def test_a_sweep_of_a_setting_that_changes_the_programs_is_refused():
    """(The README's sweep command is run and its grid checked in tests/test_readme.py.)"""
    bad = subprocess.run([sys.executable, "-m", "experiments.sweep", *TINY, "--sweep", "rollout.max_turn=1,2"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=command_env())
    assert bad.returncode == 2 and "cannot be swept" in bad.stderr


def assert_evaluated(proc, out: Path) -> None:
    """``experiments.evaluate --suite FrozenLake --levels 2 --no-think --out OUT``'s report and printout."""
    report = json.loads(out.read_text())
    assert report["enable_think"] is False
    result = report["results"]["FrozenLake"]
    assert set(report["results"]) == {"FrozenLake"} and result["levels"] == 2
    assert "FrozenLake" in proc.stdout and "success %" in proc.stdout and "95 % interval" in proc.stdout
    low, high = result["success_interval"]  # Wilson's for 0, 1 or 2 successes of 2
    assert 0 <= low <= result["success"] <= high <= 1 and high - low > 0.5
    # Where the results go is said once the inputs are checked, not before.
    assert proc.stdout.index(f"results go to {out}") < proc.stdout.index("success %")


# The LoRA run: two steps of the tiny run's envs in a context that holds two turns of FrozenLake
# (~350-365 tokens) but not of Sokoban (~390-400) or of a Bandit whose first answer named no arm, so
# their trajectories end after one turn.
LORA_MAX_LEN = 380
LORA_RUN = ("--config.lora.rank=2", "--config.trainer.test_freq=0", "--config.algorithm.adv_estimator=bilevel_gae",
            f"--config.rollout.max_model_len={LORA_MAX_LEN}")


def test_lora_run_exports_adapters_evaluates_and_says_once_that_turns_were_cut(tmp_path):
    out = tmp_path / "lora"
    # Multi-turn FrozenLake trajectories (and Sokoban's, cut) also take bi-level GAE end to end here.
    proc = run(f"--config.trainer.output_dir={out}", *LORA_RUN)
    train = train_lines(read_metrics(out))
    assert len(train) == 2 and train[0]["actor/lr"] == pytest.approx(1e-5)  # lora.actor_lr, not actor.lr
    # GAE advantages are whitened over the response tokens: their mean there is 0, up to float32
    # rounding over a few hundred unit-scale values (a NaN or unwhitened advantages fail).
    assert train[0]["critic/vf_loss"] > 0 and abs(train[0]["critic/advantages/mean"]) < 1e-4
    adapter = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert adapter["r"] == 2 and (out / "lora_adapter" / "adapter_model.safetensors").exists()
    # random base weights resolve nowhere else: exported beside the adapters, which name its path
    assert adapter["base_model_name_or_path"] == str(out / "base_model")
    assert (out / "base_model" / "config.json").is_file() and (out / "base_model" / "model.safetensors").is_file()
    assert (out / "hf_policy" / "model.safetensors").exists()  # the merged policy
    # A context too short for rollout.max_turn ends trajectories early: the run says so in one line
    # naming how many and the key to raise, once however many steps cut them (both steps here).
    lines = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "ran out of context" in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert f"rollout.max_model_len = {LORA_MAX_LEN}" in lines[0] and "raise rollout.max_model_len" in lines[0]
    cut = [r["train/context_exhausted"] for r in train]
    assert cut[0] > 0 and cut[1] > 0 and lines[0].startswith(f"warning @ step 1: {round(cut[0] * 6)} of 6 trajectories")
    # Evaluating the run folder (its adapters merged into the base): the command's report and printout.
    evaluated = tmp_path / "eval.json"
    proc = evaluate("--model", str(out), "--suite", "FrozenLake", "--levels", "2", "--batch", "2", "--no-think",
                    "--out", str(evaluated))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_evaluated(proc, evaluated)
    bad = subprocess.run([sys.executable, "-m", "experiments.sweep", *TINY, "--config.lora.rank=2",
                          "--sweep", "actor.lr=0,1e-3"],
                         cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=command_env())
    assert bad.returncode == 2 and "sweep lora.actor_lr instead" in bad.stderr
