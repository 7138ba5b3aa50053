"""The program lowered is the program run (issue 40): for one config and shape, the decode
programs `python -m infer.lower --platform=cpu` prints are, fingerprint for fingerprint
(`programs.fingerprint`: StableHLO and compiler options), the ones `python -m infer.generate`
compiles in its default mode (adaptive with lookup kinds on a CPU, the target's stop tokens,
invariance by dtype), and `--tree_nodes` reaches both alike.

A tiny Qwen3 target (random weights, a character ChatML tokenizer) and a random drafter of the
tiny training config (`_tiny_configs`), so the config infer.lower reads names the files
infer.generate loads.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from _chat_tokenizer import CHATML, char_tokenizer
from _tiny_configs import TINY_TARGET, write_tiny_config

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Reverse a string."
NEW_TOKENS = 8


def _env(cache: Path) -> dict:
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, "DFLASH_JAX_CACHE": str(cache)}


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> dict:
    """{config, target, drafter, bucket}: the tiny training config over a tiny HF target with
    weights and a tokenizer, its drafter saved (Orbax), and the prompt buffer width
    infer.generate pads PROMPT to."""
    import jax
    from _tiny_models import make_tiny_hf_target
    from ml_collections import config_flags  # noqa: F401  (the config file's loader)

    from dflash_jax import api
    from dflash_jax.io.drafter_io import save_drafter
    from dflash_jax.models.drafter import init_drafter_params
    from dflash_jax.training.trainer import drafter_config_for
    from infer import aot

    root = tmp_path_factory.mktemp("lowered_is_run")
    config = write_tiny_config(root)
    dims = {k: v for k, v in TINY_TARGET.items() if k not in ("model_type", "tie_word_embeddings")}
    target = make_tiny_hf_target(root, "qwen3", **{**dims, "eos_token_id": 2})
    tok = char_tokenizer(CHATML)
    tok.save_pretrained(target)
    text = config.read_text().replace(repr(str(root / "tiny_hf")), repr(str(target)))
    config.write_text(text)
    namespace: dict = {}
    exec(compile(text, str(config), "exec"), namespace)
    cfg = namespace["get_config"]()
    dcfg = drafter_config_for(cfg, aot.target_config(str(target), "float32"))
    save_drafter(root / "drafter", dcfg, init_drafter_params(dcfg, jax.random.key(1)))
    prompt = api.render_prompt(tok, PROMPT, True)
    bucket = api.bucket_length(len(prompt))
    return {"config": config, "target": target, "drafter": root / "drafter", "bucket": bucket,
            "cache": root / "cache"}  # fmt: skip


def _run(pair, module: str, *flags: str) -> subprocess.CompletedProcess:
    out = subprocess.run(
        [sys.executable, "-m", module, *flags], env=_env(pair["cache"]), cwd=ROOT,
        capture_output=True, text=True, check=False, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def generated(pair, *flags: str) -> dict:
    """infer.generate --json's program fingerprints."""
    out = _run(
        pair, "infer.generate", f"--target={pair['target']}", f"--drafter={pair['drafter']}",
        f"--prompt={PROMPT}", "--json", "--dtype=float32", f"--max_new_tokens={NEW_TOKENS}",
        "--compilation_cache=", "--notarget_cache", *flags,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])["program_fingerprints"]


def lowered(pair, *flags: str) -> dict:
    """infer.lower --platform=cpu's fingerprints, by program."""
    out = _run(
        pair, "infer.lower", f"--config={pair['config']}", "--platform=cpu", "--what=decode",
        "--batch=1", f"--prompt_len={pair['bucket']}", f"--max_new_tokens={NEW_TOKENS}",
        "--dtype=float32", *flags,
    )  # fmt: skip
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert all(line["ok"] for line in lines), lines
    if not flags:  # what infer.generate's default decode on a CPU is
        assert lines[0]["decode"]["adaptive_kinds"] == ["1", "4", "8", "-8"], lines  # block 8
        assert lines[0]["decode"]["stop_token_ids"] == [2], lines
    return {line["program"]: line["fingerprint"] for line in lines}


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags", [(), ("--tree_nodes=6",), ("--dtype=bfloat16",)], ids=["default", "tree", "bf16"]
)
def test_infer_lower_prints_the_programs_infer_generate_compiles(pair, flags):
    """Guards "the program lowered is the program run" alone (it compiles a real adaptive
    decode, ~1-2 min each on 2 cores): every program infer.generate compiled (the speculative
    halves and, for the adaptive decode's plain steps' calibration, the target alone's) has the
    fingerprint infer.lower prints for it; in fp32, with a tree, and in bf16, batch-invariant
    by dtype (the fixed row tile both build the same way)."""
    run = generated(pair, *flags)
    lower = lowered(pair, *flags)
    assert {"start_speculative", "advance_speculative"} <= set(run), run
    for name, fingerprint in run.items():
        assert lower[name] == fingerprint, (name, run, lower)


def test_acceptance_measures_chains_alone(pair, tmp_path):
    """`infer.acceptance --trees=` (chains only, the cheap way to measure tau) exits 0 and
    reports the chain against AR (issue 54: an empty tree list ended in a TypeError), on the
    tiny pair at 4 new tokens."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    out = tmp_path / "acc.json"
    _run(
        pair, "infer.acceptance", f"--target={pair['target']}", f"--drafter={pair['drafter']}",
        f"--dataset=jsonl:{prompts}", "--num_prompts=1", "--max_new_tokens=4", "--block_size=4",
        "--trees=", "--dtype=float32", "--notarget_cache", f"--output={out}",
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["chain4"], report
    assert report["results"]["chain4"]["outputs_identical"] == 1, report
    chain = report["results"]["chain4"]  # every step a drafted block, counted by proposer
    assert chain["steps_by_proposer"]["drafted"] == sum(chain["steps_by_proposer"].values()) > 0


def test_decisions_follow_the_platform_compiled_for(monkeypatch):
    """What infer.lower relies on to lower another platform's program from this CPU: the
    decode config's defaults (`api.generate_config(platform=)`), invariance by dtype and
    platform, and the tied head's CPU-only barrier follow the platform a program is traced
    for (`ops.platform.TARGET`), not this process's backend."""
    import types

    import jax
    import jax.numpy as jnp

    from dflash_jax import api
    from dflash_jax.config import TargetConfig
    from dflash_jax.decoding import programs
    from dflash_jax.models.target import unembedding_matrix
    from dflash_jax.ops import platform

    tcfg = TargetConfig("qwen3", 64, 32, 64, 2, 4, 2, 8, tie_word_embeddings=True,
                        eos_token_ids=(2,), dtype="bfloat16")  # fmt: skip
    target = types.SimpleNamespace(config=tcfg)
    drafter = types.SimpleNamespace(config=types.SimpleNamespace(block_size=32))
    cpu = api.generate_config(target, drafter, platform="cpu")
    tpu = api.generate_config(target, drafter, platform="tpu", tree_nodes=8)
    assert (cpu.block_size, cpu.adaptive, cpu.lookup_kinds) == (16, True, (8, 16))
    # Under a CPU's row rule (bf16 by default) the default kinds leave the plain step out
    # (`api.plain_steps_pay`); in fp32, or without the rule, it stays.
    assert cpu.step_kinds == (4, 8, 16)
    fp32 = types.SimpleNamespace(config=dataclasses.replace(tcfg, dtype="float32"))
    assert api.generate_config(fp32, drafter, platform="cpu").step_kinds == (1, 4, 8, 16)
    loose = api.generate_config(target, drafter, platform="cpu", batch_invariant=False)
    assert loose.step_kinds == (1, 4, 8, 16)
    assert api.generate_config(target, drafter, platform="cpu", block_size=4).step_kinds == (1, 4)
    assert (tpu.block_size, tpu.adaptive, tpu.lookup_kinds, tpu.tree_nodes) == (32, False, (), 8)
    assert cpu.stop_token_ids == tpu.stop_token_ids == (2,)

    params = {"embed_tokens": {"embedding": jnp.zeros((64, 32), jnp.bfloat16)}}
    barriers = {}
    for name in ("cpu", "tpu", "cuda"):
        monkeypatch.setattr(platform, "TARGET", name)
        jaxpr = str(jax.make_jaxpr(lambda p: unembedding_matrix(p, tcfg))(params))
        barriers[name] = "optimization_barrier" in jaxpr
        assert programs.default_invariant(tcfg) == (name == "cpu")
    assert barriers == {"cpu": True, "tpu": False, "cuda": False}
    # (TARGET is "cuda" here) a foreign platform's invariant program lowers here too: its row
    # rule is the fixed tile, nothing probed on the machine that decodes
    run = programs.run_target_config(tcfg, dataclasses.replace(tpu, batch_invariant=True))
    assert run.invariant_rows == (32, 32)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")  # a GPU process lowering cuda
    assert platform.is_this_process()


def test_train_program_takes_the_training_configs_distillation(tmp_path):
    """`infer.lower --what=train` lowers the step `train` runs (`trainer.step_settings`): a
    config with distillation (the target's top-k as soft labels) is another program than the
    same config without."""
    import jax

    from dflash_jax import sharding
    from infer import aot

    namespace: dict = {}
    config = write_tiny_config(tmp_path)
    exec(compile(config.read_text(), str(config), "exec"), namespace)
    cfg = namespace["get_config"]()
    cfg.batch_size, cfg.seq_len, cfg.num_anchors = 1, 32, 2
    mesh = sharding.make_mesh(1, 1, 1)
    texts = []
    for top_k in (0, 4):
        cfg.distill_top_k = top_k
        texts.append(aot.train_program(cfg, mesh, "xla").lower(jax.default_backend()).as_text())
    assert texts[0] != texts[1]
