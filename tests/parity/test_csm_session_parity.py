"""A talker session against transformers' CsmForConditionalGeneration (CPU, fp32, greedy): the
codes of a session's second segment, spoken in the slot its first segment left (only the end
frame and the new text prefilled), equal transformers' codes for the same two-turn conversation:
turn 1's text, its frames and the all-EOS end frame, then turn 2's text (docs/architecture.md,
Model families)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models.csm.loader import load_talker
from models.tiny.talker import ensure_tiny_checkpoint
from tests.unit.session_support import (
    make_session_engine,
    run_until,
    segment,
    segments_of,
    session_request,
    text_ids,
)

transformers = pytest.importorskip("transformers")
FRAMES = 20


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # the voxring checkpoint has no codec weights yet
    folder = ensure_tiny_checkpoint(seed=0, root=tmp_path_factory.mktemp("tiny"))
    return load_talker(folder), transformers.CsmForConditionalGeneration.from_pretrained(folder).eval()


def test_segment_two_equals_transformers_on_the_two_turn_conversation(pair):
    ours, ref = pair
    config = ours.config
    ids1, ids2 = text_ids("The first turn, spoken now."), text_ids("Then a second one.", speaker=1)
    engine, sink = make_session_engine(ours)
    session = session_request(1, ids1, max_frames=12)
    engine.scheduler.add(session)
    run_until(engine, lambda: engine.scheduler.idle.get(("c", 1)) is not None)
    engine.scheduler.append("c", 1, segment(ids2, max_frames=FRAMES, last=True))
    prefilled = engine.counters.prefill_tokens
    run_until(engine, lambda: session.finish is not None)
    assert engine.counters.prefill_tokens - prefilled == 1 + len(ids2)  # the slot was reused
    (frames1, _, _), (frames2, _, _) = segments_of(sink, 1)
    assert len(frames1) and len(frames2)
    eos = torch.full((1, config.num_codebooks), config.codebook_eos_token_id)
    turn1 = torch.from_numpy(frames1.astype(np.int64))
    suppress = list(range(config.codebook_size, config.audio_vocab_size))
    with torch.no_grad():
        embeds = torch.cat([ref.embed_text_tokens(torch.tensor(ids1)),
                            ref.backbone_model.embed_tokens(torch.cat([turn1, eos])[None])[0],
                            ref.embed_text_tokens(torch.tensor(ids2))])[None]
        mask = torch.ones(embeds.shape[:2], dtype=torch.long)
        out = ref.generate(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=FRAMES,
                           do_sample=False, depth_decoder_do_sample=False,
                           suppress_tokens=suppress, depth_decoder_suppress_tokens=suppress)
    theirs = out[0].numpy()
    # transformers keeps a stop frame and stops after it; voxring stops without emitting it
    stop = np.flatnonzero((theirs[:, :-1] == config.codebook_eos_token_id).all(axis=1))
    expected = theirs[: stop[0]] if len(stop) else theirs
    np.testing.assert_array_equal(frames2.astype(np.int64), expected)
