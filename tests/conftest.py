"""Tests run offline on the CPU: no hub access, no accelerator."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
