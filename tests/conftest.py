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
# Compile time is most of the suite; XLA:CPU's LLVM back end at -O0 compiles ~22% faster over a
# mix of the decode and training tests (measured 2026-12-07: 72.6 -> 56.3 s on 47 tests, cold
# caches). It changes the machine code only: XLA's HLO passes, buffer assignment (the memory
# tests) and the order of every floating-point operation (no fast-math; the bitwise tests) stay
# the same. Tests, and the CLIs they start, inherit it; runs outside the tests do not.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
    ).strip()


@pytest.fixture(autouse=True, scope="session")
def _private_target_cache():
    with (
        tempfile.TemporaryDirectory(prefix="dflash_jax_cache_") as cache,
        pytest.MonkeyPatch.context() as mp,
    ):
        mp.setenv("DFLASH_JAX_CACHE", cache)
        yield


# The default suite's time budget, summed over its tests' setup, call and teardown as pytest
# times them (so over every xdist worker: about twice the wall time on the 2-core CI machine).
# A whole default run over it fails, naming the sum: the suite is a budget like a kernel's
# memory (docs/development.md). 700 s summed is about the 6-minute wall-time goal on 2 workers
# (half the sum plus ~20 s of start-up and imbalance); measured 2026-12-07, cold caches: 724 s
# summed, 389 s of wall at -O3 (CI: 750 s, over), 540 s and 297 s at -O0 (above).
# DFLASH_JAX_SUITE_BUDGET_S sets another (a tiny one shows the check failing).
DEFAULT_SUITE_BUDGET_S = float(os.environ.get("DFLASH_JAX_SUITE_BUDGET_S", "700"))
_durations = {"sum": 0.0, "tests": 0}


def pytest_runtest_logreport(report):
    _durations["sum"] += report.duration
    _durations["tests"] += report.when == "call"


def _whole_default_run(config) -> bool:
    return (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and config.option.markexpr == "not slow"
        and not config.option.keyword
        and not getattr(config.option, "lf", False)  # -p no:cacheprovider drops --lf
        and not config.option.deselect
    )


def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or not _whole_default_run(session.config):
        return
    spent = _durations["sum"]
    if spent > DEFAULT_SUITE_BUDGET_S and exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    session.config._dflash_budget_line = (
        f"default suite: {_durations['tests']} tests, {spent:.0f} s summed over workers, "
        f"budget {DEFAULT_SUITE_BUDGET_S:.0f} s"
        + (" -- OVER BUDGET" if spent > DEFAULT_SUITE_BUDGET_S else "")
    )


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    line = getattr(config, "_dflash_budget_line", None)
    if line:
        terminalreporter.write_line(line, red="OVER" in line, bold=True)


# --- fixtures shared by several test modules (their helpers: tests/_*.py) ----------------------
# Imports inside the fixtures: a run that needs none of them (tests/test_docs.py) starts no JAX.


@pytest.fixture
def tiny_target(monkeypatch):
    """tests/_training.py's TINY_TARGET with random params, loaded by the trainer whatever its
    config names (`trainer.load_target` replaced for the test)."""
    import jax
    from _training import TINY_TARGET

    from dflash_jax.io.target_loader import LoadedTarget
    from dflash_jax.models.target import init_params
    from dflash_jax.training import trainer

    target = LoadedTarget(
        TINY_TARGET, init_params(TINY_TARGET, jax.random.key(1)), None, None, "tiny"
    )
    monkeypatch.setattr(trainer, "load_target", lambda source, dtype: target)
    return target


@pytest.fixture(scope="module")
def target():
    """A tiny random Llama target with a character-level ChatML tokenizer (the data-generation
    tests' target); a module's own `target` fixture overrides it."""
    import jax
    from _chat_tokenizer import CHATML, char_tokenizer

    from dflash_jax.config import TargetConfig
    from dflash_jax.io.target_loader import LoadedTarget
    from dflash_jax.models.target import init_params

    tokenizer = char_tokenizer()
    config = TargetConfig(
        arch="llama",
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        max_position_embeddings=512,
        eos_token_ids=(2,),
    )
    params = init_params(config, jax.random.key(0))
    return LoadedTarget(config, params, tokenizer, CHATML, "tiny")


@pytest.fixture(scope="module")
def chat(target):
    """The `target` fixture's chat format (training.generate.ChatFormat)."""
    from dflash_jax.training.generate import ChatFormat

    return ChatFormat(target.tokenizer, target.chat_template)
