"""Run by `tests/test_speculators.py` under the python of a venv with `speculators` 0.9.0 (never
imported by the suite): one block drafted teacher-forced by the reference model (DFlash,
DFlash2: its unary logits; DSpark: its Markov-biased logits and confidence logits), for each
export.

    python tests/_speculators_reference.py INPUTS.npz OUT_PREFIX EXPORT_DIR...

INPUTS.npz: taps [T, F] (the target's taps, in the drafter's aux order), tokens [T], anchor.
OUT_PREFIX{i}.npy: export i's draft logits [block_size, V or draft vocab] of the block at
`anchor` (its token, then mask tokens), which sees the context rows before the anchor; slot 0
is the anchor's own. A DSpark export also writes OUT_PREFIX{i}_confidence.npy [block_size]: what
`DSparkDraftModel.forward` hands its loss (taken there, so the reference's own forward runs).
"""

import sys

import numpy as np
import torch
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.models.dspark import DSparkDraftModel, core


def main(inputs: str, out_prefix: str, *export_dirs: str) -> None:
    for i, export_dir in enumerate(export_dirs):
        logits, confidence = draft_logits(export_dir, inputs)
        np.save(f"{out_prefix}{i}.npy", logits)
        if confidence is not None:
            np.save(f"{out_prefix}{i}_confidence.npy", confidence)


def draft_logits(export_dir: str, inputs: str) -> tuple[np.ndarray, np.ndarray | None]:
    data = np.load(inputs)
    taps, tokens, anchor = data["taps"], data["tokens"], int(data["anchor"])
    config = SpeculatorModelConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = "eager"  # a dense mask on CPU
    # the class the config names: DFlashDraftModel or DFlash2DraftModel
    model = SpeculatorModel.from_pretrained(export_dir, config=config).float().eval()
    t = len(tokens)
    loss_mask = torch.zeros(1, t, dtype=torch.long)
    loss_mask[0, anchor] = 1  # the one valid anchor, so the reference picks it
    inputs = dict(
        hidden_states=torch.as_tensor(taps, dtype=torch.float32)[None],
        input_ids=torch.as_tensor(tokens, dtype=torch.long)[None],
        loss_mask=loss_mask,
        verifier_last_hidden_states=torch.zeros(1, t, model.hidden_size),
        document_ids=torch.zeros(1, t, dtype=torch.long),
        max_anchors=1,
    )
    with torch.no_grad():
        if isinstance(model, DSparkDraftModel):
            return dspark_logits(model, inputs)
        _, logits, *_ = model._backbone_forward(**inputs)
    return logits[0].numpy(), None


def dspark_logits(model, inputs: dict) -> tuple[np.ndarray, np.ndarray | None]:
    """The logits and confidence logits `DSparkDraftModel.forward` passes to its loss."""
    seen = {}

    def capture(logits, targets, confidence_logits, *args, **kwargs):
        seen["logits"], seen["confidence"] = logits, confidence_logits
        return torch.zeros(()), {}

    original, core.compute_metrics = core.compute_metrics, capture
    try:
        model(**inputs)
    finally:
        core.compute_metrics = original
    confidence = seen["confidence"]
    return seen["logits"][0].numpy(), None if confidence is None else confidence[0].numpy()


if __name__ == "__main__":
    main(*sys.argv[1:])
