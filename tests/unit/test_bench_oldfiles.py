"""bench/server/oldfiles.sh: a server A/B's old arm is every file under services/ that changed since
a commit, as it was then; a file new since then is left to the tree (and said), others untouched.
git is there wherever the repository was cloned."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.conftest import REPO

SCRIPT = REPO / "bench" / "server" / "oldfiles.sh"


IDENTITY = {"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost", "GIT_COMMITTER_NAME": "t",
            "GIT_COMMITTER_EMAIL": "t@localhost"}


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "commit.gpgsign=false", *args], cwd=cwd, check=True,
                          capture_output=True, text=True, env={**os.environ, **IDENTITY}).stdout


def test_the_old_arm_is_what_changed_since_the_base_as_it_was(tmp_path):
    repo = tmp_path / "repo"
    (repo / "services" / "talker").mkdir(parents=True)
    (repo / "services" / "talker" / "engine.py").write_text("old engine\n")
    (repo / "services" / "talker" / "same.py").write_text("unchanged\n")
    (repo / "docs.md").write_text("old doc\n")
    git(repo, "init", "-q")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    base = git(repo, "rev-parse", "HEAD").strip()
    (repo / "services" / "talker" / "engine.py").write_text("new engine\n")
    (repo / "services" / "talker" / "added.py").write_text("new file\n")
    (repo / "docs.md").write_text("new doc\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "tip")
    done = subprocess.run(["bash", str(SCRIPT), base], cwd=repo, capture_output=True, text=True, check=True)
    old = repo / ".oldfiles"
    assert sorted(p.relative_to(old).as_posix() for p in old.rglob("*") if p.is_file()) == [
        "services/talker/engine.py"]
    assert (old / "services" / "talker" / "engine.py").read_text() == "old engine\n"
    assert "services/talker/added.py is new since" in done.stderr
    assert subprocess.run(["bash", str(SCRIPT)], cwd=repo, capture_output=True).returncode != 0
