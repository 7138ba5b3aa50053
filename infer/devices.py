"""Accelerators this machine compiles for without owning one, and what their compilers say.

    device = DEVICES["v5p-8"]
    chips = topology_devices(device)              # TPU v5 devices, no TPU needed
    mesh = sharding.make_mesh(1, 4, 1, devices=chips)
    compiled, line = compile_report(program, device, mesh)   # memory, cost, copies, kernels

A GPU (`h100`, `h200`) is a deviceless CUDA topology made from a `GpuTargetConfigProto` in
text form (`infer/device_specs/*.txtpb`, XLA's own specs, the source in each file's header);
it needs `jax-cuda12-plugin[with-cuda]` (ptxas comes from the NVIDIA wheels). A TPU slice is a
`jax.experimental.topologies` topology of its chips (`v5p:2x2x1`, ...); it needs `libtpu`, as
jax's `tpu` extra pins it. Both are in requirements-compile.txt, outside the default install;
`missing(platform)` says what to install when one is absent. Programs compiled for these
devices are compiled by XLA's own GPU (and Triton, ptxas) or TPU (and Mosaic) compilers: what
they refuse (shared memory or VMEM limits, a layout) shows as a failed compile.

The peak rates and memory of each device are the vendor's published figures (dense bf16
matmul, HBM bandwidth), used by `infer.roofline`; a GPU's memory and bandwidth are its spec
file's.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
from pathlib import Path

import jax
import numpy as np
from jax._src.lib import xla_client

SPECS = Path(__file__).parent / "device_specs"
# Fields of XLA's newer spec files that jaxlib 0.10.2's GpuDeviceInfoProto does not know (its
# text parser refuses the whole spec): left out when the spec is read.
NEWER_FIELDS = frozenset(("collective_memory_granularity",))


@dataclasses.dataclass(frozen=True)
class Device:
    """One accelerator kind and slice: `platform` "cuda" or "tpu"; `topology` the CUDA spec
    file's name or the TPU topology name (chips as XxY[xZ]); `chips` in the slice;
    `memory_bytes` of one chip (the compiler's device); `peak_flops` dense bf16 matmul per
    second and `bandwidth` HBM bytes per second, per chip; `source` of those figures."""

    name: str
    platform: str
    topology: str
    chips: int
    memory_bytes: int
    peak_flops: float
    bandwidth: float
    source: str


_NVIDIA = "NVIDIA H100/H200 datasheets (989 TFLOP/s dense bf16); memory and bandwidth: spec file"
_V5E = "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, 16 GB HBM, 819 GB/s"
_V5P = "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, 95 GB HBM, 2765 GB/s"
_V6E = "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, 32 GB HBM, 1640 GB/s"
DEVICES = {
    d.name: d
    for d in (
        Device("h100", "cuda", "h100_sxm", 1, 84942979072, 989e12, 3.35232e12, _NVIDIA),
        Device("h200", "cuda", "h200", 1, 151397597184, 989e12, 4.8e12, _NVIDIA),
        Device("v5e-1", "tpu", "v5e:1x1", 1, 16 * 10**9, 197e12, 819e9, _V5E),
        Device("v5e-8", "tpu", "v5e:2x4", 8, 16 * 10**9, 197e12, 819e9, _V5E),
        Device("v5p-1", "tpu", "v5p:1x1x1", 1, 95 * 10**9, 459e12, 2765e9, _V5P),
        Device("v5p-8", "tpu", "v5p:2x2x1", 4, 95 * 10**9, 459e12, 2765e9, _V5P),
        Device("v5p-64", "tpu", "v5p:4x4x2", 32, 95 * 10**9, 459e12, 2765e9, _V5P),
        Device("v6e-1", "tpu", "v6e:1x1", 1, 32 * 10**9, 918e12, 1640e9, _V6E),
        Device("v6e-8", "tpu", "v6e:2x4", 8, 32 * 10**9, 918e12, 1640e9, _V6E),
    )
}
# What each platform's compiler needs installed (requirements-compile.txt).
PACKAGES = {"tpu": ("libtpu", "jax[tpu]==0.10.2"), "cuda": ("jax_cuda12_plugin",
            "jax-cuda12-plugin[with-cuda]==0.10.2")}  # fmt: skip


def missing(platform: str) -> str | None:
    """None when `platform`'s compiler is installed, else what to install (a sentence)."""
    module, requirement = PACKAGES[platform]
    if importlib.util.find_spec(module) is not None:
        return None
    return (
        f"compiling for {platform} needs {requirement!r}: pip install -r requirements-compile.txt"
    )


def topology_devices(device: Device) -> list:
    """The devices of `device`'s slice, from a topology of the platform's compiler (no
    accelerator needed); RuntimeError naming the package when the compiler is absent."""
    from jax.experimental import topologies

    reason = missing(device.platform)
    if reason:
        raise RuntimeError(reason)
    if device.platform == "cuda":
        spec = (SPECS / f"{device.topology}.txtpb").read_text().splitlines(keepends=True)
        spec = "".join(x for x in spec if x.split(":")[0].strip() not in NEWER_FIELDS)
        topo = topologies.get_topology_desc("topo", "cuda", target_config=spec, topology="1x1x1")
        return list(topo.devices)
    # A compile-only libtpu: no lockfile (another process may hold one), no TPU metadata.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    dims = [int(x) for x in device.topology.split(":")[1].split("x")]
    bounds = {}
    if device.chips < 4:  # the default chips per host (2x2x1) refuses a smaller slice
        bounds = {"chips_per_host_bounds": (*dims, 1)[:3]}
    topo = topologies.get_topology_desc(platform="tpu", topology_name=device.topology, **bounds)
    return list(topo.devices)


def per_device_shape(x) -> tuple:
    """A placed ShapeDtypeStruct's (or array's) shape on one device."""
    sharding = getattr(x, "sharding", None)
    return tuple(sharding.shard_shape(x.shape)) if sharding is not None else tuple(x.shape)


def cache_shapes(state) -> set[tuple]:
    """Per-device shapes of a decode loop state's KV caches and recurrent states (the target's
    `cache.k/v/state`, the drafter's `ctx_k/ctx_v`); empty when `state` is none."""
    parts = [getattr(state, "cache", None), getattr(state, "ctx_k", None),
             getattr(state, "ctx_v", None)]  # fmt: skip
    return {per_device_shape(x) for x in jax.tree.leaves(parts) if np.ndim(x) >= 2}


_TPU_KERNEL = re.compile(r'custom_call_target="tpu_custom_call"')
_GPU_KERNEL = re.compile(r'custom_call_target="__gpu\$xla\.gpu\.triton"')


def kernel_resources(hlo: str) -> list[dict]:
    """Each Pallas kernel of a compiled program's HLO text, by name, with the resource figures
    its call reports (Triton: warps, stages, grid; Mosaic: the scoped VMEM it uses), counted per
    call. A Triton kernel's shared memory is not in the HLO: XLA refuses the compile when it
    passes the device's opt-in limit (RESOURCE_EXHAUSTED), which is the check."""
    rows: dict = {}
    for line in hlo.splitlines():
        tpu, gpu = _TPU_KERNEL.search(line), _GPU_KERNEL.search(line)
        if not (tpu or gpu):
            continue
        name = re.search(r'\b(?:kernel_)?name = "([\w.\-]+)"', line) or re.search(
            r'op_name="[^"]*?([\w.\-]+)/pallas_call', line
        )
        target = "tpu_custom_call" if tpu else "__gpu$xla.gpu.triton"
        key = (target, name.group(1) if name else None)
        row = rows.setdefault(key, {"name": key[1], "target": target, "count": 0})
        row["count"] += 1
        for field in ("num_warps", "num_stages", "grid_x", "grid_y", "grid_z", "num_ctas"):
            m = re.search(rf"\b{field} = (\d+)", line)  # Triton's backend config
            if m:
                row.setdefault(field, set()).add(int(m.group(1)))
        # Mosaic: the scoped VMEM (memory space 1) the compiled kernel uses
        m = re.search(r'"used_scoped_memory_configs":\[\{"memory_space":"1","offset":"\d+",'
                      r'"size":"(\d+)"', line)  # fmt: skip
        if m:
            row.setdefault("vmem_bytes", set()).add(int(m.group(1)))
    out = []
    for row in rows.values():
        out.append({k: sorted(v) if isinstance(v, set) else v for k, v in row.items()})
    return sorted(out, key=lambda r: (r["target"], r["name"] or ""))


def memory(compiled) -> dict:
    """A compiled program's memory per device (XLA's memory_analysis): argument, output, alias,
    temp and generated-code bytes, and `peak_bytes` (XLA's peak where it reports one, else
    argument + output - alias + temp)."""
    a = compiled.memory_analysis()
    out = {
        "argument": int(a.argument_size_in_bytes),
        "output": int(a.output_size_in_bytes),
        "alias": int(a.alias_size_in_bytes),
        "temp": int(a.temp_size_in_bytes),
        "generated_code": int(a.generated_code_size_in_bytes),
    }
    peak = int(getattr(a, "peak_memory_in_bytes", 0) or 0)
    out["peak_bytes"] = peak or out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


def cost(compiled, lowered) -> dict:
    """Flops and bytes accessed per device of one call of a compiled program (a while loop's
    body counted once), and `cost_source`: "compiled" (the executable's cost_analysis: TPU),
    "lowered" (the lowered module's), or, where both are empty (XLA's GPU executables),
    "hlo_cost_model" (XLA's HloCostAnalysis, as the CPU client runs it, over the compiled,
    optimised GPU HLO module: fusions as the GPU compiler made them; a custom call, so a
    Pallas kernel or a cuBLAS/cuDNN call, counts no flops there); None when none answers."""

    def hlo_cost_model():
        cpu = jax.devices("cpu")[0].client
        module = compiled.runtime_executable().hlo_modules()[0]
        return xla_client._xla.hlo_module_cost_analysis(cpu, module)

    getters = (("compiled", compiled.cost_analysis), ("lowered", lowered.cost_analysis),
               ("hlo_cost_model", hlo_cost_model))  # fmt: skip
    for source, get in getters:
        try:
            c = get()
        except Exception:  # noqa: BLE001  (an analysis the backend does not implement)
            c = None
        if isinstance(c, list):
            c = c[0] if c else None
        if c and c.get("flops"):
            return {"flops": float(c["flops"]), "bytes_accessed": float(c.get("bytes accessed",
                    0.0)), "cost_source": source}  # fmt: skip
    return {"flops": None, "bytes_accessed": None, "cost_source": None}
