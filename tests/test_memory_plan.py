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

import jax
import jax.numpy as jnp
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
         "--device=cpu", f"--output={output}"],
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


def _tiny_quantized(scheme: str):
    """(config, abstract params) of a two-layer qwen3 target, its layer kernels in `scheme`."""
    import jax
    import jax.numpy as jnp
    from _shapes import QWEN3_8B

    from dflash_jax.config import TargetConfig
    from dflash_jax.models.quantized import quantize_params
    from dflash_jax.models.target import init_params

    small = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4)
    cfg = TargetConfig(**{**QWEN3_8B, **small, "num_kv_heads": 2, "head_dim": 64})
    floats = jax.eval_shape(
        lambda: jax.tree.map(lambda w: w.astype(jnp.bfloat16), init_params(cfg, jax.random.key(0)))
    )
    return cfg, jax.eval_shape(lambda p: quantize_params(p, cfg, scheme), floats)


@pytest.mark.parametrize("scheme", ["int4", "int8"])
def test_plan_counts_quantized_params_as_xla_holds_them(scheme):
    """The plan's bytes of a quantized target's params are XLA's own (its memory_analysis of a
    program taking them): int4 at half a byte per value (XLA packs it; numpy's itemsize of 1
    counted the int4 kernels twice), int8 at one, their scales and offsets as stored."""
    import jax

    from infer.plan_bytes import per_device_bytes

    _, params = _tiny_quantized(scheme)
    compiled = jax.jit(lambda p: 0, keep_unused=True).lower(params).compile()
    held = compiled.memory_analysis().argument_size_in_bytes
    assert per_device_bytes(params) == held
    qvalues = [x for x in jax.tree.leaves(params) if x.dtype == scheme]
    values = sum(x.size for x in qvalues)
    assert values and per_device_bytes(qvalues) == values // (2 if scheme == "int4" else 1)


@pytest.mark.slow
def test_quantized_plan_books_the_copies_the_program_holds(tmp_path):
    """Guards only the quantized-copy line of a decode plan: under the row rule (bf16 on a CPU,
    and --batch_invariant anywhere) the compiled int4 advance program holds the float copies
    of its layer kernels that the plan books as held on every platform (the barrier on each
    dequantized kernel, ops/invariance.py), within 10%: its temporaries exceed the float
    target's by the kernels' bf16 size."""
    import importlib.util

    from dflash_jax import sharding
    from infer import aot
    from infer.plan_bytes import EVERYWHERE, dequantized_bytes, held_copies_row

    spec = importlib.util.spec_from_file_location("tiny_config", write_tiny_config(tmp_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    # One device, as the session has (aot.fake_mesh may only run before a backend starts).
    cfg, mesh, temps = module.get_config(), sharding.make_mesh(1, 1, 1), {}
    for scheme in (None, "int4"):
        shape = aot.DecodeShape(batch=1, prompt_len=16, max_new_tokens=32, quantize=scheme,
                                adaptive=False, batch_invariant=True)  # fmt: skip
        _, advance = aot.speculative_programs(cfg, mesh, shape, "xla", "cpu")
        compiled = advance.lower().compile(compiler_options=advance.options)
        temps[scheme] = compiled.memory_analysis().temp_size_in_bytes
    assert held_copies_row(advance.settings["invariant_rows"]) == EVERYWHERE
    booked = dequantized_bytes(advance.args[0], "bfloat16")
    assert 0.9 * booked <= temps["int4"] - temps[None] <= booked, (temps, booked)


def test_the_cpu_only_expert_copies_are_what_xla_cpu_holds():
    """XLA:CPU's ragged_dot (the MoE experts' products) holds a copy of each expert kernel,
    inside a loop or not: a program of two layers' bf16 experts has temporaries of at least
    `expert_kernel_bytes`, which the decode plan books as CPU-only (biases, 2-D, not counted)."""
    from infer.plan_bytes import expert_kernel_bytes

    e, d, f, r = 8, 64, 96, 32
    params = {f"layers_{i}": {"mlp": {"experts": {
        "gate_proj": jax.ShapeDtypeStruct((e, d, f), jnp.bfloat16),
        "down_proj": jax.ShapeDtypeStruct((e, f, d), jnp.bfloat16),
        "down_bias": jax.ShapeDtypeStruct((e, d), jnp.bfloat16),
    }}} for i in range(2)}  # fmt: skip
    assert expert_kernel_bytes(params, "bfloat16") == 2 * 2 * e * d * f * 2

    def layers(params, x_rd):
        sizes = jnp.full((e,), r // e, jnp.int32)
        for i in range(2):
            w = params[f"layers_{i}"]["mlp"]["experts"]
            h = jax.lax.ragged_dot(x_rd, w["gate_proj"], sizes).astype(x_rd.dtype)
            x_rd = jax.lax.ragged_dot(h, w["down_proj"], sizes).astype(x_rd.dtype)
        return x_rd

    x = jax.ShapeDtypeStruct((r, d), jnp.bfloat16)
    temp = jax.jit(layers).lower(params, x).compile().memory_analysis().temp_size_in_bytes
    assert temp >= expert_kernel_bytes(params, "bfloat16")
