"""The fused frame: a frame's depth codes and backbone step on the packed weights (``pack_weights``), each
depth call one ``stack_step`` launch where the kernel takes it, the backbone step ``stack_layers`` for the
fewest rows; elsewhere ``Transformer.forward_rows`` and separate products. ``FusedSettings`` says which
calls go where (what each default measured: the bench notes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels.stack_step import BACKBONE, DEPTH, Tuning, stack_layers, stack_step
from kernels.stack_step import fits as stack_fits
from models.family import FrameInputs

if TYPE_CHECKING:
    from models.csm.model import CsmCaches, CsmTalker


@dataclass(frozen=True)
class FusedSettings:
    """Where the fused frame sends its calls; read as the runner captures its graphs."""

    stack_step_rows: int = 16  # depth calls of at most this many rows take stack_step (the kernel's MAX_ROWS)
    projected_inputs: bool = True  # depth calls 2 .. N-1 read rows of the projected tables (else project)
    backbone_stack_rows: int = 1  # backbone steps of at most this many rows take stack_layers (0: none)
    depth_tuning: Tuning = DEPTH  # stack_step's tuning for the depth calls
    backbone_tuning: Tuning = BACKBONE  # stack_layers' tuning for the backbone steps
    backbone_mlp_rows: bool = False  # pack_weights gives the backbone the mlp rows (its one-row MLP_DOWN)


DEFAULT_SETTINGS = FusedSettings()  # the talker's


class FusedFrame:
    """The fused frame of a packed ``model`` under ``settings`` (``CsmTalker.decode_frame`` calls it)."""

    def __init__(self, model: CsmTalker, settings: FusedSettings) -> None:
        self.model = model
        self.settings = settings

    def depth_codes(self, inputs: FrameInputs, caches: CsmCaches, logits_out: list | None) -> torch.Tensor:
        """The plain frame's steps, rows flattened, codebook k's embedding read from its slice of the table
        (no offset add), or with ``projected_inputs`` its projected row (``CsmTalker._depth_inputs``). A depth
        call that ``stack_step`` takes (a CUDA device, up to ``stack_step_rows`` rows) is one launch: the
        projection (the first call, or without projected tables: with the embedding lookup), the layers, the
        final norm and the next codebook's head."""
        model = self.model
        b = inputs.hidden.shape[0]
        depth = model.depth_decoder.model
        table, vocab = depth.embed_tokens.weight, model.config.audio_vocab_size
        proj = depth.inputs_embeds_projector.weight
        # [N-2, V, H_depth]: codebooks 1 .. N-2's tables, projected (None: each call projects its rows)
        projected = model._depth_inputs if self.settings.projected_inputs else None
        index = caches.depth_rows
        head_rows = model._head_rows  # [N-1, V_pad, H]
        code = model.pick(inputs, model.lm_head(inputs.hidden), 0, logits_out)
        codes = [code]
        # rows (b, position 0: the backbone state) and (b, position 1: codebook 0's embedding)
        x = torch.stack([inputs.hidden, F.embedding(code, table[:vocab])], dim=1).view(2 * b, -1)
        first = (index.first_rows[: 2 * b], index.first_positions[: 2 * b], index.first_lengths[: 2 * b])
        logits = self._depth_logits(caches, first, head_rows[0], x, proj=proj, pairs=True)
        for k in range(1, model.num_codebooks):
            code = model.pick(inputs, logits[:, :vocab], k, logits_out)
            codes.append(code)
            if k + 1 < model.num_codebooks:
                rows = (index.rows[:b], index.steps[k + 1, :b], index.steps[k + 2, :b])
                if projected is not None:
                    logits = self._depth_logits(caches, rows, head_rows[k], projected[k - 1], code)
                else:
                    logits = self._depth_logits(caches, rows, head_rows[k], table[k * vocab:(k + 1) * vocab],
                                                code, proj)
        return torch.stack(codes, dim=1)

    def _depth_logits(self, caches: CsmCaches, rows: tuple[torch.Tensor, ...], head: torch.Tensor,
                      src: torch.Tensor, codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
                      pairs: bool = False) -> torch.Tensor:
        """Logits [b, V_pad] of one depth call over ``rows`` = (slots, positions, lengths); with ``pairs``
        the rows come two per batch row and only the second's logits are wanted. The input: ``src`` (or its
        rows ``codes``), times ``proj`` where given."""
        depth, cache = self.model.depth_decoder.model, caches.depth
        b = rows[0].shape[0] // (2 if pairs else 1)
        inputs = dict(src=src, codes=codes, proj=proj, head=head)
        small = rows[0].shape[0] <= self.settings.stack_step_rows
        if small and stack_fits(depth.stack, cache.k, cache.v, *rows, **inputs):
            tuning = self.settings.depth_tuning
            logits = stack_step(depth.stack, cache.k, cache.v, *rows, **inputs, tuning=tuning)
            return logits.view(b, 2, -1)[:, 1] if pairs else logits
        x = src if codes is None else F.embedding(codes, src)
        out = depth.forward_rows(x if proj is None else F.linear(x, proj), cache, *rows, own_slots=not pairs)
        return F.linear(out.view(b, 2, -1)[:, 1] if pairs else out, head)

    def backbone_step(self, codes: torch.Tensor, inputs: FrameInputs, caches: CsmCaches) -> torch.Tensor:
        """The backbone's next hidden state [B, H] from the frame's codes [B, N]: ``stack_layers`` for steps
        of up to ``backbone_stack_rows`` rows where the kernel takes them, else ``forward_rows``."""
        backbone, cache = self.model.backbone_model, caches.backbone
        x = self.model.embed_frames(codes)
        rows = (inputs.slots, inputs.positions, inputs.positions + 1)
        if x.shape[0] <= self.settings.backbone_stack_rows and stack_fits(
            backbone.stack, cache.k, cache.v, *rows, outside_attention=True, x=x
        ):
            tuning = self.settings.backbone_tuning
            return stack_layers(backbone.stack, cache.k, cache.v, *rows, x=x, tuning=tuning)
        return backbone.forward_rows(x, cache, *rows, own_slots=True)
