"""`infer.roofline`'s counts on a hand-sized params tree: what a step reads and multiplies."""

import jax
import jax.numpy as jnp

from infer import roofline

_TREE = {
    "embed_tokens": {"embedding": jax.ShapeDtypeStruct((100, 8), jnp.bfloat16)},
    "layers_0": {
        "mlp": {"experts": {"up_proj": jax.ShapeDtypeStruct((4, 8, 16), jnp.bfloat16)}},
        "self_attn": {"q_proj": {"kernel": jax.ShapeDtypeStruct((8, 2, 4), jnp.bfloat16)}},
        "input_layernorm": {"scale": jax.ShapeDtypeStruct((8,), jnp.bfloat16)},
    },
    "lm_head": {"kernel": jax.ShapeDtypeStruct((8, 100), jnp.bfloat16)},
}


def test_weights_leave_the_embedding_lookup_out_unless_tied():
    w = roofline.weights(_TREE)
    assert w == {"matmul": 64 + 8 + 800, "experts": 512, "head": 800, "read": 872}
    tied = roofline.weights({k: v for k, v in _TREE.items() if k != "lm_head"}, tied=True)
    assert tied["head"] == 800 and tied["matmul"] == 800 + 64 + 8


def test_a_step_counts_active_experts_and_the_keys_it_attends():
    """One row, one token, top-1 of 4 experts: a quarter of the expert flops, one expert read;
    one full and one 4-key sliding layer over 10 keys."""
    w = roofline.weights(_TREE)
    flops, nbytes = roofline.forward(w, [0, 4], (2, 1, 4), 1, 1, 10, experts=(4, 1))
    assert flops == 2 * (872 + 512 / 4) + 4 * 2 * 4 * (10 + 4)
    assert nbytes == 2 * (872 + 512 / 4) + 2 * 2 * 1 * 4 * ((10 + 1) + (4 + 1))
