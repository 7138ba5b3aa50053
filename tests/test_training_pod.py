"""A training run as on a pod: `python -m train.train_drafter` on a 2-device mesh with the
Pallas kernels (interpreted on CPU) runs through an evaluation, held-out metric included,
every program on the run's mesh (the same programs `infer.lower --what=train` lowers for TPU,
tests/test_lower.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import _tiny_training as tiny_training
import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~1-2 min: a fresh process compiles the step, decode and held-out programs
def test_a_mesh_run_with_kernels_runs_through_an_evaluation(tmp_path):
    """Only this runs the evaluation on a mesh with kernels (before issue 56 the held-out
    metric was a plain jit: on TPU a Mosaic kernel outside shard_map)."""
    config = tiny_training.write_config_file(
        tmp_path, kernels=True, num_steps=2, eval_every=2, checkpoint_every=1000
    )
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        "--xla_force_host_platform_device_count=2".strip(),
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-m", "train.train_drafter", f"--config={config}",
         "--config.mesh=fsdp=2", "--config.attention_impl=pallas", f"--workdir={tmp_path / 'run'}"],
        env=env, cwd=ROOT, capture_output=True, text=True, check=False, timeout=1500,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert "Pallas GPU kernels in interpret mode" in out.stderr
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (evaluation,) = [x for x in lines if "tau_eval" in x]
    assert evaluation["step"] == 2 and 1.0 <= evaluation["tau_eval"] <= 4.0, evaluation
    assert evaluation["heldout_loss"] > 0 and len(evaluation["heldout_accuracy"]) == 3
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()
