import os

# Tests run on CPU with deterministic float32 math; keep XLA from grabbing every core per process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import pytest

from starpo_jax import bundled


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return bundled.qwen_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return bundled.smollm2_tokenizer()
