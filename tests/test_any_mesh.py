"""Resume on any mesh: a checkpoint written by a run on 2 devices (FSDP) restores on 1 device and on
a data-parallel mesh and continues with the same results up to float rounding; two processes train
like one process over two devices, and checkpoints move between them both ways; the ``distributed``
config is checked before anything starts (tests/test_distributed.py: before the backend starts)."""

import shutil

import pytest

from helpers import REPO, TINY, command_env, read_metrics, run, tiny_with, train_lines


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Two steps on a 1 × 2 × 1 mesh (weights and Adam moments split over fsdp), saved after each,
    validated at steps 0 and 2, the policy exported from its sharded weights."""
    out = tmp_path_factory.mktemp("fsdp")
    run(f"--config.trainer.output_dir={out}", "--config.mesh.data=1", "--config.mesh.fsdp=-1", devices=2)
    return out


def _resume_from_step_1(fsdp_run, out, *args, devices):
    shutil.copytree(fsdp_run, out)
    shutil.rmtree(out / "checkpoints" / "2")  # the latest checkpoint is now step 1's
    run(f"--config.trainer.output_dir={out}", "--config.trainer.resume=True", "--config.trainer.test_freq=0",
        "--config.trainer.export_hf=False", *args, devices=devices)
    full, resumed = train_lines(read_metrics(fsdp_run)), train_lines(read_metrics(out))
    assert [r["step"] for r in resumed] == [1, 2]
    # The same float32 math on another mesh adds partial sums in another order: a few ulps per sum,
    # far below 1e-4 relative (see tests/test_sharding.py).
    for key in ("train/reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "train/response_length",
                "rollout/old_log_prob"):
        assert resumed[1][key] == pytest.approx(full[1][key], rel=1e-4, abs=1e-5), key


def test_fsdp_checkpoint_resumes_on_one_device(fsdp_run, tmp_path):
    assert [r["step"] for r in read_metrics(fsdp_run) if "val-env/FrozenLake/success" in r] == [0, 2]
    assert (fsdp_run / "hf_policy" / "model.safetensors").exists()
    _resume_from_step_1(fsdp_run, tmp_path / "one", devices=1)


@pytest.mark.slow  # another 2-device run (~1-2 min); the test above covers restoring across meshes
def test_fsdp_checkpoint_resumes_data_parallel(fsdp_run, tmp_path):
    _resume_from_step_1(fsdp_run, tmp_path / "data", "--config.mesh.data=-1", "--config.mesh.fsdp=1", devices=2)


@pytest.mark.slow  # another 2-device run (~1-2 min); the tensor-parallel layout splits what FSDP keeps whole
def test_fsdp_checkpoint_resumes_tensor_parallel(fsdp_run, tmp_path):
    """Heads, MLP features and the vocabulary split over ``model``, the embedding dimension whole:
    every weight's slices are read into a layout other than the one that wrote them."""
    _resume_from_step_1(fsdp_run, tmp_path / "model", "--config.mesh.data=1", "--config.mesh.fsdp=1",
                        "--config.mesh.model=-1", devices=2)


def test_distributed_config_errors(tmp_path):
    proc = run(f"--config.trainer.output_dir={tmp_path}", "--config.distributed.coordinator_address=localhost:1234",
               check=False)
    assert proc.returncode == 2
    assert "distributed.num_processes" in proc.stderr.strip().splitlines()[-1]


def _two_processes(out, port: int, *args, flags=TINY):
    """A run (``flags``: the tiny run's) as two processes of one CPU device each (localhost
    coordinator, gloo collectives); ``args`` are further flags for both."""
    import subprocess
    import sys

    env = command_env(devices=1)
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "experiments.run", *flags, f"--config.trainer.output_dir={out}",
             f"--config.distributed.coordinator_address=localhost:{port}",
             "--config.distributed.num_processes=2", f"--config.distributed.process_id={i}", *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        for i in range(2)
    ]
    outputs = [p.communicate(timeout=1500) for p in procs]
    for p, (_, err) in zip(procs, outputs):
        assert p.returncode == 0, err[-4000:]
    return [out + err for out, err in outputs]


# The two processes' float32 sums run over gloo instead of within one process's program: partial sums
# added in another order, a few ulps each, far below 1e-4 relative (see tests/test_sharding.py).
METRICS = ("train/reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "train/response_length")


# The cheapest run that still trains, validates, checkpoints and exports: one step of one-turn Bandit.
ONE_BANDIT_STEP = tiny_with({"envs.train.tags": "('Bandit',)", "envs.train.n_groups": "(2,)",
                             "envs.val.tags": "('Bandit',)", "rollout.max_turn": "1",
                             "trainer.total_steps": "1", "trainer.test_freq": "1"})


def test_two_processes_train_validate_checkpoint_and_export(tmp_path):
    """The many-host launch in its cheapest form, in the default suite: both processes start (the
    runtime joined before anything touches a device), pick the same update layout, and process 0
    alone writes the logs and the export."""
    logs = _two_processes(tmp_path, 23463, flags=ONE_BANDIT_STEP)
    assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 1]  # validation, step 1, validation: once each
    assert "[process 1/2] train" in logs[1] and "validation @" not in logs[1]
    assert (tmp_path / "checkpoints" / "1").is_dir() and (tmp_path / "hf_policy" / "model.safetensors").exists()
    assert len((tmp_path / "train" / "step_1.jsonl").read_text().splitlines()) == 1  # log_trajectories=1


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The reference: one process, data parallel over its 2 devices, checkpointed after each step."""
    out = tmp_path_factory.mktemp("one")
    run(f"--config.trainer.output_dir={out}", devices=2)
    return out


@pytest.mark.slow  # two processes, the reference run and a resume: ~6 min on 2 cores
def test_two_processes_train_like_one_process_over_two_devices(one_process, tmp_path):
    logs = _two_processes(tmp_path / "two", 23461)
    two, one = read_metrics(tmp_path / "two"), read_metrics(one_process)
    assert [r["step"] for r in two] == [r["step"] for r in one]  # one set of logs, not two
    for a, b in zip(train_lines(two), train_lines(one)):
        for key in METRICS:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key
    assert "[process 1/2] train" in logs[1] and "validation @" not in logs[1]  # progress named; process 0 logs
    assert (tmp_path / "two" / "hf_policy" / "model.safetensors").exists()
    # The checkpoint the two processes wrote (step 2) restores in a single process on one device.
    proc = run(f"--config.trainer.output_dir={tmp_path / 'two'}", "--config.trainer.resume=True",
               "--config.trainer.total_steps=3", "--config.trainer.test_freq=0", devices=1)
    assert "resumed from step 2" in proc.stdout + proc.stderr


@pytest.mark.slow  # two processes resuming for one step (~2-3 min on 2 cores) after the reference run above
def test_one_process_checkpoint_resumes_in_two_processes(one_process, tmp_path):
    """The reverse: the single process's step-1 checkpoint, restored by two processes (each reads its
    half of the global arrays), continues to step 2 as the single process itself did."""
    out = tmp_path / "resumed"
    shutil.copytree(one_process, out)
    shutil.rmtree(out / "checkpoints" / "2")  # the latest checkpoint is now step 1's
    logs = _two_processes(out, 23462, "--config.trainer.resume=True", "--config.trainer.test_freq=0",
                          "--config.trainer.export_hf=False")
    assert "resumed from step 1" in logs[0]
    resumed, one = train_lines(read_metrics(out)), train_lines(read_metrics(one_process))
    assert [r["step"] for r in resumed] == [1, 2]
    for key in (*METRICS, "rollout/old_log_prob"):
        assert resumed[1][key] == pytest.approx(one[1][key], rel=1e-4, abs=1e-5), key
