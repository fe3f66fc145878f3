"""Resume on any mesh: a checkpoint written by a run on 2 devices (FSDP) restores on 1 device and on
a data-parallel mesh and continues with the same results up to float rounding; the ``distributed``
config is checked before anything starts."""

import shutil

import pytest

from test_run import read_metrics, run, train_lines


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Two steps on a 1 × 2 × 1 mesh (weights and Adam moments split over fsdp), saved after each."""
    out = tmp_path_factory.mktemp("fsdp")
    run(f"--config.trainer.output_dir={out}", "--config.mesh.data=1", "--config.mesh.fsdp=-1",
        "--config.trainer.test_freq=0", "--config.trainer.export_hf=False", devices=2)
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
    _resume_from_step_1(fsdp_run, tmp_path / "one", devices=1)


@pytest.mark.slow  # another 2-device run (~1-2 min); the test above covers restoring across meshes
def test_fsdp_checkpoint_resumes_data_parallel(fsdp_run, tmp_path):
    _resume_from_step_1(fsdp_run, tmp_path / "data", "--config.mesh.data=-1", "--config.mesh.fsdp=1", devices=2)


def test_distributed_config_errors(tmp_path):
    proc = run(f"--config.trainer.output_dir={tmp_path}", "--config.distributed.coordinator_address=localhost:1234",
               check=False)
    assert proc.returncode == 2
    assert "distributed.num_processes" in proc.stderr.strip().splitlines()[-1]
