"""How many sweep settings train at a time: XLA's memory estimate of the compiled step decides."""

import types

import jax
import jax.numpy as jnp
import pytest

from experiments import sweep

GIB = 2**30


def fake_compile(per_setting: float, shared: float = 0.0):
    """compile_for(size) whose program needs ``shared + size * per_setting`` GiB; records sizes."""
    sizes = []

    def compile_for(size):
        sizes.append(size)
        need = int((shared + size * per_setting) * GIB)
        return types.SimpleNamespace(need=need)

    return compile_for, sizes


def test_all_settings_at_once_when_they_fit():
    compile_for, sizes = fake_compile(per_setting=2.0)
    size, _ = sweep.fit_in_memory(compile_for, 4, free=16 * GIB)  # 8 GiB needed, 12.8 allowed
    assert size == 4 and sizes == [4]


def test_as_many_as_fit_then_group_after_group():
    # the README's quick-start sweep on a 24 GB machine with 15 GiB free: ~5.9 GiB per setting
    compile_for, sizes = fake_compile(per_setting=5.9)
    size, _ = sweep.fit_in_memory(compile_for, 4, free=15 * GIB)
    assert size == 2 and sizes == [4, 2]


def test_refuses_in_one_sentence_when_one_setting_does_not_fit():
    compile_for, _ = fake_compile(per_setting=3.0, shared=10.0)
    with pytest.raises(MemoryError, match=r"One sweep setting needs about 13.0 GiB .* reduce envs.train.n_groups"):
        sweep.fit_in_memory(compile_for, 2, free=12 * GIB)


def test_program_bytes_counts_donated_outputs_once():
    x = jax.ShapeDtypeStruct((1024, 256), jnp.float32)  # 1 MiB
    donated = jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile()
    kept = jax.jit(lambda a: a * 2).lower(x).compile()
    assert sweep.program_bytes(kept) >= 2 * 2**20
    assert 2**20 <= sweep.program_bytes(donated) < sweep.program_bytes(kept)


def test_an_earlier_sweep_log_is_kept_unless_overwrite(tmp_path):
    from starpo_jax.experiment import ConfigError

    sweep.check_sweep_log(tmp_path, overwrite=False)  # an empty folder is fine
    (tmp_path / "sweep.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(ConfigError, match="earlier sweep.*trainer.overwrite=True"):
        sweep.check_sweep_log(tmp_path, overwrite=False)
    sweep.check_sweep_log(tmp_path, overwrite=True)
    assert (tmp_path / "sweep.jsonl").read_text() == '{"step": 1}\n'  # the check itself deletes nothing
