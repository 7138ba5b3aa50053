"""Tests run offline on the CPU: no hub access, no accelerator, and never in the user's target
cache (`load_target` caches converted targets; the session gets a private cache directory)."""

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


@pytest.fixture(autouse=True, scope="session")
def _private_target_cache():
    with (
        tempfile.TemporaryDirectory(prefix="dflash_jax_cache_") as cache,
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setenv("DFLASH_JAX_CACHE", cache)
        yield
