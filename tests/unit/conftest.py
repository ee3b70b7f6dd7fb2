"""Fixtures shared by the unit tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """The tiny CSM talker's checkpoint (voxring-tiny, seed 0), written once per test module. A
    module that needs another model's defines its own ``folder``."""
    from models.tiny.talker import write_tiny_checkpoint
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "t", seed=0)
