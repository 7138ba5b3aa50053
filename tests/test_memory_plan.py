"""`python -m infer.memory_plan` agrees with XLA's own accounting of the programs it compiles.

The decode's loop state (caches, token buffers) is made inside the start half and donated to
the advance half; a plan that also counts it inside a program's temporaries counts it twice
(as planning the whole decode as one program did, whose temporaries hold the caches).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny_configs import write_tiny_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_decode_plan_counts_the_caches_once(tmp_path):
    config = write_tiny_config(tmp_path)
    output = tmp_path / "plan.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    out = subprocess.run(
        [sys.executable, "-m", "infer.memory_plan", f"--config={config}", "--mode=decode",
         "--batch=8", "--prompt_len=64", "--max_new_tokens=448", "--dtype=float32",
         f"--output={output}"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    plan = json.loads(output.read_text())
    rows, analyses = plan["bytes_per_device"], plan["xla_memory_analysis"]
    assert set(analyses) == {"start_speculative", "advance_speculative"}, analyses
    carry = rows["caches (loop carry)"]
    params = rows["params (target)"] + rows["params (drafter)"]
    assert carry > 2 * params, rows  # the shape makes the caches the largest item
    # XLA's peak of each program: its arguments, its outputs not aliased to an argument, and
    # its temporaries. The advance half takes the loop state as an (aliased) argument.
    peak = max(a["argument"] + a["output"] - a["alias"] + a["temp"] for a in analyses.values())
    assert analyses["advance_speculative"]["alias"] >= carry, analyses
    assert rows["activations (temporaries)"] < carry, rows
    # The plan holds every param throughout (a half drops those it does not read) and leaves
    # out scalars (rng, step limit): it may differ from XLA's peak by less than the params,
    # never by the caches.
    total = rows["total per device"]
    assert peak - 1024 <= total <= peak + params, (total, peak, rows, analyses)
