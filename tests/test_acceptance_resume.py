"""infer.acceptance keeps what a long run has done (`infer.keep`; no JAX computation runs): the
claim that a killed acceptance run resumes with nothing lost, at the level of its kept file."""

from __future__ import annotations

import json

from infer import keep


def test_a_kept_run_is_resumed_only_with_the_same_settings(tmp_path, capsys):
    path = str(tmp_path / "tau.json.partial")
    settings = {"flags": {"num_prompts": 24}, "runs": {"chain16": "DecodeConfig(...)"}}
    assert keep.load(path, settings) == {}  # nothing kept yet

    kept = {"settings": settings, "ar": {"tokens": [[1, 2]], "lengths": [2]}, "results": {}}
    keep.save(path, kept)
    kept["results"]["chain16"] = {"tau_mean": 2.5, "seconds": 60.0}
    keep.save(path, kept)  # replaces the file whole
    assert keep.load(path, settings) == kept
    assert not (tmp_path / "tau.json.partial.tmp").exists()

    # Other settings (here one more prompt) start over, and say so.
    other = {**settings, "flags": {"num_prompts": 25}}
    assert keep.load(path, other) == {}
    assert "other settings; starting over" in capsys.readouterr().out

    # A file cut short (written by something else, or a full disk) is not trusted.
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:
        f.write(text[: len(text) // 2])
    assert keep.load(path, settings) == {}
    assert "unreadable" in capsys.readouterr().out
    json.dumps(kept)  # what is kept is plain JSON
