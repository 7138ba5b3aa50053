r"""Lowers a config's real programs for a TPU or a GPU on this machine, before renting one.

  python -m infer.lower --platform=tpu --config=configs/qwen3_8b_b16.py --mesh=fsdp=4,tensor=2 \
      --what=decode
  python -m infer.lower --platform=tpu,cuda --what=decode,train --config=... --mesh=...

The programs are the ones the runs compile (`infer.aot`): for --what=decode the speculative
and the autoregressive decodes' two halves (start: prefill -> loop state; advance: the loop),
their decode config built by the runs' own builder (`api.generate_config`: the platform's
default block size and adaptive mode, lookup kinds, the target's stop tokens, --tree_nodes,
batch invariance by dtype and platform), for --what=train every program a training run
compiles: the step (`train_step`) with the training config's full settings
(`trainer.step_settings`) and, with the config's eval_every, the held-out metric
(`heldout_metrics`) and the greedy evaluation decode (`eval_decode`, its prompt buffer
--prompt_len wide, the config's eval_max_new_tokens), all with shape-only params, caches and
batches placed on a mesh of fake CPU devices by the sharding table (one device: unplaced, as a
run without --mesh). Each is traced for the platform (`ops.platform.TARGET`: the kernels
`ops.dispatch` picks there, the CPU-only barriers left out elsewhere), lowered to StableHLO,
and one JSON line per program goes to stdout:

  {"program": "advance_speculative", "what": "decode", "platform": "cuda", "ok": true,
   "error": null, "custom_calls": {"__gpu$xla.gpu.triton": 41},
   "kernels": [{"name": "dflash_attention_fwd", "target": "__gpu$xla.gpu.triton", "count": 41,
                "outside_shard_map": 0}], "fingerprint": "3f0c...", "seconds": 1.2, ...}

(a call site counts once per layer: 41 = Qwen3-8B's 36 target layers + the drafter's 5).
`collectives` lists the collectives the program states, those of its `shard_map`s (a MoE's
all-to-all token dispatch: [{"kind": "all_to_all", "bytes": 16384, "count": 48}, ..]), by
kind and per-device operand bytes, counted per call site like the kernels (in an advance
program's loop: per step). GSPMD's own collectives (the all-reduces of a tensor-split matmul,
an all-gather of a weight) are chosen when XLA partitions the program, which needs its
compiler: they do not show here.
A decode program's line also says what it was built with (`decode`: block size, adaptive
kinds, tree, stop tokens, row rule, dtype). `fingerprint` (`programs.fingerprint`: the
StableHLO and the compiler options) is what `infer.generate --json` prints in
`program_fingerprints` for the programs it compiled: with --platform=cpu and the same config
and shapes (--batch=1, --prompt_len= the prompt's bucket, --dtype= the one it ran) the two are
equal.

A program fails (ok false, its error in the line, and the command exits 1) when lowering raises
(jax refuses to partition a Mosaic kernel, a kernel refuses a shape) or, on a mesh of more than
one device, when a kernel call lies outside a `shard_map` over every mesh axis in use: GSPMD
cannot split a Mosaic or Triton custom call, so it would gather the call's operands onto every
device. Shard_map regions are recognised as Shardy's `sdy.manual_computation` (jax's default
partitioner).

Lowering is not compiling: what only XLA's TPU or GPU compiler finds (VMEM or shared memory
limits, Mosaic layouts, what the pipelines do to the caches in the loop, GSPMD's collectives)
shows only when the program is compiled for the device. --device=NAME does that on this machine,
with no accelerator, through XLA's own compilers (requirements-compile.txt; `infer.devices`):

  python -m infer.lower --device=h200 --what=decode,train --config=configs/qwen3_8b_b16.py
  python -m infer.lower --device=v5p-8 --mesh=fsdp=4 --what=decode --config=...

A deviceless H100 or H200 (CUDA: XLA, Triton, ptxas) or a TPU slice (v5e-8, v5p-8, v6e-8, v5p-64
and one-chip v5e-1, v5p-1, v6e-1: XLA and Mosaic), the mesh made of the slice's chips (--mesh;
empty: one chip, its arguments unplaced as a run without --mesh). Each line adds `compiled`,
`device_kind`, `memory` (argument, output, alias, temp and generated-code bytes per device and
`peak_bytes`), `device_bytes`, `flops` and `bytes_accessed` per device and call (a loop's body
once; `cost_source` says whose analysis: on GPU XLA's cost model over the compiled HLO, custom
calls uncounted), `cache_copies_in_loop` (copies of a KV cache or recurrent state, by its
per-device shape, inside the compiled loop bodies: `hlo_scan`; null for a program with no
cache), `compiled_custom_calls`, and each kernel's `compiled` resources (Triton's warps, stages
and grid; Mosaic's scoped VMEM). A compile the compiler refuses, or a peak above the device's
memory, is an error (exit 1).
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections import Counter

import jax
from absl import app, flags
from jax.interpreters.mlir import ir
from ml_collections import config_flags

from dflash_jax.config import ATTENTION_IMPLS
from dflash_jax.ops import platform as ops_platform
from infer import aot, cli, devices, distributed  # noqa: F401  (distributed: --mesh)
from infer.hlo_scan import copies_of_shapes_in_loop

PLATFORMS = ("tpu", "cuda", "cpu")
WHATS = ("decode", "train")
# custom-call targets of Pallas kernels (Mosaic TPU, Triton, Mosaic GPU): calls GSPMD cannot
# partition.
KERNEL_TARGETS = frozenset(
    ("tpu_custom_call", "__gpu$xla.gpu.triton", "triton_kernel_call_ffi", "mosaic_gpu_v2")
)
# StableHLO collectives, as the `collectives` field names them.
COLLECTIVES = frozenset(
    ("all_to_all", "all_gather", "all_reduce", "reduce_scatter", "collective_permute",
     "collective_broadcast")
)  # fmt: skip

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None, "Training config (configs/*.py): the target, the drafter and the train batch."
)
flags.DEFINE_list(
    "platform", ["tpu", "cuda"],
    f"Platforms to lower for, comma-separated, of {', '.join(PLATFORMS)} ('cuda': NVIDIA GPUs; "
    "'cpu': this machine, whose program fingerprints infer.generate --json also prints).",
)  # fmt: skip
flags.DEFINE_list(
    "what", ["decode", "train"],
    "Programs to lower, comma-separated: 'decode' (the speculative and the autoregressive "
    "decodes, start and advance halves), 'train' (every program a training run compiles: the "
    "step and, with the config's eval_every, the held-out metric and the evaluation decode, its "
    "prompts --prompt_len wide).",
)  # fmt: skip
flags.DEFINE_enum(
    "attention_impl", "auto", list(ATTENTION_IMPLS),
    "Attention as the run would choose it on the platform: 'auto' (the run's default: Pallas "
    "kernels on GPU and TPU where they take the shapes, else xla), 'pallas' (kernels or a "
    "refusal), 'xla' (no kernels).",
)  # fmt: skip
flags.DEFINE_enum(
    "device", None, list(devices.DEVICES),
    "Compile for this accelerator too, with XLA's own compiler for it and no accelerator here "
    "(requirements-compile.txt): a deviceless H100/H200 (CUDA, Triton, ptxas) or a TPU slice "
    "(libtpu, Mosaic; v5p-8 = 4 chips). The mesh (--mesh, empty: one chip) is made of its "
    "chips, --platform is the device's, and each line adds the compiled figures: memory per "
    "device, flops, bytes, the loop's cache copies, the kernels. Exit 1 also when a program "
    "does not compile or needs more than the device's memory.",
)  # fmt: skip
aot.define_shape_flags(flags)
flags.mark_flag_as_required("config")
for _name, _choices in (("platform", PLATFORMS), ("what", WHATS)):
    flags.register_validator(
        _name,
        lambda values, choices=_choices: bool(values) and set(values) <= set(choices),
        f"--{_name} takes a comma-separated list of {', '.join(_choices)}",
    )


def _kernel_name(op) -> str | None:
    """A kernel call's name: Mosaic's `kernel_name`, Triton's backend_config `name`."""
    attrs = op.attributes
    if "kernel_name" in attrs:
        return ir.StringAttr(attrs["kernel_name"]).value
    for key in ("mhlo.backend_config", "backend_config"):
        if key in attrs and isinstance(attrs[key], ir.DictAttr) and "name" in attrs[key]:
            return ir.StringAttr(attrs[key]["name"]).value
    return None


def _count_ops(module, key_of) -> Counter:
    """key_of(op, mesh axes in manual mode there) -> count over a lowered StableHLO module's
    ops (None: not counted); an op inside a private function counts once per call site."""
    funcs = {
        ir.StringAttr(op.attributes["sym_name"]).value: op.operation
        for op in module.body.operations
        if op.operation.name == "func.func"
    }
    held: dict[tuple[str, frozenset], Counter] = {}  # (function, manual axes) -> its counts

    def walk(op, manual: frozenset, found: Counter) -> None:
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    inner = manual
                    key = key_of(child, manual)
                    if key is not None:
                        found[key] += 1
                    if child.name == "sdy.manual_computation":  # a shard_map
                        axes = str(child.attributes["manual_axes"])
                        inner = manual | set(re.findall(r'"(\w+)"', axes))
                    elif child.name == "func.call":
                        key = (ir.FlatSymbolRefAttr(child.attributes["callee"]).value, manual)
                        if key not in held:
                            held[key] = Counter()
                            walk(funcs[key[0]], manual, held[key])
                        found.update(held[key])
                    walk(child, inner, found)

    found: Counter = Counter()
    walk(funcs["main"], frozenset(), found)
    return found


def custom_calls(module) -> Counter:
    """(target, kernel name or None, mesh axes in manual mode there) -> count, over a lowered
    StableHLO module; a call inside a private function counts once per call site."""

    def key_of(op, manual):
        if op.name != "stablehlo.custom_call":
            return None
        target = ir.StringAttr(op.attributes["call_target_name"]).value
        return (target, _kernel_name(op), manual)

    return _count_ops(module, key_of)


def collectives(module) -> list[dict]:
    """The collectives a lowered program states (those of its `shard_map`s: the MoE's
    all-to-all dispatch, psums), by kind and per-device operand bytes, each with its count
    (per call site: a layer's counts once per layer; in a loop, once per step). GSPMD's own
    collectives appear only when XLA partitions the program (compiling), not here."""

    def key_of(op, manual):
        kind = op.name.removeprefix("stablehlo.")
        if op.name == kind or kind not in COLLECTIVES:
            return None
        sizes = (ir.ShapedType(x.type) for x in op.operands)
        nbytes = sum(math.prod(t.shape) * (t.element_type.width // 8) for t in sizes)
        return (kind, nbytes)

    found = _count_ops(module, key_of)
    return [
        {"kind": kind, "bytes": nbytes, "count": count}
        for (kind, nbytes), count in sorted(found.items())
    ]


def report(found: Counter, mesh) -> dict:
    """The JSON fields of one lowered program: custom calls by target, kernels by name with the
    calls outside a shard_map over every mesh axis of size > 1, and the error those make."""
    split = {name for name, size in mesh.shape.items() if size > 1}
    by_target: Counter = Counter()
    kernels: dict = {}
    for (target, name, manual), count in found.items():
        by_target[target] += count
        if target not in KERNEL_TARGETS:
            continue
        row = kernels.setdefault(
            (target, name), {"name": name, "target": target, "count": 0, "outside_shard_map": 0}
        )
        row["count"] += count
        row["outside_shard_map"] += 0 if split <= manual else count
    outside = [k for k in kernels.values() if k["outside_shard_map"]]
    error = None
    if outside:
        calls = ", ".join(
            f"{k['outside_shard_map']} x {k['name']} ({k['target']})" for k in outside
        )
        error = (
            f"kernel calls outside a shard_map over the mesh axes {sorted(split)}: {calls}; "
            "GSPMD cannot partition a custom call and would gather its operands onto every device"
        )
    return {
        "custom_calls": dict(sorted(by_target.items())),
        "kernels": sorted(kernels.values(), key=lambda k: (k["target"], k["name"] or "")),
        "error": error,
    }


def lower_one(program: aot.Program, platform: str, mesh, device=None) -> dict:
    """Lowers `program` for `platform` and, with `device` (`devices.Device`, `mesh` made of
    its chips), compiles it for that device. -> {ok, error, custom_calls, kernels, fingerprint,
    seconds} and with a device `compiled` and the compiled figures (`compiled_fields`)."""
    t0 = time.perf_counter()
    lowered = None
    try:
        lowered = program.lower(None if device else platform, mesh)
        module = lowered.compiler_ir("stablehlo")
        out = report(custom_calls(module), mesh)
        out["collectives"] = collectives(module)
        out["fingerprint"] = program.fingerprint(lowered)
    except Exception as e:  # noqa: BLE001  (any failure is the finding, reported in the line)
        out = {"custom_calls": None, "kernels": None, "collectives": None}
        out["error"] = f"{type(e).__name__}: {e}"
    if device is not None:
        out.update(compiled_fields(program, lowered, device, mesh, out))
    seconds = round(time.perf_counter() - t0, 2)
    return {"ok": out["error"] is None, "error": out.pop("error"), **out, "seconds": seconds}


def compiled_fields(program: aot.Program, lowered, device, mesh, lowered_out: dict) -> dict:
    """`lowered` compiled for `device`: compiled, device_kind, memory (bytes per device,
    `devices.memory`), device_bytes, flops and bytes_accessed (`devices.cost`), the copies of
    a KV cache or recurrent state in its loops' bodies (None: the program carries no cache),
    the kernels with their compiled resources; an error when it does not compile or needs more
    memory than the device has."""
    out = {"compiled": False, "device_kind": mesh.devices.flat[0].device_kind,
           "device_bytes": device.memory_bytes}  # fmt: skip
    if lowered is None:
        return out
    try:
        compiled = lowered.compile(compiler_options=program.options)
        hlo = compiled.as_text()
    except Exception as e:  # noqa: BLE001  (the compiler's refusal is the finding)
        before = f"{lowered_out['error']}; " if lowered_out.get("error") else ""
        return {**out, "error": f"{before}compile: {type(e).__name__}: {e}"}
    out.update(compiled=True, memory=devices.memory(compiled), **devices.cost(compiled, lowered))
    targets = Counter(re.findall(r'custom_call_target="([^"]+)"', hlo))
    out["compiled_custom_calls"] = dict(sorted(targets.items()))
    shapes = devices.cache_shapes(_loop_state(program))
    out["cache_copies_in_loop"] = copies_of_shapes_in_loop(hlo, shapes) if shapes else None
    found = {(k["target"], k["name"]): k for k in devices.kernel_resources(hlo)}
    out["kernels"] = [
        {**k, "compiled": {f: v for f, v in found.get((k["target"], k["name"]), {}).items()
                           if f not in ("name", "target")}}
        for k in lowered_out.get("kernels") or []
    ]  # fmt: skip
    peak, have = out["memory"]["peak_bytes"] / 2**30, device.memory_bytes / 2**30
    if peak > have and lowered_out.get("error") is None:
        out["error"] = f"needs {peak:.2f} GiB per device, {device.name} has {have:.2f} GiB"
        if program.name == "train_step":  # what a user changes to fit it (docs/training.md)
            out["error"] += (
                ": fewer rows at once (--config.grad_accum_steps=k runs the batch in k "
                "micro-batches) or more chips (--mesh)"
            )
    return out


def _loop_state(program: aot.Program):
    """The decode loop state a program carries (an evaluation decode's, kept by `infer.aot`
    with its per-device shapes; an advance's last argument; a start's result), or None (the
    training programs)."""
    from dflash_jax.decoding.state import LoopState

    if program.loop_state is not None:
        return program.loop_state()
    if program.args and isinstance(program.args[-1], LoopState):
        return program.args[-1]
    if program.name.startswith("start_"):
        return program.fn.eval_shape(*program.args, **program.statics)
    return None


def programs(what: str, mesh, platform: str) -> list[aot.Program]:
    """The programs --what=`what` names for the flags' config, shapes and attention, as a run
    on `platform` builds them (`aot.decode_setup`)."""
    cfg, impl = FLAGS.config, FLAGS.attention_impl
    shape = aot.shape_from_flags(FLAGS)
    if what == "train":
        return aot.train_programs(cfg, mesh, impl, shape.prompt_len)
    return [
        *aot.speculative_programs(cfg, mesh, shape, impl, platform),
        *aot.autoregressive_programs(cfg, mesh, shape, impl, platform),
    ]


def _mesh(device):
    """The mesh --mesh describes: over fake CPU devices, or with `device` over its chips."""
    if device is None:
        return aot.fake_mesh(FLAGS.mesh)
    try:
        return aot.chip_mesh(FLAGS.mesh, device)
    except RuntimeError as e:
        raise app.UsageError(f"--device={device.name}: {e}") from e


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    device = devices.DEVICES[FLAGS.device] if FLAGS.device else None
    platforms = FLAGS.platform if device is None else [device.platform]
    if device is not None and FLAGS["platform"].present and FLAGS.platform != platforms:
        raise app.UsageError(
            f"--platform={','.join(FLAGS.platform)} with --device="
            f"{device.name}: that device is {device.platform}; drop --platform"
        )
    try:
        mesh = _mesh(device)
    except ValueError as e:
        raise app.UsageError(f"--mesh: {e}") from e
    spec = ",".join(f"{k}={v}" for k, v in mesh.shape.items())
    failed = 0
    for platform in platforms:
        ops_platform.TARGET = platform  # what traced code decides by (kernels, barriers)
        jax.clear_caches()  # traces made for another platform hold its kernels
        for what in FLAGS.what:
            head = {"what": what, "platform": platform, "mesh": spec}
            head["attention_impl"] = FLAGS.attention_impl
            if device is not None:
                head["device"] = device.name
            if what == "decode":
                head["shape"] = {"batch": FLAGS.batch, "prompt_len": FLAGS.prompt_len,
                                 "max_new_tokens": FLAGS.max_new_tokens}  # fmt: skip
            try:
                lines = [
                    {"program": program.name, **head,
                     **lower_one(program, platform, mesh, device),
                     **({"decode": program.settings} if program.settings else {})}
                    for program in programs(what, mesh, platform)
                ]  # fmt: skip
            except Exception as e:  # noqa: BLE001  (a refusal while tracing is a finding too)
                lines = [
                    {"program": what, **head, "ok": False, "error": f"{type(e).__name__}: {e}"}
                ]
            for line in lines:
                failed += not line["ok"]
                print(json.dumps(line), flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    cli.run(main)
