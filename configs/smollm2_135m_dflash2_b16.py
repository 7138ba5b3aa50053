"""A DFlash2 drafter for SmolLM2-135M-Instruct: the shipped DFlash recipe (`smollm2_135m_b16.py`:
1 layer at the target's width, taps [1, 8, 14, 20, 27], block 16, cached taps, 4096-negative
sampled softmax) plus DFlash2's two additions.

* Convolutions: two taps (as NeMo AutoModel's and the reference's DFlash2 layers), dynamic
  kernels shared by groups of 64 channels (9 groups of SmolLM2's 576). They start as the
  identity (`models/dflash2.py`), so step 0 is the DFlash drafter.
* Selector: rank 32 codebooks over the top 8 candidates of each slot, trained by the selector
  CE beside the block CE at weight 1 (`training/selector_loss.py`, NeMo AutoModel's objective);
  its successor codebook starts at zero, so step 0 drafts the unary argmax.

CPU cost: the selector term takes each slot's top-8 from the full 49152-way head (forward only),
work that the sampled softmax otherwise avoids; compare the two recipes at equal CPU time,
not equal steps.

    python -m train.train_drafter --config=configs/smollm2_135m_dflash2_b16.py --workdir=...
"""

from configs.smollm2_135m_b16 import get_config as dflash_config


def get_config():
    cfg = dflash_config()
    cfg.drafter.conv_kernel_size = 2
    cfg.drafter.conv_group_size = 64
    cfg.drafter.selector_rank = 32
    cfg.drafter.selector_top_k = 8
    cfg.selector_loss_weight = 1.0
    return cfg
