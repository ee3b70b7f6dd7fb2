"""The committed generated code matches protos/, and the client side needs no torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from voxring.v1 import synthesizer_pb2 as pb


def test_generated_code_is_fresh(tmp_path):
    """Fails when a .proto changed without `make proto` (or the generated files were
    edited by hand): regenerates with the pinned grpcio-tools and compares bytes."""
    from grpc_tools import protoc

    protos = sorted((REPO / "protos" / "voxring" / "v1").glob("*.proto"))
    assert protos
    args = ["protoc", f"-I{REPO / 'protos'}", f"--python_out={tmp_path}",
            f"--pyi_out={tmp_path}", f"--grpc_python_out={tmp_path}", *map(str, protos)]
    assert protoc.main(args) == 0
    generated = {p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*")}
    committed = {p.relative_to(REPO) for p in (REPO / "voxring" / "v1").glob("*_pb2*.py*")}
    assert generated == committed, "run `make proto` and commit the result"
    stale = [str(p) for p in generated if (tmp_path / p).read_bytes() != (REPO / p).read_bytes()]
    assert not stale, f"stale generated code (run `make proto`): {stale}"


BLOCKER = """
import importlib.abc, sys
BLOCKED = {blocked!r}
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split('.')[0] in BLOCKED:
            raise ImportError(f'{{name}} must not be imported here')
sys.meta_path.insert(0, Block())
{imports}
print('ok')
"""


@pytest.mark.parametrize(("blocked", "imports"), [
    # the SDK and CLI: neither torch nor numpy nor the engines
    (("torch", "triton", "transformers", "numpy", "services"),
     "import voxring, voxring.cli, voxring.stack, voxring.demo, voxring.client, voxring.loadgen\n"
     "from voxring.v1 import synthesizer_pb2_grpc, talker_pb2_grpc, code2wav_pb2_grpc"),
    # the gateway: no torch (numpy serves its audio encoders)
    (("torch", "triton", "transformers"),
     "import services.gateway.servicer, services.gateway.__main__, services.gateway.pipeline"),
], ids=["client-side", "gateway"])
def test_imports_stay_light(blocked, imports):
    code = BLOCKER.format(blocked=set(blocked), imports=imports)
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_optional_fields_distinguish_unset_from_zero():
    request = pb.SynthesizeSpeechRequest(text="hi")
    for name in ("temperature", "top_k", "top_p", "repetition_penalty", "repetition_window",
                 "seed", "max_audio_seconds"):
        assert not request.HasField(name)
        setattr(request, name, 0)
        assert request.HasField(name), name


@pytest.mark.parametrize("name", ["STOP", "LENGTH", "CANCELLED", "DEADLINE", "ERROR", "STALLED"])
def test_finish_reasons_cover_the_endings_table(name):
    from voxring.v1 import common_pb2

    assert common_pb2.FinishReason.Value(f"FINISH_REASON_{name}") > 0


def test_protos_use_versioned_package():
    for proto in (REPO / "protos" / "voxring" / "v1").glob("*.proto"):
        assert "package voxring.v1;" in proto.read_text(), proto
    assert Path(pb.__file__).parent == REPO / "voxring" / "v1"
