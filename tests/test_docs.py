"""The documentation stays usable, by reading text only (nothing is imported or compiled):

  * README.md has at most 250 lines (a newcomer reads it in five minutes; the rest is in docs/);
  * every relative link in README.md and docs/*.md names a file or folder of the repository, and
    a heading of it when the link has a `#fragment` (GitHub's heading ids);
  * every file in results/ is listed in results/README.md, and every file it lists exists.

Links inside code (fenced blocks, `spans`) are not links and are skipped, as are URLs with a
scheme (https:, mailto:). `results/tmp*` is git-ignored scratch and is not listed.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 250
RESULT_SUFFIXES = (".json", ".jsonl", ".png", ".txt", ".csv")

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title")
_HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def _prose(text: str) -> str:
    """The markdown without its fenced code blocks and code spans."""
    return _SPAN.sub("", _FENCE.sub("", text))


def _slug(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped (letters such as τ kept),
    spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    """The heading ids of a markdown file; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_prose(path.read_text(encoding="utf-8"))):
        slug = _slug(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out


def _docs(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def broken_links(root: Path) -> list[str]:
    """'file: target (why)' for each relative link of README.md and docs/*.md that does not
    resolve inside `root`."""
    out = []
    for doc in _docs(root):
        for target in _LINK.findall(_prose(doc.read_text(encoding="utf-8"))):
            if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # https:, mailto:, ...
                continue
            path_part, _, fragment = target.partition("#")
            dest = (doc.parent / path_part).resolve() if path_part else doc
            where = f"{doc.relative_to(root)}: {target}"
            if not dest.is_relative_to(root.resolve()) or not dest.exists():
                out.append(f"{where} (no such file in the repository)")
            elif fragment and dest.suffix == ".md" and fragment not in _anchors(dest):
                out.append(f"{where} (no heading #{fragment} in {dest.name})")
    return out


def unlisted_results(root: Path) -> list[str]:
    """Files of results/ that results/README.md does not name, and names it lists (in code
    spans, with a results suffix) that are not in results/."""
    results = root / "results"
    index = (results / "README.md").read_text(encoding="utf-8")
    present = {
        p.relative_to(results).as_posix()
        for p in results.rglob("*")
        if p.is_file() and p.name != "README.md" and not p.name.startswith("tmp")
    }
    listed = {
        span.strip("`")
        for span in _SPAN.findall(index)
        if span.strip("`").endswith(RESULT_SUFFIXES) and " " not in span
    }
    missing = [f"results/{name} (not listed in results/README.md)" for name in present - listed]
    stale = [
        f"results/{name} (listed in results/README.md, no such file)" for name in listed - present
    ]
    return sorted(missing + stale)


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, (
        f"README.md has {n} lines; at most {MAX_README_LINES} (move detail to docs/)"
    )


def test_every_relative_link_resolves():
    assert (ROOT / "docs").is_dir()
    problems = broken_links(ROOT)
    assert not problems, "\n" + "\n".join(problems)


def test_every_results_file_is_indexed():
    problems = unlisted_results(ROOT)
    assert not problems, "\n" + "\n".join(problems)


def test_the_checks_catch_each_fault(tmp_path):
    """A broken link, a missing heading, an unlisted results file and a stale entry are each
    reported; their sound counterparts are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "results").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# A page\n\n## What τ 2.0 would take\n")
    (tmp_path / "README.md").write_text(
        "[ok](docs/a.md) [ok](docs/a.md#what-τ-20-would-take) [web](https://x.org/y)\n"
        "[gone](docs/missing.md) [bad anchor](docs/a.md#nowhere) `[code](nowhere.md)`\n"
        "```\n[fenced](nowhere.md)\n```\n"
    )
    (tmp_path / "results" / "kept.json").write_text("{}")
    (tmp_path / "results" / "new.json").write_text("{}")
    (tmp_path / "results" / "tmp_scratch.json").write_text("{}")
    (tmp_path / "results" / "README.md").write_text("| `kept.json` | |\n| `removed.png` | |\n")
    assert broken_links(tmp_path) == [
        "README.md: docs/missing.md (no such file in the repository)",
        "README.md: docs/a.md#nowhere (no heading #nowhere in a.md)",
    ]
    assert unlisted_results(tmp_path) == [
        "results/new.json (not listed in results/README.md)",
        "results/removed.png (listed in results/README.md, no such file)",
    ]


def _unnamed_modules(root: Path) -> list[str]:
    """The modules of dflash_jax/, infer/ and train/ that docs/development.md's layout (the
    section up to the next heading) does not name."""
    text = (root / "docs" / "development.md").read_text()
    layout = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"\w+", layout))
    return [
        str(p.relative_to(root))
        for top in ("dflash_jax", "infer", "train")
        for p in sorted((root / top).rglob("*.py"))
        if p.stem != "__init__" and p.stem not in named
    ]


def test_the_layout_names_every_module(tmp_path):
    """Every module is named in docs/development.md's layout; a new one that is not fails."""
    assert _unnamed_modules(ROOT) == [], "name them in docs/development.md's Layout"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "development.md").write_text("## Layout\n\nconfig\n\n## Next\nzz\n")
    (tmp_path / "dflash_jax").mkdir()
    for name in ("config", "zz", "__init__"):
        (tmp_path / "dflash_jax" / f"{name}.py").write_text("")
    assert _unnamed_modules(tmp_path) == ["dflash_jax/zz.py"]
