"""The rooms' import rules (docs/architecture.md, Where each concern lives), read from every module's import
statements, lazy ones inside functions included: imports run servicer -> engine ->
scheduler / runner -> models / kernels; nothing under kernels/ or models/ imports
services; talker and Code2Wav never import each other; the gateway and services/common
import neither torch nor models, kernels or an engine; voxring/ (the client package) imports
no services, torch, models, kernels or bench. And there is no import cycle among the project's
modules (services, voxring, models, kernels, bench), lazy imports included: a cycle a
function-local import hides still ties the modules into one (imports under
``if TYPE_CHECKING:`` never run and make none)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO

ENGINES_AND_MODELS = ("torch", "triton", "models", "kernels", "services.talker", "services.code2wav",
                      "services.transport")
RULES = {  # folder -> the modules nothing in it may import (a name and everything under it)
    "kernels": ("services",),
    "models": ("services",),
    "services/talker": ("services.code2wav",),
    "services/code2wav": ("services.talker",),
    "services/gateway": ENGINES_AND_MODELS,
    "services/common": (*ENGINES_AND_MODELS, "services.gateway"),
    "services/transport": ("torch", "models", "kernels", "services.talker", "services.code2wav",
                           "services.gateway"),
    # the client package (SDK, CLI, launcher) installs and runs without the server's code or torch;
    # bench/ is not installed at all
    "voxring": ("services", "torch", "triton", "models", "kernels", "bench"),
}
PROJECT = ("services", "voxring", "models", "kernels", "bench")  # the packages the cycle check reads


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def _under(module: str, banned: str) -> bool:
    return module == banned or module.startswith(banned + ".")


@pytest.mark.parametrize("folder", sorted(RULES))
def test_folder_keeps_its_import_rules(folder):
    files = sorted((REPO / folder).rglob("*.py"))
    assert files, f"{folder} has no modules"
    broken = [f"{path.relative_to(REPO)} imports {module}"
              for path in files for module in sorted(imported_modules(path))
              if any(_under(module, banned) for banned in RULES[folder])]
    assert not broken, "\n".join(broken)


def test_the_rule_reader_sees_lazy_and_from_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import os\nfrom services.talker import engine\n\ndef f():\n"
                      "    import torch.nn\n    from . import sibling\n")
    found = imported_modules(module)
    assert {"os", "services.talker", "services.talker.engine", "torch.nn"} <= found
    assert not any(m.startswith(".") or m == "sibling" for m in found)
    assert _under("torch.nn", "torch") and not _under("torchaudio", "torch")


# --- no import cycle -------------------------------------------------------------------------


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The nodes under ``if TYPE_CHECKING:`` (never run: annotations only, no import cycle)."""
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in (getattr(node.test, "id", None),
                                                            getattr(node.test, "attr", None)):
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def imported_names(path: Path, module: str) -> set[str]:
    """Every name ``module`` (at ``path``) imports when it runs, lazy ones included (not those
    under ``if TYPE_CHECKING:``), relative ones made absolute; ``from pkg import name`` gives
    ``pkg.name`` (module_graph keeps the longest part of a name that is a module: ``pkg``
    when ``name`` is not a module)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    skipped = _type_checking_only(tree)
    names = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def module_graph(root: Path, packages: tuple[str, ...] = PROJECT) -> dict[str, set[str]]:
    """{module: the project modules it imports} for every .py file under ``packages``."""
    files = {module_name(path, root): path for package in packages for path in (root / package).rglob("*.py")}
    graph = {}
    for module, path in files.items():
        targets = set()
        for name in imported_names(path, module):
            parts = name.split(".")
            found = next((".".join(parts[:n]) for n in range(len(parts), 0, -1)
                          if ".".join(parts[:n]) in files), None)
            if found is not None and found != module:
                targets.add(found)
        graph[module] = targets
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components (Tarjan's, without recursion), each sorted."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        return node, iter(sorted(graph.get(node, ())))

    for root in sorted(graph):
        if root in index:
            continue
        work = [visit(root)]
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while not component or component[-1] != node:
                        component.append(stack.pop())
                        on_stack.discard(component[-1])
                    components.append(sorted(component))
            elif child not in index:
                work.append(visit(child))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def import_cycles(graph: dict[str, set[str]]) -> list[str]:
    """Each component of more than one module, with the imports that tie it together."""
    cycles = []
    for component in strongly_connected(graph):
        if len(component) > 1:
            edges = [f"    {m} -> {', '.join(sorted(graph[m] & set(component)))}" for m in component]
            cycles.append("\n".join([f"cycle of {len(component)} modules:", *edges]))
    return cycles


def test_no_import_cycle():
    graph = module_graph(REPO)
    assert len(graph) > 100 and "services.gateway.pipeline" in graph
    cycles = import_cycles(graph)
    assert not cycles, "\n".join(cycles)


def test_the_cycle_finder_sees_a_cycle_through_lazy_relative_and_from_imports(tmp_path):
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    for name, text in {"__init__.py": "VALUE = 1\n",
                       "a.py": "from pkg import b, VALUE\n",       # b is a module, VALUE is not
                       "b.py": "from .sub import c\n",
                       "sub/__init__.py": "",
                       "sub/c.py": "def f():\n    from ..a import x\n",  # lazy and relative: back to a
                       "d.py": "import pkg.a\nimport os\n",  # imports the cycle, not in it
                       "e.py": "import typing\nif typing.TYPE_CHECKING:\n    from pkg.f import F\n",
                       "f.py": "from pkg.e import E\n"}.items():  # e's import of f never runs
        (package / name).write_text(text)
    graph = module_graph(tmp_path, ("pkg",))
    assert graph["pkg.a"] == {"pkg", "pkg.b"} and graph["pkg.b"] == {"pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"} and graph["pkg.d"] == {"pkg.a"} and graph["pkg.e"] == set()
    cycles = import_cycles(graph)
    assert len(cycles) == 1 and "cycle of 3 modules" in cycles[0], cycles
    assert "pkg.sub.c -> pkg.a" in cycles[0] and "pkg.d" not in cycles[0]
    assert strongly_connected({"x": {"y"}, "y": set()}) == [["y"], ["x"]]
