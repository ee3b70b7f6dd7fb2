"""The rooms' import rules (../shared/LAYOUT.md), read from every module's import
statements, lazy ones inside functions included: imports run servicer -> engine ->
scheduler / runner -> models / kernels; nothing under kernels/ or models/ imports
services; talker and Code2Wav never import each other; the gateway and services/common
import neither torch nor models, kernels or an engine."""

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
}


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
