"""Converts a DFlash drafter between the z-lab HF format, the `speculators` format and our Orbax
format (any of them in; `load_drafter` reads all three).

  python -m infer.convert --source=z-lab/Qwen3-8B-DFlash-b16 --output=/ckpt/q3-8b --format=orbax
  python -m infer.convert --source=/ckpt/mine --output=/export/mine --format=zlab --dtype=bfloat16
  python -m infer.convert --source=default --output=/export/spec --format=speculators \
      --verifier=HuggingFaceTB/SmolLM2-135M-Instruct

The z-lab export loads with `dflash.DFlashDraftModel.from_pretrained`, vLLM and SGLang; the
speculators export with `speculators`' `SpeculatorModel.from_pretrained` (docs/models.md). A
corpus table beside the source's params (`corpus_ngrams.npz`, `train.build_corpus`) is written
beside the output's in every format: `load_drafter` reads it there; the other loaders ignore
the side file.
Library logs (Orbax) show from warnings up; --verbosity=0 shows their INFO lines too.
"""

from __future__ import annotations

from absl import flags

from dflash_jax.io import paths
from dflash_jax.io.corpus_table import save_table
from dflash_jax.io.drafter_io import read_drafter, save_drafter
from dflash_jax.io.speculators import write_speculators
from dflash_jax.io.zlab import write_zlab
from dflash_jax.ops.ngrams import CORPUS_FILE
from infer import cli
from infer.logs import quiet_library_logs

_SOURCE = flags.DEFINE_string(
    "source",
    None,
    "Drafter to read: our Orbax directory, a z-lab HF or speculators directory "
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
    ["orbax", "zlab", "speculators"],
    "orbax: our checkpoint (drafter_config.json + params/), "
    "for load_drafter/restore_drafter. zlab: config.json + model.safetensors for the reference "
    "dflash package, vLLM and SGLang. speculators: config.json + model.safetensors for "
    "vllm-project/speculators (DFlash, DFlash2 and DSpark, over the target's vocabulary or a "
    "draft vocabulary of their own).",
    required=True,
)
_VERIFIER = flags.DEFINE_string(
    "verifier",
    None,
    "--format=speculators: the target's hub id or path, written as the checkpoint's verifier "
    "(speculators and vLLM load the embedding and lm_head from it); unset: null.",
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
    table = drafter.corpus_table
    if _FORMAT.value == "zlab":
        write_zlab(_OUTPUT.value, drafter.config, drafter.params, _DTYPE.value)
    elif _FORMAT.value == "speculators":
        write_speculators(
            _OUTPUT.value, drafter.config, drafter.params, _DTYPE.value, _VERIFIER.value
        )
    else:
        save_drafter(_OUTPUT.value, drafter.config, drafter.params, table)
    if table is not None and _FORMAT.value != "orbax":  # a side file the other formats ignore
        save_table(table, paths.path(_OUTPUT.value) / CORPUS_FILE)
    print(f"wrote {_FORMAT.value} drafter ({drafter.config.num_layers} layers) to {_OUTPUT.value}")
    if table is not None:
        print(
            f"with its corpus table ({table.keys.size:,} n-grams) beside it: {CORPUS_FILE}, "
            "which load_drafter reads (other loaders ignore it)"
        )
    if _FORMAT.value == "speculators" and not _VERIFIER.value:
        print(
            "no --verifier: speculators and vLLM read the target's embedding and lm_head from "
            "speculators_config.verifier.name_or_path (null); set it there or convert again"
        )


if __name__ == "__main__":
    cli.run(main)
