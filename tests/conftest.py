"""Tests run offline on the CPU: no hub access, no accelerator, and never in the user's target
cache (`load_target` caches converted targets; the session gets a private cache directory)."""

import os
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for every test process of a run (the xdist workers, the
# CLIs the tests start, and CI's later pytest steps, which .ci/run points at one directory):
# a program compiled once loads elsewhere. JAX reads these before its first compile; its key
# holds the program, the compile options and the jax/jaxlib build.
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "dflash_jax_test_xla")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")


@pytest.fixture(autouse=True, scope="session")
def _private_target_cache():
    with (
        tempfile.TemporaryDirectory(prefix="dflash_jax_cache_") as cache,
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setenv("DFLASH_JAX_CACHE", cache)
        yield
