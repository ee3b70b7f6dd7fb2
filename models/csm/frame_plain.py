"""The plain frame: a frame's depth codes and backbone step through ``Transformer.forward`` (the plain
layers), the reference every fused path is checked against. ``CsmTalker`` runs it until ``pack_weights``
switches the model to ``frame_fused``'s; prefill takes the plain layers either way."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from models.family import FrameInputs

if TYPE_CHECKING:
    from models.csm.model import CsmCaches, CsmTalker


class PlainFrame:
    """The plain layers' frame of ``model`` (``CsmTalker.decode_frame`` calls it)."""

    def __init__(self, model: CsmTalker) -> None:
        self.model = model

    def depth_codes(self, inputs: FrameInputs, caches: CsmCaches, logits_out: list | None) -> torch.Tensor:
        """The frame's codes [B, N]: codebook 0 from the backbone state, then the depth decoder with a fresh
        context, one position a codebook."""
        model = self.model
        b = inputs.hidden.shape[0]
        device = inputs.hidden.device
        depth = model.depth_decoder.model
        rows = torch.arange(b, device=device)
        code = model.pick(inputs, model.lm_head(inputs.hidden), 0, logits_out)
        codes = [code]
        # Position 0: the backbone state; position 1: codebook 0's embedding.
        x = torch.stack([inputs.hidden, depth.embed_tokens(code)], dim=1)
        positions = torch.arange(2, device=device).expand(b, 2)
        out = depth(depth.inputs_embeds_projector(x), caches.depth, rows, positions)[:, 1]
        for k in range(1, model.num_codebooks):
            code = model.pick(inputs, out @ model.depth_decoder.codebooks_head.weight[k - 1], k, logits_out)
            codes.append(code)
            if k + 1 < model.num_codebooks:
                x = depth.embed_tokens(code + k * model.config.audio_vocab_size)[:, None]
                positions = torch.full((b, 1), k + 1, dtype=torch.int64, device=device)
                out = depth(depth.inputs_embeds_projector(x), caches.depth, rows, positions)[:, 0]
        return torch.stack(codes, dim=1)

    def backbone_step(self, codes: torch.Tensor, inputs: FrameInputs, caches: CsmCaches) -> torch.Tensor:
        """The backbone's next hidden state [B, H] from the frame's codes [B, N]."""
        model = self.model
        embeds = model.embed_frames(codes)[:, None]  # [B, 1, H]
        return model.backbone_model(embeds, caches.backbone, inputs.slots, inputs.positions[:, None])[:, 0]
