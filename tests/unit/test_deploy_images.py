"""The images deploy/compose builds (Dockerfile.engine, Dockerfile.gateway), checked offline
with no container engine: pinned bases and a non-root user; and what the gateway image is built
from: a wheel carrying the playground page (package data), from a context the .dockerignore
does not strip it from. (That the gateway EXPOSEs what compose publishes: test_deploy_compose.py.)
"""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatchcase

from tests.unit.deploy_files import COMPOSE_DIR, PLAYGROUND, REPO


def test_dockerfiles_pin_their_bases_and_run_as_non_root():
    for name in ("Dockerfile.engine", "Dockerfile.gateway"):
        text = (COMPOSE_DIR / name).read_text()
        bases = re.findall(r"^ARG \w*IMAGE=(\S+)$", text, re.MULTILINE)
        assert bases, name
        for base in bases:
            assert re.search(r":\S*\d", base) and not base.endswith(":latest"), f"{name}: {base}"
        users = re.findall(r"^USER (\S+)$", text, re.MULTILINE)
        assert users and users[-1].split(":")[0] not in ("0", "root"), f"{name}: USER {users}"
    gateway = (COMPOSE_DIR / "Dockerfile.gateway").read_text()
    assert "[gateway]" in gateway and "[server]" not in gateway and "TORCH" not in gateway


def _dockerignore_sends(patterns: list[str], path: str) -> bool:
    """Whether a build context with these .dockerignore patterns holds ``path``: the last
    pattern matching the path or a folder above it decides (``!`` sends it again)."""
    def regex(pattern: str) -> re.Pattern:
        parts = re.split(r"(\*\*/|\*\*|\*|\?)", pattern.strip("/"))
        wild = {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*", "?": "[^/]"}
        return re.compile("".join(wild.get(part, re.escape(part)) for part in parts))

    parents = ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 2)]
    sent = True
    for pattern in patterns:
        negated = pattern.startswith("!")
        if any(regex(pattern.removeprefix("!")).fullmatch(p) for p in parents):
            sent = negated
    return sent


def test_gateway_image_installs_the_playground_page():
    # declared as package data, so the wheel (not an editable install) carries it
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    package, _, rel = PLAYGROUND.rpartition("/static/")
    globs = pyproject["tool"]["setuptools"]["package-data"][package.replace("/", ".")]
    assert any(fnmatchcase(f"static/{rel}", glob) for glob in globs), globs
    assert (REPO / PLAYGROUND).is_file()
    text = (COMPOSE_DIR / "Dockerfile.gateway").read_text()
    assert re.search(r"pip wheel .*--wheel-dir /wheels \.$", text, re.MULTILINE)
    assert "/wheels/voxring-*.whl" in text and not re.search(r"pip install[^\n]*(-e|--editable)\b", text)
    # and the build context holds it (the Dockerfile's COPY services/ takes it from there)
    ignore = (COMPOSE_DIR / "Dockerfile.gateway.dockerignore").read_text().splitlines()
    patterns = [line.strip() for line in ignore if line.strip() and not line.startswith("#")]
    assert all(" #" not in p for p in patterns), "a .dockerignore has no end-of-line comments"
    for path in (PLAYGROUND, "pyproject.toml", "services/gateway/http/app.py"):
        assert _dockerignore_sends(patterns, path), f"{path} is left out of the build context"
    for path in (".venv/bin/python", ".git/HEAD", "services/gateway/__pycache__/config.cpython-311.pyc"):
        assert not _dockerignore_sends(patterns, path), f"{path} is sent to the build context"
    # the matcher has teeth
    assert not _dockerignore_sends([*patterns, "services/**/static"], PLAYGROUND)

