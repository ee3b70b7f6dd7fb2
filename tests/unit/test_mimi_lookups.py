"""Code2Wav's codec launches fewer kernels a decode (models/mimi): the quantizer looks every
codebook up in one table and sums once, and position ranges are views of one resident ramp.
Both give what the per-codebook lookups and ``torch.arange`` gave. CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.mimi import masking
from models.mimi.config import MimiConfig
from models.mimi.loader import random_codec
from models.tiny.talker import tiny_config


def test_one_lookup_and_one_sum_equal_each_codebook_looked_up_and_added():
    codec = random_codec(MimiConfig.from_dict(tiny_config()["codec_config"]), "cpu", torch.float64)
    quantizer = codec.quantizer
    k = codec.num_codebooks
    codes = torch.randint(0, codec.config.codebook_size, (3, k, 5))
    want = 0
    for rvq, part in ((quantizer.semantic_residual_vector_quantizer, codes[:, :quantizer.num_semantic]),
                      (quantizer.acoustic_residual_vector_quantizer, codes[:, quantizer.num_semantic:])):
        summed = sum(F.embedding(part[:, i], rvq.layers[i].codebook.embed) for i in range(part.shape[1]))
        summed = summed.transpose(1, 2)
        want = want + (rvq.output_proj(summed) if rvq.output_proj is not None else summed)
    torch.testing.assert_close(quantizer.decode(codes), want, rtol=1e-12, atol=1e-12)
    fewer = codes[:, : quantizer.num_semantic + 1]  # a codec may be given fewer acoustic codebooks
    assert quantizer.decode(fewer).shape == want.shape


def test_a_ramp_view_is_the_range_and_without_a_ramp_or_past_it_a_new_one():
    device = torch.device("cpu")
    masking.prepare(device)
    ramp = masking._RAMPS[device]
    view = masking.arange(-250, 16, device)
    assert torch.equal(view, torch.arange(-250, 16)) and view.data_ptr() >= ramp.data_ptr()
    assert view.untyped_storage().data_ptr() == ramp.untyped_storage().data_ptr()  # a view: no launch
    past = masking.arange(0, masking.RAMP_HIGH + 3, device)
    assert torch.equal(past, torch.arange(masking.RAMP_HIGH + 3))
    elsewhere = masking.arange(2, 9, torch.device("meta"))  # a device without a ramp
    assert elsewhere.device.type == "meta" and elsewhere.shape == (7,)


def test_the_masks_and_windows_read_the_ramp_as_they_read_arange():
    masking.prepare(torch.device("cpu"))
    lengths = torch.tensor([3, 1, 4])
    assert torch.equal(masking.valid_mask(lengths, 4)[:, 0],
                       torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool))
    x = torch.arange(3 * 2 * 6).view(3, 2, 6)
    window = masking.take_window(x, torch.tensor([0, 2, 3]), 3, -1)
    assert torch.equal(window[1, 0], torch.tensor([14, 15, 16]))
    assert torch.equal(window[2, 1], torch.tensor([33, 34, 35]))
