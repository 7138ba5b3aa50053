# ruff: noqa: E402  (XLA_FLAGS must be set before jax starts)
"""Two real processes on localhost (jax.distributed, gloo CPU collectives, 2 CPU devices each):
greedy decoding and a short training run over the 4 devices give the tokens and losses of one
process on one device. Each process loads the target shard by shard, feeds its own rows of
every batch, and writes its part of the Orbax checkpoints; process 0 alone logs and exports.

    python -m pytest -m slow tests/test_multihost.py
"""

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

DEVICES_PER_PROCESS = 2
if __name__ == "__main__":
    flag = f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    os.environ["JAX_PLATFORMS"] = "cpu"

import jax
import numpy as np
import pytest

NUM_PROCESSES = 2
DECODE_MESH = "data=2,tensor=2"
TRAIN_MESH = "data=2,fsdp=2"
TIMEOUT_S = 600


def _decode(mesh=None) -> list[list[int]]:
    from _decode import LENS8, PROMPT8, make_pair

    from dflash_jax.decoding import speculative_decode
    from dflash_jax.decoding.settings import DecodeConfig

    tcfg, tp, dcfg, dp = make_pair(block_size=4)
    out = speculative_decode(
        tp, dp, PROMPT8, LENS8, jax.random.key(0), target_config=tcfg, drafter_config=dcfg,
        decode_config=DecodeConfig(max_new_tokens=12, block_size=4), mesh=mesh,
    )  # fmt: skip
    return np.asarray(out.tokens).tolist()


def _train(workdir: Path, target_dir: Path, mesh: str, name: str = "") -> dict:
    import _training

    from dflash_jax.training import trainer

    cfg = _training.train_config(
        workdir / "data.jsonl", num_steps=6, checkpoint_every=3, batch_size=8,
        learning_rate=3e-3, mesh=mesh, target=str(target_dir),
    )  # fmt: skip
    run = workdir / (name or mesh or "one")
    trainer.train(cfg, run)
    return {str(step): loss for step, loss in _training.logged_losses(run).items()}


def _setup(workdir: Path) -> Path:
    """The corpus and a tiny HF target directory (both processes read them)."""
    import _training

    _training.corpus(workdir / "data.jsonl")
    _training.write_hf_dir(workdir / "tiny_hf", _training.TINY_TARGET)
    return workdir / "tiny_hf"


def worker(argv) -> None:
    """One of the processes (absl flags: infer.distributed's and --workdir)."""
    from absl import flags

    from infer import distributed

    del argv
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    distributed.initialize()
    assert jax.process_count() == NUM_PROCESSES, jax.process_count()
    workdir = Path(flags.FLAGS.workdir)
    tokens = _decode(distributed.mesh(DECODE_MESH))
    losses = _train(workdir, workdir / "tiny_hf", TRAIN_MESH)
    result = {"tokens": tokens, "losses": losses, "devices": jax.device_count()}
    (workdir / f"result-{jax.process_index()}.json").write_text(json.dumps(result))
    distributed.barrier("results written")


def test_generate_data_splits_prompts_across_processes(tmp_path, target, chat):
    """Each process's share (emulated here one after another): every prompt answered once, and
    a rerun (with another process count) finds nothing left to do."""
    from dflash_jax.training import data
    from dflash_jax.training.generate import generate_records
    from dflash_jax.training.prompts import Prompt

    prompts = [Prompt(f"question {i}", "test") for i in range(7)]
    kw = dict(
        fmt="jsonl", batch_size=2, max_new_tokens=4, min_loss_tokens=1, prompts_per_shard=2,
        bucket=32,
    )  # fmt: skip
    shares = [
        generate_records(target, chat, prompts, tmp_path, process_index=p, process_count=3, **kw)
        for p in range(3)
    ]
    assert [c["written"] for c in shares] == [3, 2, 2]
    records = [r for path in data.expand_paths(str(tmp_path)) for r in data.read_shard(path)]
    assert sorted(r["prompt"] for r in records) == sorted(p.text for p in prompts)
    assert {path.name.split("-")[-1] for path in tmp_path.glob("data-*.jsonl")} == {
        "p0of3.jsonl", "p1of3.jsonl", "p2of3.jsonl"
    }  # fmt: skip
    again = [
        generate_records(target, chat, prompts, tmp_path, process_index=p, process_count=2, **kw)
        for p in range(2)
    ]
    assert sum(c["written"] + c["short_response"] for c in again) == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path, caplog):
    """Two processes decode and train as one does. Then their run, resumed from its step-3
    checkpoint by one process on one device, goes on with the one-process run's losses: the train state restores onto the new mesh and
    the data position (saved per process: none for a lone process) is rebuilt from the step;
    nothing is set aside as unreadable."""
    target_dir = _setup(tmp_path)
    here = Path(__file__).resolve().parent
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(
            [str(here.parent), str(here), os.environ.get("PYTHONPATH", "")]
        ),
    }
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    address = f"127.0.0.1:{_free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(here / "test_multihost.py"),
                f"--coordinator_address={address}",
                f"--num_processes={NUM_PROCESSES}",
                f"--process_id={i}",
                f"--workdir={tmp_path}",
            ],
            env=env,
            cwd=here,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for i in range(NUM_PROCESSES)
    ]
    # The one-process reference runs meanwhile (one device, its own run directory).
    expected_tokens = _decode()
    expected_losses = _train(tmp_path, target_dir, "")
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0])
    finally:
        for p in procs:
            p.kill()
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i}:\n{logs[i][-4000:]}"
    for i in range(NUM_PROCESSES):
        result = json.loads((tmp_path / f"result-{i}.json").read_text())
        assert result["devices"] == NUM_PROCESSES * DEVICES_PER_PROCESS
        assert result["tokens"] == expected_tokens
        got = result["losses"]
        assert list(got) == list(expected_losses) == [str(s) for s in range(1, 7)]
        np.testing.assert_allclose(
            [got[s] for s in got], [expected_losses[s] for s in got], atol=1e-5
        )
    run = tmp_path / TRAIN_MESH
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [3, 6]
    assert (run / "drafter" / "drafter_config.json").is_file()  # exported by process 0
    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / "6")
    with caplog.at_level(logging.WARNING):
        got = _train(tmp_path, target_dir, "", name="resumed")
    assert "rebuilt from the step: batch 4 is next" in caplog.text
    assert not (resumed / "checkpoints_unreadable").exists()
    assert sorted(int(p.name) for p in (resumed / "checkpoints").iterdir()) == [3, 6]
    assert list(got) == [str(s) for s in range(1, 7)]
    np.testing.assert_allclose([got[s] for s in got], [expected_losses[s] for s in got], atol=1e-5)


if __name__ == "__main__":
    from absl import app, flags

    import infer.distributed  # noqa: F401  (defines the flags the processes are started with)

    flags.DEFINE_string("workdir", None, "Shared run directory.")
    app.run(worker)
