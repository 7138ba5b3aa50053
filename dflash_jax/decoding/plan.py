"""A run's plan: what one decode entry (`api.generate`, `runner.timed_decode`, the calibration,
`speculative_decode`, `autoregressive_decode`) resolves once, after the input checks, and the
programs then read instead of resolving it again: the target config as the decode compiles it
(`programs.run_target_config`: dtype, row rule and tile), the drafter config, the DecodeConfig
as the programs take it (the target alone's: `autoregressive_config`), the executable's
compiler options (`programs.executable_options`) and the mesh."""

from __future__ import annotations

import dataclasses
from typing import Any

from dflash_jax.config import DrafterConfig, TargetConfig
from dflash_jax.decoding import programs
from dflash_jax.decoding.settings import DecodeConfig, autoregressive_config


@dataclasses.dataclass(frozen=True)
class Plan:
    """A checked, resolved decode: `make_plan` builds it; `statics` are the jitted halves'
    static arguments, `compiler_options` their executables' options."""

    target_config: TargetConfig  # as compiled (`programs.run_target_config`)
    drafter_config: DrafterConfig | None  # None: the target alone
    decode_config: DecodeConfig  # as the programs take it (the target alone's: reset)
    options: tuple[tuple[str, Any], ...]  # `programs.executable_options`, sorted items
    mesh: Any = None  # where it runs (None: one device)

    @property
    def statics(self) -> dict:
        """The static arguments of the decode's jitted functions (`jit_decoder`)."""
        out = dict(target_config=self.target_config, drafter_config=self.drafter_config)
        if self.drafter_config is None:
            del out["drafter_config"]
        return {**out, "decode_config": self.decode_config}

    @property
    def compiler_options(self) -> dict:
        return dict(self.options)

    def target_alone(self) -> Plan:
        """The plan of the target-alone decode of the same settings (the baseline, and the
        calibration's unit): the same target config and options, the drafting fields reset."""
        return dataclasses.replace(
            self, drafter_config=None, decode_config=autoregressive_config(self.decode_config)
        )


def make_plan(
    target_config: TargetConfig,
    drafter_config: DrafterConfig | None,
    cfg: DecodeConfig,
    mesh=None,
) -> Plan:
    """Checks the decode (`programs.check_decode_inputs`, with a drafter) and resolves its
    plan; `target_config` is the target's own (not yet a run's). The prompt is checked per
    run (`programs.check_prompt`): one plan serves every prompt."""
    if drafter_config is not None:
        programs.check_decode_inputs(target_config, drafter_config, cfg)
    run_config = programs.run_target_config(target_config, cfg)
    plan = Plan(
        target_config=run_config,
        drafter_config=drafter_config,
        decode_config=cfg,
        options=tuple(sorted(programs.executable_options(run_config).items())),
        mesh=mesh,
    )
    return plan if drafter_config is not None else plan.target_alone()
