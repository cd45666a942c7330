"""The house rules, as tests (no GPU, no compiler): the import contract of flashgen's layers, one place
for the environment, tests that stand alone, and words that name what the code does, not its history.

The layers, bottom up (docs: ../README.md "Architecture"): a module imports only from its own layer or
below, the module graph has no cycle, and no module takes another module's ``_private`` names.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from flashgen import settings, testing

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "flashgen"

# Bottom up. A module's layer is the first pattern that matches its dotted name.
LAYERS = (
    ("base", ("flashgen.version", "flashgen.errors", "flashgen.settings", "flashgen.files", "flashgen.gpus",
              "flashgen.variants", "flashgen.mods", "flashgen.reference", "flashgen.iomodel", "flashgen.tma")),
    ("spec", ("flashgen.spec", "flashgen.problem")),
    ("families, codegen, tables", ("flashgen.families", "flashgen.codegen", "flashgen.tables",
                                   "flashgen.shapes")),
    ("dispatch", ("flashgen.dispatch",)),
    ("api", ("flashgen.api",)),
    ("entry points", ("flashgen.tuner", "flashgen.bench", "flashgen.cli", "flashgen.explain", "flashgen.testing",
                      "flashgen.integrations", "flashgen.__main__")),
)
FACE = "flashgen"  # the package's __init__: it hands names on (and registers the families) and is not layered
# Function-local imports of flashgen's own modules are allowed only where they defer torch (the torch layer
# and the integrations, which import it): everything else is imported at the top of the module.
DEFERRED_OK = ("flashgen.api", "flashgen.integrations")


def _modules() -> dict:
    """dotted name -> path of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def layer_of(name: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{name} is in no layer of the import contract: add it to LAYERS")


def _resolve(module: str, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    is_package = MODULES[module].name == "__init__.py"
    base = base if is_package else base[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(module: str):
    """(imported flashgen module, imported names or None, line, deferred) for each import in ``module``;
    ``from pkg import sub`` counts as importing the submodule."""
    tree = ast.parse(MODULES[module].read_text())
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    local = {id(sub) for f in funcs for sub in ast.walk(f)}
    for node in ast.walk(tree):
        deferred = id(node) in local
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "flashgen":
                    yield alias.name, None, node.lineno, deferred
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, node)
            if target.split(".")[0] != "flashgen":
                continue
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                if sub in MODULES:
                    yield sub, None, node.lineno, deferred
                else:
                    yield target, alias.name, node.lineno, deferred


def test_every_module_is_in_a_layer():
    assert len(MODULES) > 30
    for name in MODULES:
        if name != FACE:
            assert 0 <= layer_of(name) < len(LAYERS)


def test_imports_point_down_and_take_no_private_names():
    """No module imports from a layer above its own, nor another module's ``_private`` name."""
    wrong = []
    for name in MODULES:
        if name == FACE:
            continue
        for target, what, line, deferred in imports(name):
            if target == FACE:
                wrong.append(f"{name}:{line} imports the package face (take {what or 'it'} from its own module)")
                continue
            if target not in MODULES:
                wrong.append(f"{name}:{line} imports {target}, which does not exist")
                continue
            if layer_of(target) > layer_of(name):
                wrong.append(f"{name}:{line} ({LAYERS[layer_of(name)][0]}) imports {target} "
                             f"({LAYERS[layer_of(target)][0]}): imports point down")
            if what and what.startswith("_") and not what.startswith("__") and target != name:
                wrong.append(f"{name}:{line} takes the private name {what} of {target}")
            if deferred and not any(target == p or target.startswith(p + ".") for p in DEFERRED_OK) \
                    and not target.startswith(name + "."):
                wrong.append(f"{name}:{line} imports {target} inside a function (only the torch layer is deferred)")
    assert not wrong, "\n".join(wrong)


def test_no_private_attribute_of_another_module():
    """``module._name`` of an imported flashgen module is another module's private name too."""
    wrong = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("flashgen"):
                        aliases[alias.asname or alias.name] = alias.name
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, node) if node.level or (node.module or "").startswith("flashgen") else ""
                for alias in node.names:
                    if f"{target}.{alias.name}" in MODULES:
                        aliases[alias.asname or alias.name] = f"{target}.{alias.name}"
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                wrong.append(f"{name}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not wrong, "\n".join(wrong)


def test_the_module_graph_has_no_cycle():
    graph = {name: {t for t, _, _, deferred in imports(name) if t in MODULES and t != FACE and t != name}
             for name in MODULES if name != FACE}
    seen, stack, cycles = set(), [], []

    def visit(node, path):
        if node in path:
            cycles.append(path[path.index(node):] + [node])
            return
        if node in seen:
            return
        seen.add(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, path + [node])

    for name in sorted(graph):
        visit(name, stack)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


# ---------------------------------------------------------------- the environment


def _source_files():
    return [p for p in PACKAGE.rglob("*.py")]


def test_only_settings_reads_the_environment():
    """No module but flashgen/settings.py touches os.environ / os.getenv (others may name a variable in
    a message or a docstring, never read it)."""
    wrong = []
    for path in _source_files():
        if path.name == "settings.py" and path.parent == PACKAGE:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"os\.environ|os\.getenv|\benviron\b|putenv", line):
                wrong.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_settings_documents_every_variable_it_reads():
    text = (PACKAGE / "settings.py").read_text()
    read = set(re.findall(r'_(?:raw|flag|positive_int)\("(FLASHGEN_[A-Z_]+)"\)', text))
    assert read == set(settings.VARIABLES)
    for var in settings.VARIABLES:
        assert f"``{var}``" in text.split('"""')[1], f"{var} is not in settings.py's table"
    assert set(testing.ENVIRONMENT) == set(settings.VARIABLES)
    readme = (ROOT / "README.md").read_text()
    missing = [var for var in settings.VARIABLES if var not in readme]
    assert not missing, f"README.md does not document {missing}"


def test_conftest_clears_every_variable():
    conftest = (ROOT / "tests" / "conftest.py").read_text()
    assert "ENVIRONMENT" in conftest and "delenv" in conftest


# ---------------------------------------------------------------- tests stand alone


def test_no_test_imports_another_test_file():
    wrong = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0].startswith("test_")]
    assert not wrong, "\n".join(wrong)


def test_every_test_asserts_or_expects_something():
    """A test function that neither asserts, nor expects an exception, nor calls a checking helper is
    not a test (helpers named check*, *_close, clean_binary, or pytest.fail/skip count)."""
    wrong = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                text = ast.unparse(node)
                if not re.search(r"\bassert\b|pytest\.raises|pytest\.fail|pytest\.skip|\bcheck\w*\(|"
                                 r"clean_binary\(|_close\(|\bexpect\w*\(|pytest\.warns", text):
                    wrong.append(f"{path.name}::{node.name}")
    assert not wrong, "tests that check nothing:\n" + "\n".join(wrong)


# ---------------------------------------------------------------- words

HISTORY = re.compile(r"\b(session ?\d+|sessions? \d+|round ?\d+|issue ?#?\d+|device_s\d+\w*|exp_s\d+|_s\d+final"
                     r"|s\d+(?:final|tune|ab|fp16)\b|bench/NOTES\.md|bench/results)", re.I)


@pytest.mark.parametrize("where", ["flashgen", "tests", "scripts", "docs", "README.md"])
def test_no_names_of_past_work_periods(where):
    """Paths, identifiers, comments, tests and docs speak of what the code does and why: no names of past
    work periods, rounds or issues (history lives in git)."""
    root = ROOT / where
    files = [root] if root.is_file() else [p for p in root.rglob("*") if p.is_file()] if root.exists() else []
    wrong = []
    for path in files:
        rel = str(path.relative_to(ROOT))
        if HISTORY.search(rel):
            wrong.append(f"{rel}: the path names history")
        if path.suffix not in (".py", ".md", ".j2", ".cuh", ".sh", ".yaml", ".txt", ".cu", ".toml", ""):
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for i, line in enumerate(text.splitlines(), 1):
            if path.name == "test_layout.py" and ("HISTORY" in line or "bench/NOTES" in line):
                continue
            m = HISTORY.search(line)
            if m:
                wrong.append(f"{rel}:{i}: {m.group(0)!r}")
    assert not wrong, "\n".join(wrong[:40])
