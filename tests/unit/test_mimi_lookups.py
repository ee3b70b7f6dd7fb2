"""Code2Wav's codec launches fewer kernels a decode (models/mimi): the quantizer looks every
codebook up in one table and sums once, position ranges are views of one resident ramp, the decoder
transformer's q, k and v are one product, RoPE rotates q and k together with a roll and a signed
sin, and its attention mask is made additive once a step. Each gives what the launches it replaces
gave. CPU."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from models.mimi import masking
from models.mimi.config import MimiConfig
from models.mimi.loader import random_codec
from models.mimi.transformer import additive_mask, rotary
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


def test_roll_and_signed_sin_rotate_as_rotate_half_bit_for_bit():
    torch.manual_seed(3)
    head_dim, inv_freq = 64, 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    positions = torch.randint(0, 5000, (3, 4))
    x = torch.randn(3, 4, 6, head_dim).bfloat16()
    cos, signed_sin = rotary(positions, inv_freq, torch.bfloat16)
    freqs = positions[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    sin = emb.sin().bfloat16()[:, :, None]
    assert torch.equal(cos, emb.cos().bfloat16()[:, :, None])
    rotate_half = torch.cat((-x[..., head_dim // 2:], x[..., : head_dim // 2]), dim=-1)
    assert torch.equal(x * cos + x.roll(head_dim // 2, dims=-1) * signed_sin, x * cos + rotate_half * sin)


def test_allocate_packs_q_k_v_into_one_product_of_views():
    codec = random_codec(MimiConfig.from_dict(tiny_config()["codec_config"]), "cpu", torch.float64)
    attention = codec.decoder_transformer.layers[0].self_attn
    x = torch.randn(2, 3, codec.config.hidden_size, dtype=torch.float64)
    cos, sin = rotary(torch.arange(3).expand(2, 3), codec.decoder_transformer.inv_freq, torch.float64)
    want = attention.project(x, cos, sin)  # three products, before packing
    codec.allocate(2)
    packed = attention.qkv_weight
    assert packed is not None and packed.shape[0] == sum(
        p.weight.shape[0] for p in (attention.q_proj, attention.k_proj, attention.v_proj))
    for proj in (attention.q_proj, attention.k_proj, attention.v_proj):  # views: no memory duplicated
        assert proj.weight.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr()
    for got, expected in zip(attention.project(x, cos, sin), want, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_the_additive_mask_is_what_attention_makes_of_the_boolean_one_and_its_rows_are_aligned():
    torch.manual_seed(4)
    visible = torch.rand(3, 1, 4, 254) < 0.7
    visible[..., 0] = True  # every query sees a key
    mask = additive_mask(visible, torch.float32)
    assert torch.equal(mask, torch.where(visible, 0.0, float("-inf")))
    assert all(stride % 8 == 0 for stride in mask.stride()[:-1]) and mask.stride(-1) == 1
    q, k, v = torch.randn(3, 2, 4, 16), torch.randn(3, 2, 254, 16), torch.randn(3, 2, 254, 16)
    assert torch.equal(F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
                       F.scaled_dot_product_attention(q, k, v, attn_mask=visible))
