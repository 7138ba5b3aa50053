"""`python -m infer.lower --device=...`: the tiny config's decode and training programs compiled
by XLA's own TPU and GPU compilers on this CPU (requirements-compile.txt), and what its lines
read from the compiled HLO text of either platform.

The compiling tests need libtpu (TPU) or jax-cuda12-plugin[with-cuda] (GPU) and are skipped,
saying which to install, without them.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny_configs import write_tiny_config

from infer import devices
from infer.hlo_scan import copies_of_shapes_in_loop

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = {"start_speculative", "advance_speculative", "start_autoregressive",
            "advance_autoregressive", "train_step", "heldout_metrics", "eval_decode"}  # fmt: skip
LOOPS = {"advance_speculative", "advance_autoregressive", "eval_decode"}

# A TPU-compiled loop body as XLA prints it: tiled layouts, an async copy (a tuple result), a
# copy inside a fusion, and a Mosaic kernel with its scoped VMEM.
_TPU_HLO = """HloModule jit__advance, is_scheduled=true

%fused_computation.1 (param_0: bf16[8,2,48,64]) -> bf16[8,2,48,64] {
  %param_0 = bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)} parameter(0)
  ROOT %copy.3 = bf16[8,2,48,64]{3,2,1,0:T(8,128)(2,1)} copy(%param_0)
}

%body.2 (arg: (s32[], bf16[8,2,48,64])) -> (s32[], bf16[8,2,48,64]) {
  %arg = (s32[], bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)}) parameter(0)
  %gte.1 = bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)} get-tuple-element(%arg), index=1
  %copy-start.1 = (bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)S(1)}, bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)}, u32[]{:S(2)}) copy-start(%gte.1)
  %copy.2 = bf16[8,2,16,64]{3,2,1,0:T(8,128)(2,1)} copy(%small)
  %fusion.1 = bf16[8,2,48,64]{3,2,1,0:T(8,128)(2,1)} fusion(%gte.1), kind=kLoop, calls=%fused_computation.1
  %k = bf16[8,2,16,64]{3,2,1,0} custom-call(%fusion.1), custom_call_target="tpu_custom_call", metadata={op_name="jit(_advance)/while/body/Drafter/dflash_decode_attention/pallas_call"}, backend_config={"custom_call_config":{"body":"x"},"used_scoped_memory_configs":[{"memory_space":"1","offset":"0","size":"1728512"}]}
  ROOT %tuple.1 = (s32[], bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)}) tuple(%i, %fusion.1)
}

ENTRY %main.4 (p: bf16[8,2,48,64]) -> bf16[8,2,48,64] {
  %p = bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)} parameter(0)
  %copy.9 = bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)} copy(%p)
  %while.1 = (s32[], bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)}) while(%t), condition=%cond.3, body=%body.2
  ROOT %out = bf16[8,2,48,64]{3,1,2,0:T(2,128)(2,1)} get-tuple-element(%while.1), index=1
}
"""
_TRITON_CALL = (
    '  %c = bf16[8,2,64,64]{3,2,1,0} custom-call(%a), custom_call_target="__gpu$xla.gpu.triton", '
    "backend_config={debug = false, grid_x = 16 : i32, grid_y = 1 : i32, grid_z = 1 : i32, "
    'ir = "ML\\EFR", name = "dflash_attention_fwd", num_stages = 2 : i32, num_warps = 4 : i32}\n'
)


def test_loop_copies_are_counted_by_the_caches_shapes_in_tpu_hlo():
    """The fused copy of the cache's shape to another layout inside the loop counts; its async
    copy into VMEM in the same layout (a prefetch), the copy of another shape and the one
    outside the loop do not."""
    assert copies_of_shapes_in_loop(_TPU_HLO, {(8, 2, 48, 64)}) == 1
    relaid = _TPU_HLO.replace(
        "{3,1,2,0:T(2,128)(2,1)S(1)}, bf16", "{3,2,1,0:T(8,128)(2,1)S(1)}, bf16"
    )
    assert copies_of_shapes_in_loop(relaid, {(8, 2, 48, 64)}) == 2
    assert copies_of_shapes_in_loop(_TPU_HLO, {(8, 2, 1024, 64)}) == 0


def test_kernels_are_read_with_their_compiled_resources():
    found = devices.kernel_resources(_TPU_HLO + _TRITON_CALL)
    assert found == [
        {"name": "dflash_attention_fwd", "target": "__gpu$xla.gpu.triton", "count": 1,
         "num_warps": [4], "num_stages": [2], "grid_x": [16], "grid_y": [1], "grid_z": [1]},
        {"name": "dflash_decode_attention", "target": "tpu_custom_call", "count": 1,
         "vmem_bytes": [1728512]},
    ]  # fmt: skip


@pytest.mark.slow  # only this guards that the programs compile for a real TPU and GPU (minutes)
@pytest.mark.parametrize("device", ["v5p-1", "h100"])
def test_tiny_programs_compile_for_the_device(tmp_path, device):
    """Every decode and training program of the tiny config compiles for one TPU v5p chip and
    one H100, within the device's memory; each line carries the compiled figures; and
    `infer.memory_plan --device` plans the same decode with that compiler's own temporaries."""
    platform = devices.DEVICES[device].platform
    reason = devices.missing(platform)
    if reason:
        pytest.skip(reason)
    config = write_tiny_config(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
    env.pop("JAX_PLATFORMS", None)  # infer.lower sets its own
    shape = ["--batch=8", "--prompt_len=16", "--max_new_tokens=16"]
    out = subprocess.run(
        [sys.executable, "-m", "infer.lower", f"--config={config}", f"--device={device}",
         "--what=decode,train", *shape],
        env=env, cwd=ROOT, capture_output=True, text=True, check=False, timeout=900,
    )  # fmt: skip
    lines = {(x := json.loads(line))["program"]: x for line in out.stdout.splitlines()}
    assert out.returncode == 0 and set(lines) == PROGRAMS, out.stdout + out.stderr[-3000:]
    for name, line in lines.items():
        assert line["compiled"] and line["error"] is None, line
        assert line["device_kind"].startswith("TPU" if platform == "tpu" else "NVIDIA"), line
        assert 0 < line["memory"]["peak_bytes"] <= line["device_bytes"], line
        assert line["flops"] and line["bytes_accessed"], line
        assert line["kernels"] and all(k["compiled"]["count"] for k in line["kernels"]), line
        copies = line["cache_copies_in_loop"]
        assert (copies is None) == (name in {"train_step", "heldout_metrics"}), line
        assert copies is None or copies >= 0
    # the memory plan of that decode, compiled by the same compiler: its activations row is the
    # larger of the two halves' temporaries as infer.lower reads them, and no CPU-only row
    plan_file = tmp_path / "plan.json"
    plan = subprocess.run(
        [sys.executable, "-m", "infer.memory_plan", f"--config={config}", "--mode=decode",
         f"--platform={platform}", f"--device={device}", *shape, f"--output={plan_file}"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert plan.returncode == 0, plan.stdout + plan.stderr[-3000:]
    plan = json.loads(plan_file.read_text())
    assert plan["device"] == device and plan["backend"].startswith("XLA:"), plan
    halves = ("start_speculative", "advance_speculative")
    temp = max(lines[name]["memory"]["temp"] for name in halves)
    rows = plan["bytes_per_device"]
    assert rows["activations (temporaries)"] == temp, (rows, temp)
    assert not any("CPU only" in name for name in rows), rows
