"""The package's layers only point down and its imports form no circle (docs/ARCHITECTURE.md).

Reads every module's import statements with `ast` (function-local imports included, `if TYPE_CHECKING:` blocks
excluded), so the check costs no imports and covers code paths the other tests never run.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

import pytest

PACKAGE = "hf_dspark"
ROOT = Path(__file__).resolve().parents[1] / "src" / PACKAGE

# Bottom to top. A module may import its own unit, any unit of a lower layer, and (in the bottom layer only)
# its neighbours; never a unit of its own layer or one above. `<stage>.cli` modules form the top layer. The package
# root is the public facade: it imports every layer (the later stages lazily), and only the CLI imports it.
LAYERS = [
    ("shared math", ["_lazy", "metrics", "sampling", "target", "grouped_sdpa", "resources", "paths", "compilation",
                     "kernel_backends"]),
    ("models", ["models"]),
    ("data", ["data"]),
    ("training and generation", ["training", "generation"]),
    ("evaluation", ["evaluation"]),
    ("hub", ["hub"]),
    ("cli vocabulary", ["cli_args"]),
    ("cli", ["cli", "*.cli"]),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def unit_of(module: str) -> tuple[int, str]:
    """(layer index, unit) of a module of the package."""
    parts = module.split(".")[1:]
    if len(parts) == 2 and parts[1] == "cli":
        return len(LAYERS) - 1, "*.cli"
    for index, (_, units) in enumerate(LAYERS):
        if parts and parts[0] in units:
            return index, parts[0]
    raise AssertionError(f"{module} is in no layer: add it to LAYERS here and to docs/ARCHITECTURE.md")


def _type_checking_only(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _import_nodes(tree: ast.AST):
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(module: str) -> set[str]:
    """The package modules `module` imports (a `from pkg import name` counts as pkg.name when that is a module)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            if sub in MODULES:
                found.add(sub)
            elif base == PACKAGE and alias.name == "__version__":
                continue  # a constant of the root, read at call time: no dependency on the facade
            else:
                found.add(base)
    return {name for name in found if name == PACKAGE or name.startswith(PACKAGE + ".")} - {module}


GRAPH = {module: imports_of(module) for module in MODULES}


def test_every_module_sits_in_a_layer():
    for module in MODULES:
        if module != PACKAGE:
            unit_of(module)


def test_imports_only_point_down():
    wrong = []
    for module, imported in GRAPH.items():
        if module == PACKAGE:
            continue  # the package root is the public facade above every layer
        layer, unit = unit_of(module)
        for name in sorted(imported):
            if name == PACKAGE:
                if layer == len(LAYERS) - 1:
                    continue  # the command line, like a user, may import the public facade
                wrong.append(f"{module} imports the package root (import from the defining module instead)")
                continue
            other_layer, other_unit = unit_of(name)
            if other_unit == unit or other_layer < layer or other_layer == layer == 0:
                continue
            wrong.append(
                f"{module} ({LAYERS[layer][0]}) imports {name} ({LAYERS[other_layer][0]}): a layer may only import "
                "the layers below it"
            )
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for name in sorted(GRAPH.get(module, ())):
            if state.get(name) == 1:
                cycles.append(" -> ".join(path[path.index(name) :] + [name]))
            elif name not in state:
                visit(name)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_check_sees_backward_imports():
    """The walker resolves relative, function-local and `from pkg import module` imports (else the checks above
    would pass vacuously)."""
    assert "hf_dspark.metrics" in GRAPH["hf_dspark.generation.stats"]
    assert "hf_dspark.data.prompts" in GRAPH["hf_dspark.data.regenerate"]
    assert "hf_dspark.models" in GRAPH["hf_dspark.generation.speculative"]  # a function-local import
    assert "hf_dspark.hub.formats.base" in GRAPH["hf_dspark.hub.formats"]
    assert unit_of("hf_dspark.evaluation.cli") == (len(LAYERS) - 1, "*.cli")


@pytest.mark.parametrize(
    "old, new, name",
    [
        ("hf_dspark.evaluation.metrics", "hf_dspark.metrics", "AcceptanceStats"),
        ("hf_dspark.generation.sampling", "hf_dspark.sampling", "TokenSampler"),
        ("hf_dspark.models.target", "hf_dspark.target", "TargetSpec"),
    ],
)
def test_moved_modules_still_resolve_with_a_warning(old, new, name):
    import importlib

    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    with pytest.warns(FutureWarning, match=f"{old} moved to {new}"):
        assert getattr(old_module, name) is getattr(new_module, name)
    assert name in dir(old_module)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(AttributeError):
            old_module.no_such_name  # noqa: B018
