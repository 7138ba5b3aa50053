"""Bad input, as a hostile but ordinary user gives it (issue 37): nothing a run saved is lost, and
every bad input is named in a line or two.

Training: a rerun whose config differs from its checkpoints' is refused before anything is
touched, naming the fields, and the right rerun resumes; only checkpoints that do not read as
themselves are set aside; a workdir whose checkpoints were all set aside is refused on every
rerun until start_over. Steps are a stand-in (`_fake_step`: the state's step + 1), so nothing
compiles, and one finished run is copied for each test: what is checked is which checkpoint a
run starts from and what is left on disk.
Decoding: the context limits each row's real length, not its padded bucket. CLIs (in
subprocesses, where exit code and output are the point): one or two lines and exit code 1, no
traceback, no --help; JSONL readers name file:line; bounded --tree_nodes and --block_size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from _training import TINY_TARGET, corpus, train_config

from dflash_jax import api
from dflash_jax.config import ConfigError
from dflash_jax.decoding.programs import check_prompt
from dflash_jax.decoding.settings import DecodeConfig
from dflash_jax.io import CheckpointError
from dflash_jax.io.drafter_io import DEFAULT_DRAFTER
from dflash_jax.io.target_loader import LoadedTarget
from dflash_jax.training import data, prompts, trainer

REPO = Path(__file__).resolve().parents[1]


# --- training: checkpoints are never lost -------------------------------------------------


SEEN: list[int] = []  # the step each train step started from, in this module's runs


def _fake_step(state, target_params, batch, **settings):
    """A train step that only counts (recording the step it starts from): nothing compiles."""
    SEEN.append(int(state["step"]))
    ones = np.ones(3, np.float32)
    metrics = {"finite": True, "loss": 1.0, "grad_norm": 1.0, "correct": ones, "count": ones}
    return {**state, "step": state["step"] + 1}, metrics


@pytest.fixture(scope="module")
def _a_finished_run(tmp_path_factory):
    """One finished 4-step run (checkpoints 2 and 4) over test_training's tiny target, with
    the trainer's target and step replaced for the whole module -> (config, workdir)."""
    target = LoadedTarget(TINY_TARGET, {}, None, None, "tiny")  # a stand-in step reads none
    where = tmp_path_factory.mktemp("finished")
    corpus(where / "data.jsonl")
    cfg = train_config(where / "data.jsonl", num_steps=4, checkpoint_every=2)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(trainer, "load_target", lambda source, dtype: target)
        mp.setattr(trainer, "train_step", _fake_step)
        trainer.train(cfg, where / "run")
        assert _steps(where / "run") == [2, 4] and SEEN == [0, 1, 2, 3]
        yield cfg, where / "run"


@pytest.fixture
def finished_run(_a_finished_run, tmp_path):
    """A copy of the finished run -> (config, workdir, the steps this test's runs start from)."""
    cfg, original = _a_finished_run
    run = tmp_path / "run"
    shutil.copytree(original, run)
    SEEN.clear()
    return cfg.copy_and_resolve_references(), run, SEEN


def _steps(run: Path, directory: str = "checkpoints") -> list[int]:
    where = run / directory
    return sorted(int(p.name) for p in where.iterdir()) if where.is_dir() else []


def _snapshot(run: Path) -> dict:
    """Every file under `run` with its bytes, to show that nothing was touched."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def _changed(cfg):
    changed = cfg.copy_and_resolve_references()
    changed.drafter.num_layers = 1
    changed.drafter.target_layer_ids = (2,)
    return changed


def test_a_changed_config_is_refused_with_its_checkpoints_untouched(finished_run):
    cfg, run, seen = finished_run
    before = _snapshot(run)
    with pytest.raises(ConfigError) as refused:
        trainer.train(_changed(cfg), run)
    message = str(refused.value)
    assert "drafter.num_layers 2 there, 1 now" in message, message
    assert "drafter.target_layer_ids (1, 2) there, (2,) now" in message, message
    # The two ways on: the old values, or a new workdir.
    assert "--config.drafter.num_layers=2" in message and "new --workdir" in message, message
    assert _snapshot(run) == before and not (run / "checkpoints_unreadable").exists()
    assert seen == []


def test_a_changed_data_shape_is_refused_naming_the_warm_start(finished_run):
    cfg, run, _ = finished_run
    before = _snapshot(run)
    with pytest.raises(ConfigError, match="batch_size 4 there, 2 now") as refused:
        trainer.train(train_config(cfg.data, num_steps=4, checkpoint_every=2, batch_size=2), run)
    assert f"--config.init_from_checkpoint={run}" in str(refused.value)
    assert _snapshot(run) == before


def test_the_right_rerun_after_a_refused_one_resumes_from_the_last_checkpoint(finished_run):
    cfg, run, seen = finished_run
    with pytest.raises(ConfigError):
        trainer.train(_changed(cfg), run)
    longer = cfg.copy_and_resolve_references()
    longer.num_steps = 6
    trainer.train(longer, run)
    assert seen == [4, 5]  # from checkpoint 4, not from step 0
    logged = [json.loads(x)["step"] for x in (run / trainer.METRICS_FILE).read_text().splitlines()]
    assert logged == [1, 2, 3, 4, 5, 6]
    assert _steps(run) == [2, 4, 6]


def test_checkpoints_of_another_drafter_are_not_set_aside_without_a_saved_config(finished_run):
    """A workdir from before run_config.json: the checkpoint's own metadata tells a readable
    checkpoint of another drafter from a damaged one."""
    cfg, run, _ = finished_run
    (run / "run_config.json").unlink(missing_ok=True)  # as if from before it
    before = _snapshot(run)
    with pytest.raises(ConfigError, match=r"readable but holds another drafter.*layers_1"):
        trainer.train(_changed(cfg), run)
    assert _snapshot(run) == before and not (run / "checkpoints_unreadable").exists()


def test_a_workdir_with_only_damaged_checkpoints_is_refused_on_every_rerun(finished_run):
    cfg, run, seen = finished_run
    for path in (run / "checkpoints").rglob("*"):
        if path.is_file() and path.stat().st_size > 64:
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="no readable checkpoint"):
        trainer.train(cfg, run)  # sets them aside
    assert _steps(run, "checkpoints_unreadable") == [2, 4]
    metrics = (run / trainer.METRICS_FILE).read_bytes()
    for _ in range(2):  # a scheduler's retries
        with pytest.raises(CheckpointError, match="--start_over"):
            trainer.train(cfg, run)
    assert seen == [] and (run / trainer.METRICS_FILE).read_bytes() == metrics
    trainer.train(cfg, run, start_over=True)
    assert seen == [0, 1, 2, 3]


def test_train_drafter_names_missing_data_in_two_lines(tmp_path):
    from _tiny_configs import write_tiny_config

    config = write_tiny_config(tmp_path)
    out = _cli(
        "train.train_drafter", f"--config={config}", f"--workdir={tmp_path / 'run'}",
        f"--config.data={tmp_path / 'nowhere'}/",
    )  # fmt: skip
    _one_error(out, "shards match")
    assert not (tmp_path / "run").exists()


# --- decoding: the context holds real lengths ----------------------------------------------


def test_the_context_check_takes_each_rows_real_length_not_its_bucket():
    tcfg = dataclasses.replace(TINY_TARGET, max_position_embeddings=8192)
    width = api.bucket_length(5332)
    assert width == 8192
    prompt = np.zeros((2, width), np.int32)
    check_prompt(prompt, np.array([5332, 40]), tcfg, DecodeConfig(max_new_tokens=8))
    check_prompt(prompt[:1, :32], np.array([10]), tcfg, DecodeConfig(max_new_tokens=8182))
    with pytest.raises(
        ValueError, match=r"prompt length \(row 1\) 8190 \+ max_new_tokens 8 = 8198"
    ):
        check_prompt(prompt, np.array([12, 8190]), tcfg, DecodeConfig(max_new_tokens=8))


@pytest.mark.slow
def test_a_5000_token_prompt_decodes_on_the_default_target():
    """Guards alone that a prompt past half the context (bucket 8192) runs end to end on the
    default target and drafter (the fast test checks the check)."""
    target, drafter = api.load_pair("smollm2-135m-instruct", "default")
    text = " ".join(f"item{i}" for i in range(1700))
    assert len(api.render_prompt(target.tokenizer, text)) > 5000
    out = api.generate(target, drafter, [text], max_new_tokens=8, adaptive=False, block_size=4)
    assert len(out) == 1 and isinstance(out[0], str)


def test_generate_checks_its_prompts_before_a_tokenizer_sees_them():
    calls = []

    class Tokenizer:
        eos_token_id = 2

        def __getattr__(self, name):
            calls.append(name)
            raise AssertionError(f"the tokenizer was used: {name}")

    target = type("Target", (), {"tokenizer": Tokenizer(), "config": TINY_TARGET})()
    with pytest.raises(TypeError, match=r"non-empty list of non-empty strings.*int 123"):
        api.generate(target, None, [123])
    with pytest.raises(ValueError, match="non-empty list of non-empty strings, got an empty list"):
        api.generate(target, None, [])
    with pytest.raises(ValueError, match=r"empty string at prompts\[1\]"):
        api.generate(target, None, ["hi", ""])
    assert calls == []


# --- CLIs: one or two lines, exit code 1 ---------------------------------------------------


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip


def _one_error(out: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit code 1, at most two lines on stderr naming the problem, no traceback, no help."""
    err = out.stderr.strip()
    assert out.returncode == 1, (out.returncode, err[-3000:])
    assert "Traceback" not in err and "flags:" not in err, err[-3000:]
    assert len(err.splitlines()) <= 2, err[-3000:]
    for text in expected:
        assert text in err, err
    return err


def test_benchmark_names_the_malformed_jsonl_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"prompt": oops}\n')
    out = _cli("infer.benchmark", f"--dataset=jsonl:{bad}", f"--output={tmp_path / 'o.json'}")
    _one_error(out, f"{bad}:3:", "not valid JSON", '{"prompt": "..."}')


def test_jsonl_readers_name_file_and_line_and_what_was_expected(tmp_path):
    """train.generate_data's prompt files, training shards and infer.benchmark's
    --dataset=jsonl: (`jsonl.read_objects`); a line that is JSON but not an object included."""
    array = tmp_path / "array.jsonl"
    array.write_text('{"prompt": "fine"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=rf"{array}:2: a JSON list, expected"):
        prompts.read_prompt_file(array)
    shard = tmp_path / "data-00000.jsonl"
    shard.write_text('{"tokens": [1], "loss_mask": [1]}\n\n{"tokens": [1, \n')
    with pytest.raises(ValueError, match=rf"{shard}:3: not valid JSON"):
        data.record_source([str(shard)])
    from dflash_jax.io import jsonl

    with pytest.raises(ValueError, match=rf"{array}:2: a JSON list, expected"):
        jsonl.read_objects(array, 'a {"prompt": "..."} object')


def test_a_corrupted_drafter_is_one_error_without_event_loop_noise(tmp_path):
    damaged = tmp_path / "drafter"
    shutil.copytree(DEFAULT_DRAFTER, damaged)
    for path in (damaged / "params").rglob("*"):
        if path.is_file() and path.parent.name == "d":  # the arrays, not the metadata
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    out = _cli(
        "infer.convert", f"--source={damaged}", f"--output={tmp_path / 'out'}", "--format=zlab"
    )
    err = _one_error(out, "CheckpointError", "damaged or incomplete")
    assert "Event loop is closed" not in err and "tensorstore_spec" not in err


def test_convert_names_a_missing_source_in_two_lines(tmp_path):
    out = _cli(
        "infer.convert", f"--source={tmp_path / 'nothing'}", f"--output={tmp_path / 'out'}",
        "--format=orbax",
    )  # fmt: skip
    _one_error(out, "no such directory")


def test_generate_ends_a_late_error_without_its_help(tmp_path):
    out = _cli("infer.generate", "--prompt=hi", f"--target={tmp_path / 'no-model'}")
    _one_error(out, "no-model")


@pytest.mark.parametrize(  # one flag by default (suite budget), the other slow
    "flag", ["--tree_nodes=1000", pytest.param("--block_size=65", marks=pytest.mark.slow)]
)
def test_tree_nodes_and_block_size_have_upper_bounds(flag):
    """The bound is absl's, so --help shows it too ("an integer in the range [0, 256]")."""
    out = _cli("infer.generate", flag, "--prompt=")
    bound = {"--tree_nodes=1000": 256, "--block_size=65": 64}[flag]
    _one_error(out, flag, f"range [0, {bound}]")
