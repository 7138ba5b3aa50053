"""infer.bench.device_check's pieces that decide its verdicts, without compiling anything: the
count of cache-sized copies inside a compiled loop, the peak bandwidth a device kind gets, and
the kernel result's tolerance. The whole check runs at toy shapes as a CI step (.ci/run:
`python -m infer.bench.device_check --tiny`), too slow for the default suite (~3 minutes)."""

from __future__ import annotations

import json

import numpy as np

from infer.bench import device_check

# A compiled module in XLA's text form, cut to what the count reads: an entry with a while loop
# whose body calls a fusion; a cache-sized copy in the body, another outside the loop.
_HLO = """HloModule jit_advance, is_scheduled=true

%fused_computation.1 (param_0: bf16[1,2,64,64]) -> bf16[1,2,64,64] {
  %param_0 = bf16[1,2,64,64]{3,2,1,0} parameter(0)
  ROOT %copy.3 = bf16[1,2,64,64]{3,2,1,0} copy(%param_0)
}

%body.2 (arg: (s32[], bf16[1,2,64,64])) -> (s32[], bf16[1,2,64,64]) {
  %arg = (s32[], bf16[1,2,64,64]{3,2,1,0}) parameter(0)
  %gte.1 = bf16[1,2,64,64]{3,2,1,0} get-tuple-element(%arg), index=1
  %copy.1 = bf16[1,2,64,64]{3,2,1,0} copy(%gte.1)
  %copy.2 = f32[2,32]{1,0} copy(%small)
  %fusion.1 = bf16[1,2,64,64]{3,2,1,0} fusion(%copy.1), kind=kLoop, calls=%fused_computation.1
  ROOT %tuple.1 = (s32[], bf16[1,2,64,64]{3,2,1,0}) tuple(%i, %fusion.1)
}

%cond.3 (arg.1: (s32[], bf16[1,2,64,64])) -> pred[] {
  %arg.1 = (s32[], bf16[1,2,64,64]{3,2,1,0}) parameter(0)
  ROOT %lt = pred[] compare(%a, %b), direction=LT
}

ENTRY %main.4 (p: bf16[1,2,64,64]) -> bf16[1,2,64,64] {
  %p = bf16[1,2,64,64]{3,2,1,0} parameter(0)
  %copy.9 = bf16[1,2,64,64]{3,2,1,0} copy(%p)
  %while.1 = (s32[], bf16[1,2,64,64]{3,2,1,0}) while(%t), condition=%cond.3, body=%body.2
  ROOT %out = bf16[1,2,64,64]{3,2,1,0} get-tuple-element(%while.1), index=1
}
"""


def test_cache_copies_count_the_loop_body_and_what_it_calls_only():
    """Copies of a cache-sized buffer in the while body (one there, one in a fusion it calls)
    count; the small copy in the body and the cache copy before the loop do not."""
    cache = 1 * 2 * 64 * 64
    assert device_check.cache_copies_in_loop(_HLO, cache) == 2
    assert device_check.cache_copies_in_loop(_HLO, cache + 1) == 0
    assert device_check.cache_copies_in_loop(_HLO.replace(" while(", " call("), cache) == 0


# XLA:TPU's text of a loop body (cut): the cache carried S-major ({3,1,2,0}) and transposed to
# row-major for a kernel (a copy), and a row-major cache prefetched into VMEM (S(1)) and back
# (memory-space moves in one layout, no second buffer).
_TPU_BODY = """HloModule jit_advance, is_scheduled=true

%body.2 (arg: (bf16[2,8,64,128], bf16[2,8,64,128])) -> (bf16[2,8,64,128], bf16[2,8,64,128]) {
  %arg = (bf16[2,8,64,128]{3,1,2,0:T(8,128)(2,1)}, bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)}) parameter(0)
  %a = bf16[2,8,64,128]{3,1,2,0:T(8,128)(2,1)} get-tuple-element(%arg), index=0
  %b = bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)} get-tuple-element(%arg), index=1
  %copy.1 = bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)} copy(%a)
  %copy-start.1 = (bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)S(1)}, bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%b)
  %copy-done.1 = bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)S(1)} copy-done(%copy-start.1)
  %copy.2 = bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)} copy(%copy-done.1)
  ROOT %t = (bf16[2,8,64,128]{3,1,2,0:T(8,128)(2,1)}, bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)}) tuple(%a, %copy.2)
}

ENTRY %main.4 (p: (bf16[2,8,64,128], bf16[2,8,64,128])) -> bf16[2,8,64,128] {
  %p = (bf16[2,8,64,128]{3,1,2,0:T(8,128)(2,1)}, bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)}) parameter(0)
  %while.1 = (bf16[2,8,64,128]{3,1,2,0:T(8,128)(2,1)}, bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)}) while(%p), condition=%cond.3, body=%body.2
  ROOT %out = bf16[2,8,64,128]{3,2,1,0:T(8,128)(2,1)} get-tuple-element(%while.1), index=1
}
"""


def test_a_tpu_layout_change_is_a_copy_and_a_move_to_vmem_a_prefetch():
    """In XLA:TPU's text a cache transposed to another layout is a copy; one moved into VMEM
    (S(1)) and back in the same layout is a prefetch, counted apart (`hlo_scan`)."""
    from infer.hlo_scan import cache_prefetches_in_loop

    cache = 2 * 8 * 64 * 128
    assert device_check.cache_copies_in_loop(_TPU_BODY, cache) == 1
    assert cache_prefetches_in_loop(_TPU_BODY, cache) == 2


def test_peak_bandwidth_by_device_kind():
    """jax's device kinds map to their HBM figures (v5e reports itself as "TPU v5 lite", v5p
    as "TPU v5"); a CPU has none."""
    assert device_check.peak_bytes_per_s("NVIDIA H200") == 4.8e12
    assert device_check.peak_bytes_per_s("TPU v5 lite") == 819e9
    assert device_check.peak_bytes_per_s("TPU v5") == 2.765e12
    assert device_check.peak_bytes_per_s("cpu") is None


def test_kernel_result_fails_on_nan_or_error_past_tolerance(tmp_path):
    """A kernel result is ok only within its dtype's tolerance and without NaN; the JSON is
    written whole (a temporary file renamed)."""
    want = np.ones((4, 4), np.float32)
    good = device_check._result("k", "bfloat16", want + 0.01, want, want)
    bad = device_check._result("k", "bfloat16", want + 0.1, want, want)
    nan = device_check._result("k", "float32", np.where(want > 0, np.nan, want), want, want)
    assert (good["ok"], bad["ok"], nan["ok"], nan["nan_count"]) == (True, False, False, 16)
    path = tmp_path / "dc.json"
    device_check._write(path, {"stages": {"environment": {"ok": True}}})
    assert json.loads(path.read_text())["stages"]["environment"]["ok"]
    assert [p.name for p in tmp_path.iterdir()] == ["dc.json"]
