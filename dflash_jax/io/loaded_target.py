"""`LoadedTarget`: a target ready to run, as `load_target` (io/target_loader.py) and
`restore_target` (io/target_orbax.py) return it; apart from both so neither imports the other."""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_jax.config import TargetConfig


@dataclasses.dataclass
class LoadedTarget:
    """A target ready to run: `Transformer(config).apply({"params": params}, ...)`."""

    config: TargetConfig
    params: dict
    tokenizer: Any  # a transformers fast tokenizer, or None when the source ships none
    chat_template: str | None
    source: str  # the resolved local path
    mesh: Any = None  # the jax Mesh the params are sharded over (load_target(mesh=...)), or None
