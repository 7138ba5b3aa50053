"""requirements.txt provides everything the runtime (dflash_jax/, infer/, train/, configs/) needs.

README's first command installs requirements.txt (not -dev) and the asset packages with
--no-deps; CI's test venv installs requirements-dev.txt, whose torch brings packages (jinja2)
that requirements.txt alone does not. So this reads the imports with `ast` instead of trusting
that the suite ran: each third-party import must come from a distribution that requirements.txt
names or that one of those declares as a dependency (recursively, extras only where a
requirement asks for them), or from an asset package in requirements-assets.txt (installed
without its dependencies, so only itself counts). Offline: installed metadata only.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import logging
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
FIRST_PARTY = ("dflash_jax", "infer", "train", "configs")

# Calls that load a package by a literal import name: `dflash_jax.io.assets._package_file`
# locates the asset packages' data files by their import name (never importing them).
DYNAMIC_IMPORTS = ("find_spec", "import_module", "_package_file")

# Library features whose packages are an extra of the library, not a dependency: a source
# string that uses the feature -> (library, extra). transformers' chat templates need jinja2.
FEATURE_EXTRAS = {"apply_chat_template": ("transformers", "chat-template")}

# Imports that requirements.txt need not provide: (file, import name) -> why. Allowed only
# inside a function, so that the module imports (and its --help runs) without them.
OPTIONAL_IMPORTS = {
    ("infer/bench/ar_vs_transformers.py", "torch"): (
        "times transformers' own PyTorch generate beside ours; torch (and accelerate) come "
        "with requirements-dev.txt"
    ),
    ("dflash_jax/training/prompts.py", "datasets"): (
        "train.generate_data reads a Hugging Face `datasets` directory only when asked to, and "
        "says what to install when the package is missing"
    ),
    ("dflash_jax/training/prompts.py", "pyarrow"): (
        "train.generate_data reads parquet files only when asked to, and says what to install "
        "when the package is missing"
    ),
}


def _requirement_lines(path: Path) -> list[str]:
    lines = []
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith(("-r ", "--requirement ")):
            lines += _requirement_lines(path.parent / line.split(maxsplit=1)[1])
        elif line.startswith("-"):
            raise AssertionError(f"{path.name}: option {line!r} is not understood by this test")
        else:
            lines.append(line)
    return lines


def _requirements(path: Path) -> list[Requirement]:
    reqs = [Requirement(line) for line in _requirement_lines(path)]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _closure(roots: list[Requirement]) -> set[str]:
    """Canonical names of `roots` and, recursively, their declared dependencies: unconditional
    ones and those of the extras a requirement asks for (`etils[epath]`), for this platform."""
    provided: set[str] = set()
    seen: set[tuple[str, frozenset[str]]] = set()
    stack = [(canonicalize_name(r.name), frozenset(r.extras)) for r in roots]
    while stack:
        name, extras = stack.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        provided.add(name)
        try:
            declared = md.requires(name) or []
        except md.PackageNotFoundError:
            continue  # not installed here: its own imports are then reported as missing
        for text in declared:
            req = Requirement(text)
            wanted = req.marker is None or any(
                req.marker.evaluate({"extra": extra}) for extra in ("", *extras)
            )
            if wanted:
                stack.append((canonicalize_name(req.name), frozenset(req.extras)))
    return provided


def _call_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute):
        return func.attr
    return None


def _imports(path: Path) -> list[tuple[str, int, bool]]:
    """(top-level import name, line, inside a function) of each absolute import in `path`:
    `import x.y`, `from x import y` at any depth, and DYNAMIC_IMPORTS with a literal name."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            names = []
            if isinstance(child, ast.Import):
                names = [alias.name for alias in child.names]
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                names = [child.module]
            elif (
                isinstance(child, ast.Call)
                and _call_name(child.func) in DYNAMIC_IMPORTS
                and child.args
                and isinstance(child.args[0], ast.Constant)
                and isinstance(child.args[0].value, str)
            ):
                names = [child.args[0].value]
            found.extend((n.split(".")[0], child.lineno, in_function) for n in names)
            scope = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)
            visit(child, in_function or isinstance(child, scope))

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)), False)
    return found


def _runtime_files() -> list[Path]:
    files = sorted(f for package in FIRST_PARTY for f in (ROOT / package).rglob("*.py"))
    assert len(files) > 20, f"runtime sources not found under {ROOT}"
    return files


def test_requirements_provide_every_runtime_import():
    runtime = _closure(_requirements(ROOT / "requirements.txt"))
    assets = {canonicalize_name(r.name) for r in _requirements(ROOT / "requirements-assets.txt")}
    assert "torch" not in runtime, "requirements.txt now brings torch: review OPTIONAL_IMPORTS"
    distributions = md.packages_distributions()
    problems, optional_seen = [], set()
    for path in _runtime_files():
        rel = path.relative_to(ROOT).as_posix()
        for name, line, in_function in _imports(path):
            if name in sys.stdlib_module_names or name in FIRST_PARTY:
                continue
            where = f"{rel}:{line}: {name}"
            if (rel, name) in OPTIONAL_IMPORTS:
                optional_seen.add((rel, name))
                if not in_function:
                    problems.append(f"{where} is optional, so it must be imported in a function")
                continue
            dists = {canonicalize_name(d) for d in distributions.get(name, [])}
            if not dists:
                problems.append(f"{where}: no installed distribution provides it")
            elif not dists & (runtime | assets):
                problems.append(
                    f"{where} (from {', '.join(sorted(dists))}): neither requirements.txt, its "
                    "dependencies nor requirements-assets.txt provide it"
                )
    stale = set(OPTIONAL_IMPORTS) - optional_seen
    assert not stale, f"OPTIONAL_IMPORTS entries no longer imported: {sorted(stale)}"
    assert not problems, "\n".join(problems)


def test_requirements_provide_library_feature_extras():
    pins = {canonicalize_name(r.name): r for r in _requirements(ROOT / "requirements.txt")}
    runtime = _closure(list(pins.values()))
    sources = "\n".join(p.read_text(encoding="utf-8") for p in _runtime_files())
    checked, problems = set(), []
    for feature, (library, extra) in FEATURE_EXTRAS.items():
        assert feature in sources, f"the runtime no longer uses {feature}: drop it here"
        extra_reqs = [
            req
            for req in map(Requirement, md.requires(library) or [])
            if req.marker is not None
            and req.marker.evaluate({"extra": extra})
            and not req.marker.evaluate({"extra": ""})
        ]
        assert extra_reqs, f"{library} declares no extra {extra!r} any more"
        for req in extra_reqs:
            name, spec = canonicalize_name(req.name), f"{req.name}{req.specifier}"
            checked.add(name)
            pin = pins.get(name)
            if name not in runtime:
                problems.append(f"{feature} needs {spec} ({library}[{extra}]): not provided")
            elif pin is not None and not all(req.specifier.contains(v) for v in _pinned(pin)):
                problems.append(f"{feature} needs {spec}, requirements.txt pins {pin}")
    assert "jinja2" in checked  # transformers' chat templates: render_prompt needs it
    assert not problems, "\n".join(problems)


def _pinned(req: Requirement) -> list[str]:
    return [s.version for s in req.specifier if s.operator == "=="]


def test_no_torch_notice_is_dropped_and_nothing_else():
    """Without torch, `import transformers` logs "PyTorch was not found. Models won't be
    available ..." (a warning that reads like an error; dflash-jax uses transformers for
    tokenizers only). dflash_jax.io filters exactly that record on the "transformers" logger."""
    import dflash_jax.io  # noqa: F401  (installs the filter)

    logger = logging.getLogger("transformers")

    def record(msg):
        return logger.makeRecord("transformers", logging.WARNING, __file__, 0, msg, (), None)

    notice = (
        "PyTorch was not found. Models won't be available and only tokenizers, configuration "
        "and file/data utilities can be used."
    )
    assert not logger.filter(record(notice))
    assert logger.filter(record("Some other transformers warning."))
