"""Resume on any mesh: a checkpoint written by a run on 2 devices (FSDP) restores on 1 device and on
a data-parallel mesh and continues with the same results up to float rounding; two processes train
like one process over two devices, and checkpoints move between them both ways; the ``distributed``
config is checked before anything starts (tests/test_distributed.py: before the backend starts)."""

import shutil

import pytest

from helpers import REPO, TINY, command_env, read_metrics, run, tiny_with, train_lines

# The cheapest run that still trains, validates, checkpoints and exports: one step of one-turn Bandit.
BANDIT = {"envs.train.tags": "('Bandit',)", "envs.train.n_groups": "(2,)", "envs.val.tags": "('Bandit',)",
          "rollout.max_turn": "1", "trainer.total_steps": "1", "trainer.test_freq": "1"}
ONE_BANDIT_STEP = tiny_with(BANDIT)
# Two such steps, validated at 0 and 2.
TWO_BANDIT_STEPS = tiny_with({**BANDIT, "trainer.total_steps": "2", "trainer.test_freq": "2"})


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Two Bandit steps on a 1 × 2 × 1 mesh (weights and Adam moments split over fsdp), saved after
    each, validated at steps 0 and 2, the policy exported from its sharded weights. (What a
    checkpoint holds does not depend on the envs: one-turn Bandit compiles the least.)"""
    out = tmp_path_factory.mktemp("fsdp")
    run(*TWO_BANDIT_STEPS, f"--config.trainer.output_dir={out}", "--config.mesh.data=1", "--config.mesh.fsdp=-1",
        tiny=False, devices=2)
    return out


def _resume_from_step_1(fsdp_run, out, *args, devices):
    shutil.copytree(fsdp_run, out)
    shutil.rmtree(out / "checkpoints" / "2")  # the latest checkpoint is now step 1's
    run(*TWO_BANDIT_STEPS, f"--config.trainer.output_dir={out}", "--config.trainer.resume=True",
        "--config.trainer.test_freq=0", "--config.trainer.export_hf=False", *args, tiny=False, devices=devices)
    full, resumed = train_lines(read_metrics(fsdp_run)), train_lines(read_metrics(out))
    assert [r["step"] for r in resumed] == [1, 2]
    # The same float32 math on another mesh adds partial sums in another order: a few ulps per sum,
    # far below 1e-4 relative (see tests/test_sharding.py).
    for key in ("train/reward/mean", "actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "train/response_length",
                "rollout/old_log_prob"):
        assert resumed[1][key] == pytest.approx(full[1][key], rel=1e-4, abs=1e-5), key


def test_fsdp_checkpoint_resumes_on_one_device(fsdp_run, tmp_path):
    assert [r["step"] for r in read_metrics(fsdp_run) if "val-env/Bandit/success" in r] == [0, 2]
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


# One step off with devices of its own (docs/scaling.md, "Rollout and update at once"): the last
# device samples, the others train.
SPLIT = ["--config.trainer.staleness=1", "--config.rollout.use_sampler_logprobs=True", "--config.mesh.rollout_devices=1"]
# Two Bandit steps, so that batch 2 samples while update 1 runs, each scored for template collapse by
# the weights that sampled it on the sampler's device (mi_freq=1), validated at 0 and 2 on the
# trainer's, checkpointed after each (step 1's with batch 2 in flight), exported.
SCORED_TWO_BANDIT_STEPS = [*TWO_BANDIT_STEPS, "--config.trainer.mi_freq=1"]


def _same_run(a, b) -> None:
    """The metrics of two runs equal bit for bit, but for their timings."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for x, y in zip(a, b):
        drop = lambda row: {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))}  # noqa: E731
        assert drop(x) == drop(y), (x["step"], {k for k in drop(x) if drop(x)[k] != drop(y).get(k)})


@pytest.fixture(scope="module")
def split_runs(tmp_path_factory):
    """The split in two processes of one device each (process 1's samples, process 0's trains) and
    in one process over two devices (device 1 samples, device 0 trains)."""
    two, one = tmp_path_factory.mktemp("split_two"), tmp_path_factory.mktemp("split_one")
    logs = _two_processes(two, 23464, *SPLIT, flags=SCORED_TWO_BANDIT_STEPS)
    # With the two processes' thread pool (each has one device): XLA:CPU splits a product's or a
    # reduction's work over its threads, so another pool size can sum in another order (a few ulps,
    # seen in step 2's gradient norms). No collective runs within a part, so no rendezvous can starve.
    processes_pool = command_env(devices=1)["PJRT_NPROC"]
    run(*SCORED_TWO_BANDIT_STEPS, *SPLIT, f"--config.trainer.output_dir={one}", tiny=False, devices=2,
        env={"PJRT_NPROC": processes_pool})
    return two, one, logs


def test_two_processes_split_into_sampler_and_trainer(tmp_path):
    """The split across processes in its cheapest form, in the default suite: process 1's device
    samples (and scores template collapse), process 0's trains, validates and exports; one set of
    logs, with a checkpoint the two processes write."""
    logs = _two_processes(tmp_path, 23466, *SPLIT, "--config.trainer.mi_freq=1", flags=ONE_BANDIT_STEP)
    assert "sampling on devices [" in logs[0] and "training on [0]" in logs[0]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [0, 1, 1] and "train/Bandit/mi" in rows[1]
    assert "[process 1/2] train" in logs[1] and "validation @" not in logs[1]
    assert (tmp_path / "checkpoints" / "1").is_dir() and (tmp_path / "hf_policy" / "model.safetensors").exists()


@pytest.mark.slow  # two 2-step runs: ~4.5 min on 2 cores
def test_split_across_two_processes_trains_like_the_split_in_one(split_runs):
    """The same programs on the same one-device meshes, and no reduction crosses processes: the
    weights and batches move between the processes (cross-host transfers) and the metrics,
    validation rows and exported weights reach process 0 as the bytes they are, so the metrics are
    the single process's bit for bit."""
    two, one, logs = split_runs
    assert "sampling on devices [" in logs[0] and "training on [0]" in logs[0]  # process 1's device samples
    _same_run(read_metrics(two), read_metrics(one))
    assert any("train/Bandit/mi" in r for r in read_metrics(two))  # scored on the sampler's device (process 1)
    assert "[process 1/2] train" in logs[1] and "validation @" not in logs[1]  # process 0 alone logs
    assert (two / "checkpoints" / "1" / "pending").is_dir()  # batch 2's weights, on process 1's device
    exported = [(out / "hf_policy" / "model.safetensors").read_bytes() for out in (two, one)]
    assert exported[0] == exported[1]


@pytest.mark.slow  # two processes resuming for one step (~2 min on 2 cores) after the runs above
def test_split_across_two_processes_resumes_the_batch_in_flight(split_runs, tmp_path):
    """Killed after step 1's checkpoint: the two processes restore the weights of batch 2, which
    was in flight on process 1's device, sample it there again, and continue exactly."""
    two, _, _ = split_runs
    out = tmp_path / "resumed"
    shutil.copytree(two, out)
    shutil.rmtree(out / "checkpoints" / "2")  # the latest checkpoint is now step 1's
    logs = _two_processes(out, 23465, *SPLIT, "--config.trainer.resume=True", flags=SCORED_TWO_BANDIT_STEPS)
    assert "resumed from step 1" in logs[0] and "holds no batch in flight" not in logs[0]
    _same_run(read_metrics(out), read_metrics(two))
