"""The codec's checkpoints and inputs: every key transformers writes is consumed, the real
Mimi sizes match transformers' shapes, and bad decode calls change no slot."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from models.checkpoint import CheckpointError
from models.mimi.config import MimiConfig
from models.mimi.loader import CSM_PREFIX, build_meta, load_codec, random_codec
from models.mimi.model import CodecInputError, all_streaming_state
from models.tiny.talker import tiny_config, write_tiny_checkpoint
from tests.parity.tiny_reference import save_transformers_mimi, save_transformers_tiny

transformers = pytest.importorskip("transformers")

# transformers' in-memory Mimi names -> Mimi's flat on-disk names (what save_pretrained writes)
ON_DISK = {"encoder.encoder_seanet.": "encoder.", "encoder.encoder_transformer.": "encoder_transformer.",
           "encoder.downsample.": "downsample.", "decoder.upsample.": "upsample.",
           "decoder.decoder_transformer.": "decoder_transformer.", "decoder.decoder_seanet.": "decoder."}


def _on_disk(name: str) -> str:
    for memory, disk in ON_DISK.items():
        if name.startswith(memory):
            return disk + name[len(memory):]
    return name


def _transformers_shapes(config) -> dict[str, tuple]:
    with torch.device("meta"):
        model = transformers.MimiModel(config)
    return {_on_disk(k): tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tiny_codec(tmp_path_factory):
    folder = write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "t", seed=0)
    return folder, load_codec(folder)


def test_every_codec_key_transformers_writes_is_consumed(tmp_path):
    csm = save_transformers_tiny(tmp_path / "csm", seed=4)
    mimi = save_transformers_mimi(tmp_path / "mimi", seed=4)
    for folder, prefix in ((csm, CSM_PREFIX), (mimi, "")):
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            disk = {k[len(prefix):] for k in f.keys() if k.startswith(prefix)}  # noqa: SIM118
        model = load_codec(folder)
        assert disk == set(model.state_dict())
        stored = load_file(str(folder / "model.safetensors"))
        for name, tensor in model.state_dict().items():
            assert torch.equal(tensor, stored[prefix + name]), name


def test_name_mapping_is_what_save_pretrained_writes(tmp_path):
    folder = save_transformers_mimi(tmp_path / "mimi", seed=0)
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        disk = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118 - not a dict
    config = transformers.MimiConfig.from_pretrained(folder)
    assert _transformers_shapes(config) == disk


def test_real_mimi_sizes_equal_transformers_on_meta():
    config = transformers.MimiConfig()  # the real Mimi: 32 quantizers of 2048, hidden 512
    ours = build_meta(MimiConfig.from_dict(config.to_dict()))
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == _transformers_shapes(config)
    assert ours.config.samples_per_frame == 1920 and ours.config.frame_rate == 12.5
    params = sum(p.numel() for p in ours.parameters())
    assert 70e6 < params < 90e6  # ~79 M


def test_csm_checkpoint_without_codec_weights_lists_them(tiny_codec, tmp_path):
    folder, _ = tiny_codec
    tensors = load_file(str(folder / "model.safetensors"))
    target = tmp_path / "no-codec"
    target.mkdir()
    (target / "config.json").write_text((folder / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if not k.startswith(CSM_PREFIX)},
              str(target / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing keys: codec_model\.decoder\.layers\.0\.conv\.bias"):
        load_codec(target)


def test_unsupported_mimi_config_is_named():
    raw = tiny_config()["codec_config"] | {"pad_mode": "reflect", "audio_channels": 2}
    with pytest.raises(CheckpointError, match=r"audio_channels=2 \(mono only\); pad_mode='reflect'"):
        MimiConfig.from_dict(raw)


def test_default_model_carries_codec_weights_transformers_accepts(tiny_codec):
    folder, ours = tiny_codec
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    model, info = transformers.CsmForConditionalGeneration.from_pretrained(
        folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    codes = torch.randint(0, 64, (1, 8, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.codec_model.decode(codes).audio_values[:, 0]
    torch.testing.assert_close(ours.decode(codes), expected, atol=1e-6, rtol=1e-5)
    assert json.loads((folder / "config.json").read_text())["codec_config"]["codebook_size"] == 64


@pytest.mark.parametrize(("slots", "codes_shape", "low_high", "needle"), [
    ([7], (1, 8, 2), (0, 64), "slot ids out of range [0, 4): [7]"),
    ([-1], (1, 8, 2), (0, 64), "slot ids out of range"),
    ([1, 1], (2, 8, 2), (0, 64), "slot ids repeat"),
    ([1], (1, 9, 2), (0, 64), "codes have 9 codebooks"),
    ([1], (1, 8, 2), (64, 65), "codes must be in [0, 64)"),
    ([1], (1, 8, 2), (-3, -2), "codes must be in [0, 64)"),
    ([1, 2], (1, 8, 2), (0, 64), "codes must be [batch=2, codebooks, frames]"),
])
def test_bad_decode_calls_change_no_slot(tiny_codec, slots, codes_shape, low_high, needle):
    _, codec = tiny_codec
    codec.allocate(4)
    good = torch.randint(0, 64, (4, 8, 3), generator=torch.Generator().manual_seed(1))
    codec.decode_chunk([0, 1, 2, 3], good)  # every slot has history
    before = [t.clone() for t in all_streaming_state(codec)]
    codes = torch.randint(*low_high, codes_shape, generator=torch.Generator().manual_seed(2))
    with pytest.raises(CodecInputError) as info:
        codec.decode_chunk(slots, codes)
    assert needle in str(info.value)
    for old, new in zip(before, all_streaming_state(codec), strict=True):
        assert torch.equal(old, new)


def test_decode_without_a_pool_is_a_clear_error(tmp_path):
    folder = write_tiny_checkpoint(tmp_path / "t", seed=3)
    codec = load_codec(folder)
    with pytest.raises(CodecInputError, match="allocate"):
        codec.decode_chunk([0], torch.zeros(1, 8, 1, dtype=torch.int64))


def test_random_codec_decodes_codes_to_distinct_audio():
    """The benchmarks' random-weight codec: usable codebooks, the same weights for one seed."""
    config = MimiConfig.from_dict(tiny_config()["codec_config"])
    codec = random_codec(config, "cpu", torch.float32)
    again = random_codec(config, "cpu", torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(codec.state_dict().values(), again.state_dict().values(),
                                                  strict=True))
    assert not codec.training and not any(p.requires_grad for p in codec.parameters())
    codec.allocate(2)
    ids = torch.arange(2)
    codes = torch.stack([torch.zeros(codec.num_codebooks, 2, dtype=torch.int64),
                         torch.ones(codec.num_codebooks, 2, dtype=torch.int64)])
    with torch.inference_mode():
        audio = codec.decode_step(ids, codes)
    assert audio.shape == (2, 2 * config.samples_per_frame) and torch.isfinite(audio).all()
    assert not torch.equal(audio[0], audio[1])  # codebook entries differ: not all-zero sums


def _slot_rows(state: torch.Tensor, slots: list[int]) -> torch.Tensor:
    return state[:, slots] if state.dim() == 5 else state[slots]  # keys, values: [layers, slots, ...]


def test_a_reset_zeroes_every_state_of_its_slots_and_no_other(tiny_codec):
    """The convolutions' states are views of one pool and the transformer's keys and values one
    tensor (a reset is three writes): each module's state must still be its own columns."""
    _, codec = tiny_codec
    codec.allocate(4)
    codes = torch.randint(0, 64, (4, 8, 3), generator=torch.Generator().manual_seed(1))
    codec.decode_chunk([0, 1, 2, 3], codes)
    before = [t.clone() for t in all_streaming_state(codec)]
    assert all(_slot_rows(t, [1]).any() for t in before if t.numel())  # every state holds some history
    codec.reset(torch.tensor([1, 3]))
    for old, new in zip(before, all_streaming_state(codec), strict=True):
        assert not _slot_rows(new, [1, 3]).any()
        assert torch.equal(_slot_rows(new, [0, 2]), _slot_rows(old, [0, 2]))
    # a reset slot decodes as a fresh one: the same as slot 1's first call
    again = codec.decode_chunk([1], codes[1:2])
    codec.allocate(4)
    assert torch.equal(again, codec.decode_chunk([1], codes[1:2]))
