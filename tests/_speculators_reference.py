"""Run by `tests/test_speculators.py` under the python of a venv with `speculators` 0.9.0 (never
imported by the suite): one block drafted teacher-forced by the reference model (DFlash or DFlash2: its unary logits), for
each export.

    python tests/_speculators_reference.py INPUTS.npz OUT_PREFIX EXPORT_DIR...

INPUTS.npz: taps [T, F] (the target's taps, in the drafter's aux order), tokens [T], anchor.
OUT_PREFIX{i}.npy: export i's draft logits [block_size, V or draft vocab] of the block at
`anchor` (its token, then mask tokens), which sees the context rows before the anchor; slot 0
is the anchor's own.
"""

import sys

import numpy as np
import torch
from speculators import SpeculatorModel, SpeculatorModelConfig


def main(inputs: str, out_prefix: str, *export_dirs: str) -> None:
    for i, export_dir in enumerate(export_dirs):
        np.save(f"{out_prefix}{i}.npy", draft_logits(export_dir, inputs))


def draft_logits(export_dir: str, inputs: str) -> np.ndarray:
    data = np.load(inputs)
    taps, tokens, anchor = data["taps"], data["tokens"], int(data["anchor"])
    config = SpeculatorModelConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # a dense mask on CPU
    # the class the config names: DFlashDraftModel or DFlash2DraftModel
    model = SpeculatorModel.from_pretrained(export_dir, config=config).float().eval()
    t = len(tokens)
    loss_mask = torch.zeros(1, t, dtype=torch.long)
    loss_mask[0, anchor] = 1  # the one valid anchor, so the reference picks it
    with torch.no_grad():
        _, logits, *_ = model._backbone_forward(
            hidden_states=torch.as_tensor(taps, dtype=torch.float32)[None],
            input_ids=torch.as_tensor(tokens, dtype=torch.long)[None],
            loss_mask=loss_mask,
            verifier_last_hidden_states=torch.zeros(1, t, model.hidden_size),
            document_ids=torch.zeros(1, t, dtype=torch.long),
            max_anchors=1,
        )
    return logits[0].numpy()


if __name__ == "__main__":
    main(*sys.argv[1:])
