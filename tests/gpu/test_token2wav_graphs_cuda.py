"""The Qwen2.5-Omni family's streaming Token2Wav on a CUDA GPU: the DiT solve and the steady vocoder
call replayed from CUDA graphs equal the same calls run eagerly on the same row buckets, sample for
sample and mel frame for mel frame, and the served decoder (built as Code2Wav builds it from the tiny
checkpoint and its engine section) captures them and decodes as its eager twin does. Skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU; this machine has none", allow_module_level=True)

import dataclasses

import numpy as np

from models.qwen_omni.streaming import StreamingToken2Wav
from models.qwen_omni.tiny import ensure_tiny_checkpoint
from models.qwen_omni.token2wav import Token2Wav
from services.code2wav.config import EngineSection
from services.code2wav.families import token2wav_decoder
from tests.unit.qwen_omni_stream_support import drive
from tests.unit.test_qwen_omni_token2wav import random_, tiny_config

BUCKETS = (1, 2, 4, 8)


@pytest.fixture(scope="module")
def tiny():
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    model = random_(Token2Wav(tiny_config()), seed=7)
    with torch.no_grad():
        model.dit.proj_out.bias.sub_(3.0)
    return model.requires_grad_(False).to("cuda")


def _run(model: Token2Wav, graphs: bool, lengths=(23, 30, 9, 14, 40)):
    streaming = StreamingToken2Wav(model, max(BUCKETS), steps=3, row_buckets=BUCKETS)  # buckets <= slots
    if graphs:
        assert streaming.capture_graphs(BUCKETS, max_graphs=99, max_mb=4096) == list(BUCKETS)
    g = torch.Generator().manual_seed(1)
    dit = model.config.dit
    codes = [torch.randint(0, dit.num_embeds + 1, (n,), generator=g) for n in lengths]
    conds = torch.randn(2, dit.enc_emb_dim, generator=g).cuda()
    refs = (torch.rand(2, 20, dit.mel_dim, generator=g) * -6).cuda()
    voices = [streaming.voice(name, conds[i:i + 1], refs[i:i + 1]) for i, name in enumerate("ab")]
    slots = (4, 0, 2, 5, 1)
    for n, slot in enumerate(slots):
        streaming.open(slot, voices[n % 2], seed=100 + n)
    return streaming, drive(streaming, dict(zip(slots, codes, strict=True)))


def test_graph_replays_equal_the_eager_calls_of_the_same_buckets(tiny):
    eager, want = _run(tiny, graphs=False)
    graphed, got = _run(tiny, graphs=True)
    assert eager.shapes == graphed.shapes  # the same calls, padded to the same buckets
    replays = {n: sum(c.replays for c in table.values())
               for n, table in (("dit", graphed.graphs.dit), ("vocoder", graphed.graphs.vocoder))}
    assert replays["dit"] == sum(n for (call, _, _), n in graphed.shapes.items() if call == "dit")
    assert replays["vocoder"] > 0
    for slot, wave in want.waves.items():
        assert torch.equal(got.waves[slot], wave), slot
        assert torch.equal(got.mels[slot], want.mels[slot]), slot
        assert float(wave.abs().max()) > 0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_served_decoder_captures_its_graphs_and_decodes_as_its_eager_twin(tmp_path, dtype):
    folder = ensure_tiny_checkpoint(0, tmp_path)
    engine = EngineSection(max_slots=4)
    cuda = torch.device("cuda")
    decoders = [token2wav_decoder(folder, dtype, cuda, dataclasses.replace(engine, cuda_graphs=on))
                for on in (False, True)]
    assert decoders[1].stream.graphs.buckets == [1, 2, 4] and not decoders[0].stream.graphs.buckets
    decoders[0].stream.row_buckets = decoders[1].stream.row_buckets  # the eager twin pads alike
    codes = np.random.default_rng(3).integers(0, decoders[0].codebook_size, (3, 60, 1)).astype(np.int16)
    speaker = min(decoders[0].voices)
    pcm = [_serve(decoder, codes, speaker) for decoder in decoders]
    for eager, graphed in zip(*pcm, strict=True):
        assert eager.size == graphed.size > 0 and np.array_equal(eager, graphed)
    assert sum(c.replays for c in decoders[1].stream.graphs.dit.values()) > 0


def _serve(decoder, codes: np.ndarray, speaker: int) -> list[np.ndarray]:
    """The codes pushed 5 a tick, each tick one decode of the ready slots, to each stream's end."""
    slots = range(codes.shape[0])
    out: dict[int, list[np.ndarray]] = {slot: [] for slot in slots}
    for slot in slots:
        decoder.open(slot, speaker, seed=slot)
    for tick in range(1000):
        start = 5 * tick
        for slot in slots:
            if start < codes.shape[1]:
                decoder.push(slot, codes[slot, start:start + 5])
                if start + 5 >= codes.shape[1]:
                    decoder.end(slot)
        ready = [s for s in slots if not decoder.finished(s) and decoder.ready(s)]
        for slot, audio in zip(ready, decoder.decode(ready), strict=True):
            out[slot].append(audio.pcm)
        if all(decoder.finished(s) for s in slots):
            break
    return [np.concatenate(out[s]) for s in slots]
