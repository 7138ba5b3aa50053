"""Real models' shapes for the checks that need only shapes (`jax.eval_shape`, sharding
plans): no weights."""

QWEN3_8B = dict(
    arch="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_layers=36,
    num_heads=32, num_kv_heads=8, head_dim=128, dtype="bfloat16",
)  # fmt: skip
