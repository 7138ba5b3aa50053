"""Converts a DFlash drafter between the z-lab HF format and our Orbax format.

  python -m infer.convert --source=z-lab/Qwen3-8B-DFlash-b16 --output=/ckpt/q3-8b --format=orbax
  python -m infer.convert --source=/ckpt/mine --output=/export/mine --format=zlab --dtype=bfloat16

The z-lab export loads with `dflash.DFlashDraftModel.from_pretrained`, vLLM and SGLang.
Library logs (Orbax) show from warnings up; --verbosity=0 shows their INFO lines too.
"""

from __future__ import annotations

from absl import flags

from dflash_jax.io.drafter_io import read_drafter, save_drafter
from dflash_jax.io.zlab import write_zlab
from infer import cli
from infer.logs import quiet_library_logs

_SOURCE = flags.DEFINE_string(
    "source",
    None,
    "Drafter to read: our Orbax directory, a z-lab HF directory "
    "(config.json + model.safetensors), a hub id such as z-lab/Qwen3-8B-DFlash-b16 (needs "
    "network), or 'default' (the drafter shipped in this repository).",
    required=True,
)
_OUTPUT = flags.DEFINE_string(
    "output",
    None,
    "Directory to write; for --format=orbax it must not hold a checkpoint yet.",
    required=True,
)
_FORMAT = flags.DEFINE_enum(
    "format",
    None,
    ["orbax", "zlab"],
    "orbax: our checkpoint (drafter_config.json + params/), "
    "for load_drafter/restore_drafter. zlab: config.json + model.safetensors for the reference "
    "dflash package, vLLM and SGLang.",
    required=True,
)
_DTYPE = flags.DEFINE_enum(
    "dtype",
    "float32",
    ["float32", "bfloat16"],
    "Dtype of the written weights (bfloat16 halves the size; float32 is lossless).",
)


def main(argv):
    del argv
    quiet_library_logs()
    drafter = read_drafter(_SOURCE.value, _DTYPE.value)
    if _FORMAT.value == "zlab":
        write_zlab(_OUTPUT.value, drafter.config, drafter.params, _DTYPE.value)
    else:
        save_drafter(_OUTPUT.value, drafter.config, drafter.params)
    print(f"wrote {_FORMAT.value} drafter ({drafter.config.num_layers} layers) to {_OUTPUT.value}")


if __name__ == "__main__":
    cli.run(main)
