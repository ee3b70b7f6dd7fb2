"""CSM checkpoints: config spellings, the real csm-1b shapes, strict loading, bad
checkpoints with clear errors, and the deterministic voxring-tiny generator."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.csm.config import CheckpointError, CsmConfig, RopeConfig
from models.csm.loader import CODEC_PREFIX, TIED, build_meta, load_talker
from models.tiny.talker import (
    SPECIAL_TOKENS,
    build_tokenizer,
    ensure_tiny_checkpoint,
    tiny_config,
    write_tiny_checkpoint,
)
from tests.conftest import REPO

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "voxring-tiny", seed=0)


def _copy(folder: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(folder, target)
    return target


# --- the real sizes ------------------------------------------------------------------


def test_csm_1b_shapes_equal_transformers_on_meta():
    from tests.parity.tiny_reference import LLAMA3_DEPTH

    rope_1b = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
               "high_freq_factor": 0.5, "low_freq_factor": 0.125,
               "original_max_position_embeddings": 1024}
    config = transformers.CsmConfig(
        rope_parameters=rope_1b,
        depth_decoder_config={"rope_parameters": {**LLAMA3_DEPTH, "original_max_position_embeddings": 16}})
    with torch.device("meta"):
        ref = transformers.CsmForConditionalGeneration(config)
    ref_shapes = {name: tuple(p.shape) for name, p in ref.named_parameters(remove_duplicate=False)
                  if not name.startswith(CODEC_PREFIX)}
    ours = build_meta(CsmConfig.from_dict(config.to_dict()))
    our_shapes = {name: tuple(p.shape) for name, p in ours.named_parameters(remove_duplicate=False)}
    assert our_shapes == ref_shapes
    assert our_shapes["lm_head.weight"] == (2051, 2048)
    assert our_shapes["depth_decoder.codebooks_head.weight"] == (31, 1024, 2051)
    parsed = CsmConfig.from_dict(config.to_dict())
    assert (parsed.codebook_size, parsed.num_codebooks, parsed.frame_rate) == (2048, 32, 12.5)
    assert parsed.backbone.rope == RopeConfig("llama3", 500000.0, 32.0, 0.125, 0.5, 1024)


def test_every_key_transformers_writes_is_consumed(tmp_path):
    """All non-codec keys of a save_pretrained checkpoint are the talker's parameters,
    the tied embedding is on disk once, and loading consumes every one of them."""
    from tests.parity.tiny_reference import save_transformers_tiny

    folder = save_transformers_tiny(tmp_path / "tf", seed=3)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        disk = set(f.keys())
    talker_keys = {k for k in disk if not k.startswith(CODEC_PREFIX)}
    codec_keys = disk - talker_keys
    assert codec_keys and all(k.startswith(CODEC_PREFIX) for k in codec_keys)
    assert "depth_decoder.model.embed_tokens.weight" in disk
    assert not set(TIED) & disk  # the alias is never written
    model = load_talker(folder)
    params = dict(model.named_parameters(remove_duplicate=False))
    assert talker_keys == set(params) - set(TIED)
    stored = load_file(str(folder / "model.safetensors"))
    for key in talker_keys:
        assert torch.equal(params[key], stored[key]), key
    assert (model.backbone_model.embed_tokens.embed_audio_tokens.weight.data_ptr()
            == model.depth_decoder.model.embed_tokens.weight.data_ptr())


# --- config spellings -----------------------------------------------------------------


def _to_4x(raw: dict) -> dict:
    """The transformers 4.x spelling: rope_scaling + top-level rope_theta."""
    def convert(section: dict) -> dict:
        section = dict(section)
        params = dict(section.pop("rope_parameters"))
        section["rope_theta"] = params.pop("rope_theta")
        section["rope_scaling"] = params
        return section

    converted = convert(raw)
    converted["depth_decoder_config"] = convert(raw["depth_decoder_config"])
    return converted


def test_config_in_4x_spelling_loads_the_same(tiny, tmp_path):
    raw = json.loads((tiny / "config.json").read_text())
    assert CsmConfig.from_dict(_to_4x(raw)) == CsmConfig.from_dict(raw)
    folder = _copy(tiny, tmp_path)
    (folder / "config.json").write_text(json.dumps(_to_4x(raw)))
    ours, base = load_talker(folder), load_talker(tiny)
    for (name, a), (_, b) in zip(ours.state_dict().items(), base.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(ours.depth_decoder.model.rotary.cos, base.depth_decoder.model.rotary.cos)
    old_type_key = _to_4x(raw)
    old_type_key["rope_scaling"]["type"] = old_type_key["rope_scaling"].pop("rope_type")
    assert CsmConfig.from_dict(old_type_key).backbone.rope == CsmConfig.from_dict(raw).backbone.rope


# --- bad checkpoints --------------------------------------------------------------------


def _rewrite(folder: Path, mutate) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    mutate(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        load_talker(tmp_path)


def test_missing_weights(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_talker(folder)


def test_truncated_safetensors(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        load_talker(folder)


def test_wrong_shape_names_the_key(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    _rewrite(folder, lambda t: t.update({"lm_head.weight": t["lm_head.weight"][:-1].clone()}))
    with pytest.raises(CheckpointError, match=r"wrong shapes: lm_head\.weight: \(66, 128\) on disk"):
        load_talker(folder)


def test_missing_and_unexpected_keys_are_listed(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)

    def mutate(tensors):
        tensors.pop("backbone_model.norm.weight")
        tensors["backbone_model.extra.weight"] = torch.zeros(2)
        tensors["codec_model.decoder.layers.0.conv.weight"] = torch.zeros(2)  # not unexpected

    _rewrite(folder, mutate)
    with pytest.raises(CheckpointError) as info:
        load_talker(folder)
    message = str(info.value)
    assert "missing keys: backbone_model.norm.weight" in message
    assert "unexpected keys: backbone_model.extra.weight" in message
    assert "codec_model" not in message


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda c: c["rope_parameters"].update(rope_type="yarn"), "unknown rope type 'yarn'"),
    (lambda c: c["rope_parameters"].pop("factor"), "llama3 rope needs factor"),
    (lambda c: c.pop("num_codebooks"), "num_codebooks must be a positive integer"),
    (lambda c: c["depth_decoder_config"].update(vocab_size=70), "vocab_size differs"),
    (lambda c: c.update(model_type="llama"), "model_type 'llama' is not 'csm'"),
    (lambda c: c.update(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
    (lambda c: c.pop("codec_config"), "codec_config is missing"),
])
def test_bad_config_names_the_cause(tiny, tmp_path, mutate, needle):
    folder = _copy(tiny, tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    mutate(raw)
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config\.json") as info:
        load_talker(folder)
    assert needle in str(info.value)


def test_sharded_checkpoint_loads(tiny, tmp_path):
    folder = _copy(tiny, tmp_path)
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:])):
        shard = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({k: tensors[k] for k in part}, str(folder / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_talker(folder, dtype="bf16")
    assert model.lm_head.weight.dtype == torch.bfloat16
    assert torch.equal(model.lm_head.weight, tensors["lm_head.weight"].bfloat16())
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(CheckpointError, match="shard files missing"):
        load_talker(folder)


def test_unknown_dtype(tiny):
    with pytest.raises(CheckpointError, match="dtype 'int8'"):
        load_talker(tiny, dtype="int8")


# --- the generator ---------------------------------------------------------------------


def test_same_seed_same_bytes_other_seed_other_weights(tmp_path):
    a = write_tiny_checkpoint(tmp_path / "a", seed=7)
    b = write_tiny_checkpoint(tmp_path / "b", seed=7)
    c = write_tiny_checkpoint(tmp_path / "c", seed=8)
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(names)
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_tokenizer_matches_the_config():
    config = tiny_config()
    tokenizer = build_tokenizer()
    ids = tokenizer.encode("[0]Hello, wörld").ids
    assert ids[0] == config["bos_token_id"] and ids[-1] == 257
    assert max(ids) < config["text_vocab_size"]
    assert tokenizer.decode(ids) == "[0]Hello, wörld"
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == [256, 257, 258, 259]
    assert config["audio_token_id"] == 258 and config["audio_eos_token_id"] == 259


def test_transformers_loads_the_tokenizer(tiny):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tiny)
    assert tokenizer("[0]Hi").input_ids == build_tokenizer().encode("[0]Hi").ids


ENSURE = """
import sys
from models.tiny.talker import ensure_tiny_checkpoint
print(ensure_tiny_checkpoint(seed=5, root=sys.argv[1]))
"""


def test_two_processes_creating_it_at_once_get_the_same_complete_checkpoint(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", ENSURE, str(tmp_path)], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        outputs.append(out.strip())
    assert outputs[0] == outputs[1]
    folder = Path(outputs[0])
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")) == [folder.name]
    reference = write_tiny_checkpoint(tmp_path.parent / "ref-seed5", seed=5)
    for path in reference.iterdir():
        assert (folder / path.name).read_bytes() == path.read_bytes(), path.name
    assert ensure_tiny_checkpoint(seed=5, root=tmp_path) == folder  # found, not rebuilt
    load_talker(folder)
