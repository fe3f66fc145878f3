import os

# Tests run on CPU with deterministic float32 math; keep XLA from grabbing every core per process.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import pytest
import torch

# torch is only the parity oracle; one thread keeps it from fighting JAX for the two CI cores
# (measured: 16x slower reference generate with 2 threads under load).
torch.set_num_threads(1)

from starpo_jax import bundled


@pytest.fixture(scope="session")
def qwen_tokenizer():
    return bundled.qwen_tokenizer()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    return bundled.smollm2_tokenizer()
