"""Run by `tests/test_speculators.py` under the python of a venv with `speculators` 0.9.0 (never
imported by the suite): one block drafted teacher-forced by the reference model (DFlash,
DFlash2: its unary logits; DSpark: its Markov-biased logits and confidence logits), for each
export.

    python tests/_speculators_reference.py INPUTS.npz OUT_PREFIX EXPORT_DIR...
    python tests/_speculators_reference.py --write SPEC.json OUT_DIR

--write: a random drafter written by `speculators` itself (its config classes and
`save_pretrained`, as a user of the library trains and saves one), for our loader to read. SPEC:
{"kind": "dflash" or "dflash2", "layer": Qwen3Config kwargs, "top": the speculators config's own
fields, "verifier": the target's directory, "seed"}.

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
    if inputs == "--write":
        return write_random(out_prefix, *export_dirs)
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


def write_random(spec_json: str, out_dir: str) -> None:
    import json

    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
    from speculators.models.dflash2 import DFlash2DraftModel, DFlash2SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import Qwen3Config

    spec = json.loads(open(spec_json).read())
    config_class, model_class = {
        "dflash": (DFlashSpeculatorConfig, DFlashDraftModel),
        "dflash2": (DFlash2SpeculatorConfig, DFlash2DraftModel),
    }[spec["kind"]]
    drafts = spec["top"]["block_size"] - 1
    config = config_class(
        transformer_layer_config=Qwen3Config(**spec["layer"]),
        **spec["top"],
        speculators_config=SpeculatorsConfig(
            algorithm=spec["kind"],
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=drafts)],
            default_proposal_method="greedy",
            verifier=VerifierConfig(name_or_path=spec["verifier"], architectures=[]),
        ),
    )
    model = model_class(config).float()
    gen = torch.Generator().manual_seed(spec["seed"])
    with torch.no_grad():  # every weight off its init, norms around 1
        for name, p in model.named_parameters():
            noise = 0.15 * torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
    model.save_pretrained(out_dir)


if __name__ == "__main__":
    main(*sys.argv[1:])
