"""Drafter training: data generation, the grain pipeline, anchors, the block-diffusion loss, the
train step and loop, and Orbax checkpoints."""
