"""A new token budget does not recompile: `generate` compiles a power-of-two token buffer
(`api.budget_bucket`) and passes `max_new_tokens` to the decode as an input, so a second call
with another budget in the bucket compiles nothing, and each stops at its own budget with the
first tokens of the longer one."""

from __future__ import annotations

import jax
import pytest
from jax._src import dispatch

from dflash_jax import api
from dflash_jax.config import DrafterConfig
from dflash_jax.io.drafter_io import LoadedDrafter
from dflash_jax.models.drafter import init_drafter_params


def _tiny_drafter(target) -> LoadedDrafter:
    vocab = target.config.vocab_size
    dcfg = DrafterConfig(
        hidden_size=32,
        intermediate_size=64,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        vocab_size=vocab,
        mask_token_id=0,
        target_layer_ids=(0, 1),
        num_target_layers=2,
        block_size=4,
    )
    return LoadedDrafter(dcfg, init_drafter_params(dcfg, jax.random.key(1)), "tiny")


@pytest.fixture
def compiles():
    """The lowerings and XLA compiles run while the test runs (a list that grows): a program
    loaded from JAX's persistent cache is lowered first, so a reload counts too."""
    seen: list[str] = []
    events = (dispatch.JAXPR_TO_MLIR_MODULE_EVENT, dispatch.BACKEND_COMPILE_EVENT)

    def listen(name, secs, **kw):
        if name in events:
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.mark.parametrize(
    "mode",
    [
        "speculative",
        # Slow: guards alone the target-alone decode's start half taking the budget (the
        # loop's stop and the commit are the speculative decode's, checked in the default run).
        pytest.param("autoregressive", marks=pytest.mark.slow),
    ],
)
def test_a_new_budget_in_the_bucket_compiles_nothing(target, compiles, mode):
    drafter = _tiny_drafter(target) if mode == "speculative" else None
    run = lambda n: api.generate(
        target, drafter, ["hello"], max_new_tokens=n, adaptive=False, block_size=4, chat=False
    )[0]
    assert api.budget_bucket(20) == api.budget_bucket(30) == 32
    short = run(20)
    before = len(compiles)
    long = run(30)
    assert compiles[before:] == [], "max_new_tokens=30 lowered or compiled a program again"
    # the char tokenizer: one character per token; the random target never stops in 30
    assert (len(short), len(long)) == (20, 30)
    assert long.startswith(short)


def test_the_budget_bucket_stays_inside_the_context():
    assert [api.budget_bucket(n) for n in (1, 32, 33, 100)] == [32, 32, 64, 128]
    assert api.budget_bucket(100, room=120) == 100  # 128 would not fit: the budget itself
