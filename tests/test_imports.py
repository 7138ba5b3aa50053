"""The house rules for imports, checked by parsing the sources (pure `ast`, no import runs).

Floors, lowest first; a module imports only from a lower floor or from its own part:

  0 ground     dflash_jax/config.py, dflash_jax/sharding.py, dflash_jax/files.py
  1 ops        dflash_jax/ops/
  2 models     dflash_jax/models/
  3 io         dflash_jax/io/          (io and decoding never import each other)
  3 decoding   dflash_jax/decoding/
  4 training   dflash_jax/training/
  5 api        dflash_jax/api.py
  6 package    dflash_jax/__init__.py
  7 CLIs       infer/, train/, configs/ (one part: train/ takes its mesh and multi-process
               flags from infer/distributed.py, as every CLI does)

Also: no private name (`_x`) is imported from another module of the project, nor read as an
attribute of one (`loop._x`); no file in dflash_jax/decoding/ is over 400 lines. Module-level
and function-level imports count alike; relative imports are resolved. `DFLASH_JAX_ROOT`
points the checks at another checkout (e.g. a `git worktree` of an older commit).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

ROOT = Path(os.environ.get("DFLASH_JAX_ROOT") or Path(__file__).resolve().parents[1])
CHECKED = ("dflash_jax", "infer", "train", "configs")  # the trees whose imports are checked
PROJECT = ("dflash_jax", "infer", "train", "configs")  # the trees a rule can point into
MAX_DECODING_LINES = 400

# (module prefix, part, floor); the longest matching prefix wins.
PARTS = (
    ("dflash_jax.config", "ground", 0),
    ("dflash_jax.sharding", "ground", 0),
    ("dflash_jax.files", "ground", 0),
    ("dflash_jax.ops", "ops", 1),
    ("dflash_jax.models", "models", 2),
    ("dflash_jax.io", "io", 3),
    ("dflash_jax.decoding", "decoding", 3),
    ("dflash_jax.training", "training", 4),
    ("dflash_jax.api", "api", 5),
    ("dflash_jax", "package", 6),
    ("infer", "cli", 7),
    ("train", "cli", 7),
    ("configs", "cli", 7),
)
APART = {frozenset(("io", "decoding"))}  # parts that must not import each other either way


def _part(module: str) -> tuple[str, int] | None:
    for prefix, part, floor in sorted(PARTS, key=lambda p: -len(p[0])):
        if module == prefix or module.startswith(prefix + "."):
            return part, floor
    return None


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str) -> bool:
    """Whether `name` is a module or package of the project checkout."""
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _sources() -> list[Path]:
    return sorted(p for top in CHECKED for p in (ROOT / top).rglob("*.py"))


def _package(path: Path, module: str) -> str:
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


class _Imports(ast.NodeVisitor):
    """Every project import of one file: (line, imported module, names taken from it), and the
    local names bound to project modules (for `module._x` attribute reads)."""

    def __init__(self, path: Path):
        self.path = path
        self.module = _module_name(path)
        self.imports: list[tuple[int, str, tuple[str, ...]]] = []
        self.aliases: dict[str, str] = {}  # local dotted name -> project module

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] not in PROJECT:
                continue
            self.imports.append((node.lineno, alias.name, ()))
            if alias.asname:
                self.aliases[alias.asname] = alias.name
            else:  # `import a.b.c` binds a; a.b and a.b.c are read through it
                parts = alias.name.split(".")
                for i in range(1, len(parts) + 1):
                    self.aliases[".".join(parts[:i])] = ".".join(parts[:i])

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = _package(self.path, self.module).split(".")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join(base + ([node.module] if node.module else []))
        else:
            source = node.module or ""
        if source.split(".")[0] not in PROJECT:
            return
        taken = []
        for alias in node.names:
            sub = f"{source}.{alias.name}"
            if _is_module(sub):  # `from pkg import module`: the module is what is imported
                self.imports.append((node.lineno, sub, ()))
                self.aliases[alias.asname or alias.name] = sub
            else:
                taken.append(alias.name)
        if taken or not node.names:
            self.imports.append((node.lineno, source, tuple(taken)))


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _bound_module(dotted: str, aliases: dict[str, str]) -> str | None:
    """The project module a dotted name reads (`loop`, `dflash_jax.decoding.loop`), or None."""
    if dotted in aliases:
        return aliases[dotted]
    head, _, rest = dotted.partition(".")
    if head in aliases and rest and _is_module(f"{aliases[head]}.{rest}"):
        return f"{aliases[head]}.{rest}"
    return None


def _violations(path: Path) -> list[str]:
    rel = path.relative_to(ROOT)
    tree = ast.parse(path.read_text(), filename=str(path))
    found = _Imports(path)
    found.visit(tree)
    me = _part(found.module)
    out = []
    for line, target, names in found.imports:
        where = f"{rel}:{line}"
        them = _part(target)
        if me and them and me[0] != them[0]:
            pair = frozenset((me[0], them[0]))
            if pair in APART:
                out.append(
                    f"{where}: {me[0]} imports {them[0]} ({target}); "
                    "rule: io and decoding never import each other"
                )
            elif them[1] >= me[1]:
                out.append(
                    f"{where}: {me[0]} (floor {me[1]}) imports {them[0]} (floor {them[1]}) "
                    f"({target}); rule: import only from lower floors or your own part"
                )
        for name in names:
            if name.startswith("_") and target != found.module:
                out.append(
                    f"{where}: private name {name} imported from {target}; "
                    "rule: no private name across modules"
                )
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        base = _dotted(node.value)
        target = _bound_module(base, found.aliases) if base else None
        if target and target != found.module:
            out.append(
                f"{rel}:{node.lineno}: private attribute {base}.{node.attr} of {target}; "
                "rule: no private name across modules"
            )
    return out


def test_sources_found():
    assert (ROOT / "dflash_jax" / "decoding").is_dir(), ROOT
    assert len(_sources()) > 50


@pytest.mark.parametrize("top", CHECKED)
def test_imports_follow_the_floors(top):
    problems = [
        v for p in _sources() if p.relative_to(ROOT).parts[0] == top for v in _violations(p)
    ]
    assert not problems, "\n" + "\n".join(problems)


def test_decoding_files_stay_short():
    long = [
        f"{p.relative_to(ROOT)}:{n}: {n} lines; rule: no file in dflash_jax/decoding/ over "
        f"{MAX_DECODING_LINES} lines"
        for p in sorted((ROOT / "dflash_jax" / "decoding").glob("*.py"))
        if (n := len(p.read_text().splitlines())) > MAX_DECODING_LINES
    ]
    assert not long, "\n" + "\n".join(long)


def test_the_checker_catches_each_rule(tmp_path):
    """Each rule fires on a file that breaks it (the checker itself is tested)."""
    global ROOT
    for sub in ("dflash_jax/ops", "dflash_jax/io", "dflash_jax/decoding", "dflash_jax/models"):
        (tmp_path / sub).mkdir(parents=True, exist_ok=True)
        (tmp_path / sub / "__init__.py").write_text("")
    (tmp_path / "dflash_jax/__init__.py").write_text("")
    (tmp_path / "dflash_jax/models/target.py").write_text("def _w(): pass\n")
    bad = tmp_path / "dflash_jax/ops/dispatch.py"
    bad.write_text(
        "import dflash_jax.models.target as t\n"
        "import dflash_jax\n"
        "def f():\n"
        "    from ..models.target import _w\n"
        "    return t._w, dflash_jax.models.target._w\n"
    )
    io = tmp_path / "dflash_jax/io/x.py"
    io.write_text("from dflash_jax.decoding import loop\n")
    (tmp_path / "dflash_jax/decoding/loop.py").write_text("\n" * 401)
    ROOT, saved = tmp_path, ROOT
    try:
        got = "\n".join(_violations(bad) + _violations(io))
        assert "dflash_jax/ops/dispatch.py:1: ops (floor 1) imports models" in got
        assert "dflash_jax/ops/dispatch.py:4: ops (floor 1) imports models" in got
        assert "dflash_jax/ops/dispatch.py:2: ops (floor 1) imports package" in got
        assert "private name _w imported from dflash_jax.models.target" in got
        assert "dispatch.py:5: private attribute t._w" in got
        assert "dispatch.py:5: private attribute dflash_jax.models.target._w" in got
        assert "dflash_jax/io/x.py:1: io imports decoding" in got
        with pytest.raises(AssertionError, match="401 lines"):
            test_decoding_files_stay_short()
    finally:
        ROOT = saved


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _import_graph(top: str = "dflash_jax") -> dict[str, set[str]]:
    """module -> the project modules it imports (module- and function-level alike)."""
    graph: dict[str, set[str]] = {}
    for path in _sources():
        found = _Imports(path)
        found.visit(ast.parse(path.read_text(), filename=str(path)))
        if found.module.split(".")[0] != top:
            continue
        graph.setdefault(found.module, set()).update(
            t for _, t, _ in found.imports if t.split(".")[0] == top and t != found.module
        )
    return graph


def test_no_import_circle_in_the_package():
    """No two modules of dflash_jax import each other, directly or through others (an import
    inside a function counts: it is the same dependency, only later)."""
    circles = _cycles(_import_graph())
    assert not circles, "import circles: " + "; ".join(" <-> ".join(c) for c in circles)
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


TESTS = Path(__file__).resolve().parent


def test_test_modules_stand_alone():
    """No test module imports another (nor names one in a script it runs): what tests share
    lives in tests/conftest.py (fixtures) and tests/_*.py (helpers); and no fixture comes in
    through an import (`# noqa: F401`, `# noqa: F811`)."""
    import re

    problems = []
    for path in sorted(TESTS.glob("test_*.py")):
        text = path.read_text()
        for node in ast.walk(ast.parse(text, filename=str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names = re.findall(r"(?m)^\s*(?:from|import)\s+(test_\w+)", node.value)
            for name in names:
                if name.startswith("test_") and name != path.stem:
                    problems.append(f"{path.name}:{node.lineno}: imports {name}")
        for n, line in enumerate(text.splitlines(), 1):
            if path.name != "test_imports.py" and re.search(r"^from test_|noqa: F811", line):
                problems.append(f"{path.name}:{n}: {line.strip()}")
    assert not problems, "\n" + "\n".join(problems)
