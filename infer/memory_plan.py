r"""Per-device memory of a training step or a decode on a device mesh, planned on this CPU.

  python -m infer.memory_plan --mode=train --config=configs/qwen3_8b_b16.py --mesh=fsdp=8
  python -m infer.memory_plan --mode=decode --config=configs/qwen3_8b_b16.py --mesh=data=1 \
      --batch=32 --prompt_len=1024 --max_new_tokens=1024 --output=plan.json

Nothing is allocated: the mesh is made of fake CPU devices, and the programs are the ones the
runs call (`infer.aot`) on shape-only params, optimizer state, caches and batches placed by the
same sharding table, compiled ahead of time: the training step (`train_step_on_mesh`, the
training config's settings in full), or the decode's two halves as `infer.generate` runs them
on --platform (start: prefill -> loop state; advance: the loop, the state donated; the decode
config from `api.generate_config`, that platform's defaults: on cuda and tpu the trained block,
fixed, not batch-invariant).
Per device it prints params, optimizer state, caches (the decode loop's carry: KV caches, drafter
context caches and token buffers), the batch and activations (the compiled programs'
temporaries, from XLA's memory_analysis; for a decode the larger of the two halves'). The loop
state is an output of start and the donated argument of advance, so no program's temporaries
hold it (planning the whole decode as one program did: its caches are made inside, and were
counted twice). The temporaries are the CPU compiler's; a GPU build fuses and schedules
differently, and `--attention_impl=xla` (the default on XLA:CPU) materialises attention scores that
the Pallas kernels of a GPU run never hold, so that line is an upper bound. A program traced
for --platform gets the CPU decode's 16-bit rewrites here (`ops.platform.CPU_COMPILES`: a bf16
cache scattered as its bits, the same bits), or XLA:CPU would count an f32 copy of every cache a
scatter writes, which no TPU or GPU makes. `--output` also
writes XLA's own figures for each program (argument, output, aliased and temporary bytes).

With the platform's own compiler installed (requirements-compile.txt, `infer.devices`) the
programs are compiled by it instead, for a device without owning one (--device, by default the
--platform's device whose chip count is the mesh's: h200 for cuda on one device; v5p-1, v5p-8,
v5p-64 for tpu on 1, 4, 32): the temporaries are then XLA:GPU's or XLA:TPU's own, with no
XLA:CPU-only copies to set apart. `--device=cpu` keeps XLA:CPU. The plan says which compiled it.

The target's shapes come from a local HF directory's config.json, a GGUF file (the embedded
smollm2-135m-instruct) or, offline, from `infer.aot.KNOWN_TARGETS` for the hub ids of configs/*.py.
"""

from __future__ import annotations

import json
import sys

from absl import app, flags
from ml_collections import config_flags

from infer import aot, cli, devices, distributed  # noqa: F401  (distributed: --mesh)
from infer.plan_bytes import (
    CPU_ONLY,
    EVERYWHERE,
    dequantized_bytes,
    expert_kernel_bytes,
    held_copies_row,
    per_device_bytes,
)

ACTIVATIONS = "activations (temporaries)"

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file(
    "config", None,
    "Training config (configs/*.py): the target, the drafter and, for --mode=train, the batch.",
)  # fmt: skip
flags.DEFINE_enum("mode", "train", ["train", "decode"], "Plan a training step or a decode.")
aot.define_shape_flags(flags)
flags.DEFINE_enum(
    "attention_impl", "auto", ["auto", "xla", "pallas"],
    "Attention lowered for the plan: 'auto' is the run's choice (Pallas kernels where they take "
    "the shapes) when a device's compiler compiles the plan, and 'xla' on XLA:CPU; 'pallas' on "
    "XLA:CPU runs the kernels' interpret mode (slow).",
)  # fmt: skip
flags.DEFINE_enum(
    "platform", "cuda", ["cuda", "tpu", "cpu"],
    "--mode=decode: the platform whose run is planned: its decode (api.generate_config's "
    "defaults there: block size, adaptive, batch invariance) traced as for it "
    "(ops.platform.TARGET), then compiled by XLA:CPU for the figures. With "
    "--attention_impl=pallas on XLA:CPU only cpu (the kernels' interpret mode).",
)  # fmt: skip
flags.DEFINE_string(
    "device", "auto",
    "Which compiler the figures come from: a device of infer.devices (" + ", ".join(devices.DEVICES)
    + ": its own XLA compiler, without the accelerator; requirements-compile.txt), 'cpu' (XLA:CPU, "
    "its CPU-only copies set apart), or 'auto': --platform's device with the mesh's chip count "
    "when that compiler is installed (cuda: h200 on one device; tpu: v5p-1/-8/-64), else cpu.",
)  # fmt: skip
flags.DEFINE_bool("compile", True, "Compile for the activations line (slow for big models).")
flags.DEFINE_float("device_gb", 141.0, "Memory of one device in GB (1e9 bytes); H200: 141.")
flags.DEFINE_string(
    "output", "",
    "Also write the plan as JSON here: bytes and GiB per row, the totals, the shapes, and XLA's "
    "memory_analysis of each compiled program.",
)  # fmt: skip
flags.mark_flag_as_required("config")


def pick_device(flag: str, platform: str, chips: int) -> devices.Device | None:
    """The device whose compiler gives the figures (None: XLA:CPU) for --device=`flag`, a
    decode planned for `platform` (None for training: any) on a mesh of `chips` devices;
    ValueError naming the fix when the named one cannot be used."""
    if flag == "cpu":
        return None
    if flag != "auto":
        if flag not in devices.DEVICES:
            raise ValueError(f"--device={flag}: not one of cpu, auto, {', '.join(devices.DEVICES)}")
        device = devices.DEVICES[flag]
        if device.chips != chips:
            raise ValueError(f"--device={flag} has {device.chips} chips, the mesh {chips}: "
                             f"give --mesh a size of {device.chips}")  # fmt: skip
        if reason := devices.missing(device.platform):
            raise ValueError(f"--device={flag}: {reason}")
        return device
    auto = {("cuda", 1): "h200", ("tpu", 1): "v5p-1", ("tpu", 4): "v5p-8", ("tpu", 32): "v5p-64"}
    name = auto.get((platform or "cuda", chips))
    if name is None or devices.missing(devices.DEVICES[name].platform):
        return None
    return devices.DEVICES[name]


def _analyses(programs: list[aot.Program], mesh, device) -> dict | None:
    """XLA's memory_analysis of each compiled program (bytes per device), compiled by
    `device`'s compiler (None: XLA:CPU), or None without --compile."""
    if not FLAGS.compile:
        return None
    out = {}
    for program in programs:
        lowered = program.lower(mesh=mesh)
        a = lowered.compile(compiler_options=program.options).memory_analysis()
        out[program.name] = {
            "argument": int(a.argument_size_in_bytes),
            "output": int(a.output_size_in_bytes),
            "alias": int(a.alias_size_in_bytes),
            "temp": int(a.temp_size_in_bytes),
        }
    return out


def _temporaries(analyses: dict | None) -> int | None:
    return None if analyses is None else max(a["temp"] for a in analyses.values())


def plan_train(cfg, mesh, device) -> tuple[dict, dict | None]:
    """-> (rows in bytes per device, with "shape"; XLA's figures for the step, compiled by
    `device`'s compiler or XLA:CPU)."""
    if device is not None:  # traced as for that platform (its kernels), as infer.lower does
        from dflash_jax.ops import platform as ops_platform

        ops_platform.TARGET = device.platform
    step = aot.train_program(cfg, mesh, FLAGS.attention_impl)
    state, target, batch = step.args
    analyses = _analyses([step], mesh, device)
    b, s, n = cfg.batch_size, cfg.seq_len, cfg.num_anchors
    return {
        "params (target, frozen)": per_device_bytes(target),
        "params (drafter, fp32 master)": per_device_bytes(state["params"]),
        "optimizer state": per_device_bytes(state["opt_state"]),
        "caches": 0,
        "batch": per_device_bytes(batch),
        ACTIVATIONS: _temporaries(analyses),
        "shape": f"batch {b} x {s} tokens, {n} anchors, block {cfg.block_size}",
    }, analyses


def plan_decode(cfg, mesh, device) -> tuple[dict, dict | None]:
    """-> (rows in bytes per device, with "shape"; XLA's figures for start and advance, compiled
    by `device`'s compiler or XLA:CPU)."""
    from dflash_jax.ops import platform as ops_platform

    if FLAGS.attention_impl == "pallas" and FLAGS.platform != "cpu" and device is None:
        raise ValueError(
            f"--attention_impl=pallas with --platform={FLAGS.platform} compiled by XLA:CPU: that "
            "platform's kernels need its compiler (requirements-compile.txt, --device); plan "
            "with xla or --platform=cpu (interpret mode)"
        )
    shape = aot.shape_from_flags(FLAGS)
    ops_platform.TARGET = FLAGS.platform  # traced as for that run (its kernels, its barriers)
    # compiled by XLA:CPU: its 16-bit workarounds apply; by the device's compiler: none
    ops_platform.CPU_COMPILES = device is None
    start, advance = aot.speculative_programs(
        cfg, mesh, shape, FLAGS.attention_impl, FLAGS.platform
    )
    target, drafter, prompt, lengths = advance.args[:4]
    state = advance.args[-1]  # start's output: the loop carry
    analyses = _analyses([start, advance], mesh, device)
    plan = {
        "params (target)": per_device_bytes(target),
        "params (drafter)": per_device_bytes(drafter),
        "optimizer state": 0,
        "caches (loop carry)": per_device_bytes(state),
        "batch": per_device_bytes((prompt, lengths)),
        ACTIVATIONS: _temporaries(analyses),
        "shape": f"batch {shape.batch}, prompt {shape.prompt_len} + {shape.max_new_tokens} new "
        f"tokens, block {shape.block_size or cfg.block_size}, {shape.dtype}",
    }
    if FLAGS.compile and shape.quantize and shape.quantize != "mxfp4":
        # gpt-oss's MXFP4 experts (dequantized inside each expert product) left the
        # temporaries as the bf16 target's, to the byte (gpt-oss-20b, batch 8, 1024 + 1024:
        # 54.01 GiB both): no copy to count.
        plan[held_copies_row(advance.settings["invariant_rows"])] = dequantized_bytes(
            target, shape.dtype
        )
    other_scheme = bool(shape.quantize) and shape.quantize != "mxfp4"  # its copies booked above
    if device is not None:  # the device's own compiler: no XLA:CPU copies to set apart
        return plan, analyses
    if FLAGS.compile and (experts := expert_kernel_bytes(target, shape.dtype, not other_scheme)):
        # XLA:CPU's ragged_dot copies every expert kernel (`plan_bytes.expert_kernel_bytes`);
        # a quantized one's dequantized copy is that copy (mxfp4 left the temporaries as bf16's)
        plan[CPU_ONLY] = plan.get(CPU_ONLY, 0) + experts
    if FLAGS.compile and shape.dtype == "bfloat16":
        # XLA:CPU gathers bf16 rows in f32: the embedding is converted whole, once, out of the
        # loop (Qwen3-8B: an f32[151936,4096] copy, 2.32 GiB, in the decode's buffer
        # assignment); TPU and GPU gather bf16 as it is.
        embedding = target["embed_tokens"]["embedding"]
        plan[CPU_ONLY] = plan.get(CPU_ONLY, 0) + 2 * per_device_bytes(embedding)
    return plan, analyses


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    import math

    import jax

    from dflash_jax.config import ConfigError

    try:
        chips = math.prod(aot.mesh_sizes(FLAGS.mesh))
    except ValueError as e:
        raise app.UsageError(f"--mesh: {e}") from e
    try:
        device = pick_device(FLAGS.device, FLAGS.platform if FLAGS.mode == "decode" else None,
                             chips)  # fmt: skip
    except ValueError as e:
        raise app.UsageError(str(e)) from e
    if device is not None and FLAGS.mode == "decode" and FLAGS.platform != device.platform:
        raise app.UsageError(f"--device={device.name} is {device.platform}, --platform="
                             f"{FLAGS.platform}: give --platform={device.platform}")  # fmt: skip
    if FLAGS.attention_impl == "auto" and device is None:
        FLAGS.attention_impl = "xla"  # XLA:CPU: the kernels would run in interpret mode
    mesh = aot.fake_mesh(FLAGS.mesh) if device is None else aot.chip_mesh(FLAGS.mesh, device)
    device_gb = device.memory_bytes / 1e9 if device and not FLAGS["device_gb"].present else None
    if device_gb is not None:
        FLAGS.device_gb = device_gb
    backend = (f"XLA:{device.platform.upper().replace('CUDA', 'GPU')} for {device.name} "
               f"({mesh.devices.flat[0].device_kind}, compiled without one)" if device else
               "XLA:CPU")  # fmt: skip
    cfg = FLAGS.config
    try:
        plan, analyses = (plan_train if FLAGS.mode == "train" else plan_decode)(cfg, mesh, device)
    except (ConfigError, ValueError, OSError) as e:
        raise app.UsageError(f"{type(e).__name__}: {e}") from e
    shape = plan.pop("shape")
    cpu_only = plan.pop(CPU_ONLY, 0)
    everywhere = plan.pop(EVERYWHERE, 0)
    total = sum(v for v in plan.values() if v is not None)
    totals = {"total per device": total}
    if cpu_only:
        totals["total less the CPU-only copies"] = total - cpu_only
    gib = lambda n: "n/a" if n is None else f"{n / 2**30:.2f} GiB"
    fits = lambda n: n <= FLAGS.device_gb * 1e9
    count = mesh.devices.size
    print(f"{FLAGS.mode} {cfg.target} on mesh {dict(mesh.shape)} ({count} devices): {shape}")
    print(f"  compiled by {backend}" if FLAGS.compile else "  not compiled (--nocompile)")
    for name, value in plan.items():
        print(f"  {name:38s}{gib(value):>12s}")
    if everywhere:
        print(f"    {EVERYWHERE:36s}{gib(everywhere):>12s}")
    if cpu_only:
        print(f"    {CPU_ONLY:36s}{gib(cpu_only):>12s}")
    for name, value in totals.items():
        verdict = "fits" if fits(value) else "does NOT fit"
        print(f"  {name:38s}{gib(value):>12s}  ({verdict} in {FLAGS.device_gb:g} GB)")
    if FLAGS.output:
        of = {EVERYWHERE: everywhere, CPU_ONLY: cpu_only}
        rows = {**plan, **{k: v for k, v in of.items() if v}, **totals}
        out = {
            "command": " ".join(
                ["python -m infer.memory_plan"]
                + [arg for arg in sys.argv[1:] if not arg.startswith("--output")]
            ),
            "mode": FLAGS.mode,
            "target": cfg.target,
            "mesh": dict(mesh.shape),
            "shape": shape,
            "attention_impl": FLAGS.attention_impl,  # as compiled ("auto": the run's choice)
            "bytes_per_device": rows,
            "gib_per_device": {
                k: None if v is None else round(v / 2**30, 2) for k, v in rows.items()
            },
            "device_gb": FLAGS.device_gb,
            "fits": {k: fits(v) for k, v in totals.items()},
            "xla_memory_analysis": analyses,
            "backend": f"{backend}, jax {jax.__version__}",
            "device": device.name if device else "cpu",
        }
        with open(FLAGS.output, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    cli.run(main)
