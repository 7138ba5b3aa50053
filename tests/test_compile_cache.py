"""JAX's persistent compilation cache across processes: a second process loads every decode
program the first compiled (the speculative and the AR halves, compiled as the CLIs do by
`api.compile_decodes`), and decodes the same tokens."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

_RUN = textwrap.dedent(
    """
    import json, logging, sys, types
    import jax
    import numpy as np
    from dflash_jax import api
    from dflash_jax.decoding.settings import DecodeConfig
    from dflash_jax.decoding import programs
    from _decode import LENS, PROMPT, make_pair

    programs.enable_persistent_cache(sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_log_compiles", True)
    hits = []

    class Hits(logging.Handler):
        def emit(self, record):
            msg = record.getMessage()
            if msg.startswith("Persistent compilation cache hit for"):
                hits.append(msg.split("'")[1])

    logging.getLogger("jax._src.compiler").addHandler(Hits())
    tcfg, tp, dcfg, dp = make_pair("llama")
    target = types.SimpleNamespace(config=tcfg, params=tp)
    drafter = types.SimpleNamespace(config=dcfg, params=dp)
    cfg = DecodeConfig(max_new_tokens=12, block_size=8, adaptive=True, step_kinds=(1, 4, 8))
    api.compile_decodes(target, drafter, PROMPT, LENS, cfg, with_target_alone=True)
    out = [api.timed_decode(target, d, PROMPT, LENS, 0, cfg) for d in (drafter, None)]
    tokens = [np.asarray(r.output.tokens).tolist() for r in out]
    compiled_later = [r.compile_s for r in out]
    print(json.dumps({"hits": sorted(set(hits)), "tokens": tokens, "later": compiled_later}))
    """
)


@pytest.mark.slow
def test_a_second_process_loads_every_decode_program(tmp_path):
    """Guards the cache claim alone (no other test spans two processes' caches): the second
    process hits the cache for the start and advance halves of both decodes, and its tokens
    are the first's; in each, `api.compile_decodes` (each half lowered, then compiled in a
    thread) compiled what `timed_decode` runs, which compiles nothing more."""
    runs = []
    for _ in range(2):
        proc = subprocess.run(
            [sys.executable, "-c", _RUN, str(tmp_path)],
            capture_output=True, text=True, cwd="tests", timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert runs[0]["hits"] == [], runs[0]["hits"]
    programs = {
        f"jit__{h}_{k}" for h in ("start", "advance") for k in ("speculative", "autoregressive")
    }
    assert programs <= set(runs[1]["hits"]), runs[1]["hits"]
    assert runs[1]["tokens"] == runs[0]["tokens"]
    assert runs[0]["later"] == runs[1]["later"] == [0.0, 0.0]
