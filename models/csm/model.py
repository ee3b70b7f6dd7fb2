"""Sesame CSM as a voxring talker family: backbone + codebook-0 head + depth decoder.

One frame, from the backbone's last hidden state h (after its final norm):
  1. codebook 0 from ``lm_head(h)``;
  2. depth decoder with a fresh context: position 0 is h, position 1 the embedding of
     c0; at position k the last hidden state times ``codebooks_head.weight[k-1]`` gives
     codebook k's logits, and the next input is the embedding of ``c_k + k * V``
     (V = audio vocab per codebook, 2051 for csm-1b); the projector applies to every input;
  3. stop flag: **the stop frame is a frame whose codebooks 0..N-2 are all the codebook
     EOS id (0)** (transformers' rule; the last codebook is ignored). It ends the request
     and is not audio: it is never emitted. Before ``min_frames`` it does not stop;
  4. the frame's embedding, the sum of its codebooks' ``embed_audio_tokens`` rows at
     offsets ``k * V``, is the backbone's next input; the backbone step gives the next h.

Parameter names are the on-disk CSM layout (transformers' CsmForConditionalGeneration),
so checkpoints load by name. ``embed_audio_tokens`` is tied to the depth decoder's
``embed_tokens`` (one tensor, saved once as ``depth_decoder.model.embed_tokens.weight``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels.sampler import sample  # the Triton kernel on CUDA, its eager twin elsewhere
from kernels.stack_step import BACKBONE, DEPTH, stack_layers, stack_step
from kernels.stack_step import fits as stack_fits
from models.csm.config import CsmConfig
from models.csm.modules import KVCache, Transformer
from models.family import FrameInputs, FrameOutputs, PromptSegment

# Depth calls of at most this many rows (the kernel's MAX_ROWS) take ``stack_step``, one launch a
# call. On the H200, since its down and head tiles let every SM stream (c9401fa), a call of 8 or 16
# rows is faster that way too: 157 / 158 us against 189 / 197 us for the library's products (c78e3a8;
# 165 against 191 us at 8 rows in a800258's run), and a B=8 frame 7.07 -> 6.56 ms (bench/README.md,
# "Where a depth call's time goes").
STACK_STEP_ROWS = 16
# Depth calls 2 .. N-1 read their input rows from the codebooks' embedding tables projected once by
# ``pack_weights`` (``_projected_tables``), instead of projecting each call's embedding rows: a call of
# ``stack_step`` then has no projection phase (bench/README.md). False (read as graphs are captured):
# every depth call projects its embedding rows, as before; for benchmarks.
PROJECTED_INPUTS = True
# Backbone steps of at most this many rows take ``stack_layers``: per layer one ``stack_step`` launch (the
# output product, the MLP, the next layer's norm + QKV + rotary + K/V write) and decode attention's
# kernels, instead of ``forward_rows``' nine launches a layer. On the H200 (bench/README.md) a one-row step
# takes 849.2 us against 947.5 since its QKV, output and down products multiply each block of the row in 4
# parts (``stack_step``'s KQ_QKV, KQ_O, KQ_DOWN: shorter chains of dependent matrix-unit steps; 932.7 us
# without); calls of more rows keep whole blocks, where 8 rows took 1,188 us against 987 (d7de182): one row
# only. Its launches use grid barriers, as the depth decoder's already do (bench/README.md, MPS). Read as
# graphs are captured; 0 sends every step to ``forward_rows``.
BACKBONE_STACK_ROWS = 1
# ``stack_layers``' tiles for the backbone (``stack_step.BACKBONE``: the depth decoder's with QKV items of
# 16 rotary pairs, 96 items of 128 KB for 132 programs, one a program, so its rotary tables load before the
# product, where 8 made 192 items of 64 KB whose tables loaded in each epilogue: a launch's QKV phase 14.5
# -> 10.75 us, a one-row step 977.3 -> 936.6 us (d7de182); in blocks of 256 (at 512: 600 bytes of spills,
# 1246.0 us; at 128: 999.4)
BACKBONE_TUNING = BACKBONE
# ``stack_step``'s tuning for the depth decoder's calls.
DEPTH_TUNING = DEPTH
# Whether ``pack_weights`` gives the backbone the mlp rows (down's transpose beside gate/up, 537 MB more at
# csm-1b in bf16), so its one-row ``stack_layers`` steps take ``stack_step``'s MLP_DOWN: 914.6 against 936.6
# us a step (d7de182), 0.5% of a frame for the memory. Read by ``pack_weights``.
BACKBONE_MLP_ROWS = False


class AudioEmbeddings(nn.Module):
    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self.embed_audio_tokens = embedding


class Backbone(Transformer):
    def __init__(self, config: CsmConfig, audio_embedding: nn.Embedding) -> None:
        super().__init__(config.backbone)
        self.embed_tokens = AudioEmbeddings(audio_embedding)


class DepthModel(Transformer):
    def __init__(self, config: CsmConfig) -> None:
        super().__init__(config.depth)
        self.embed_tokens = nn.Embedding(config.num_codebooks * config.audio_vocab_size,
                                         config.backbone.hidden_size)
        self.inputs_embeds_projector = nn.Linear(config.backbone.hidden_size, config.depth.hidden_size,
                                                 bias=False)


class CodebooksHead(nn.Module):
    def __init__(self, config: CsmConfig) -> None:
        super().__init__()
        # weight: [N-1, H_depth, V]; codebook k (1..N-1) uses weight[k-1]
        self.weight = nn.Parameter(torch.empty(config.num_codebooks - 1, config.depth.hidden_size,
                                               config.audio_vocab_size))


class DepthDecoder(nn.Module):
    def __init__(self, config: CsmConfig) -> None:
        super().__init__()
        self.model = DepthModel(config)
        self.codebooks_head = CodebooksHead(config)


@dataclass
class DepthRows:
    """Constant index tensors of the fused depth loop, made once with the caches so a frame
    launches nothing to build them. Sliced to a batch of b rows:

    * ``first_*[: 2b]``: the first depth call's rows (b, 0), (b, 1) flattened: depth slot b,
      positions 0 and 1, lengths 1 and 2;
    * ``rows[:b]``: depth slot of each row (0 .. b-1); ``steps[p, :b]``: p for every row. Depth
      step k >= 1 writes position k + 1 (``steps[k + 1]``) and sees k + 2 keys (``steps[k + 2]``)."""

    first_rows: torch.Tensor     # [2 * batch_size] int64
    first_positions: torch.Tensor
    first_lengths: torch.Tensor
    rows: torch.Tensor           # [batch_size] int64
    steps: torch.Tensor          # [num_codebooks + 1, batch_size] int64

    @classmethod
    def build(cls, batch_size: int, num_codebooks: int, device) -> DepthRows:
        rows = torch.arange(batch_size, dtype=torch.int64, device=device)
        first_positions = torch.arange(2, dtype=torch.int64, device=device).repeat(batch_size)
        steps = torch.arange(num_codebooks + 1, dtype=torch.int64, device=device)[:, None]
        return cls(rows.repeat_interleave(2), first_positions, first_positions + 1, rows,
                   steps.expand(num_codebooks + 1, batch_size).contiguous())


@dataclass
class CsmCaches:
    backbone: KVCache   # [Lb, num_slots, max_len, Hkv, D]
    depth: KVCache      # [Ld, batch_size, num_codebooks, Hkv, D]: frame scratch, no zeroing needed
    depth_rows: DepthRows


class CsmTalker(nn.Module):
    rows_per_request = 1

    def __init__(self, config: CsmConfig) -> None:
        super().__init__()
        self.config = config
        self.num_codebooks = config.num_codebooks
        self.codebook_size = config.codebook_size
        self.hidden_size = config.backbone.hidden_size
        self.max_len = config.max_len
        self.frame_rate = config.frame_rate
        self.sample_rate = config.sample_rate
        self.lm_head = nn.Linear(config.backbone.hidden_size, config.audio_vocab_size, bias=False)
        self.embed_text_tokens = nn.Embedding(config.text_vocab_size, config.backbone.hidden_size)
        self.depth_decoder = DepthDecoder(config)
        self.backbone_model = Backbone(config, self.depth_decoder.model.embed_tokens)
        offsets = torch.arange(config.num_codebooks, dtype=torch.int64) * config.audio_vocab_size
        self.register_buffer("audio_offsets", offsets, persistent=False)
        self._head_rows: torch.Tensor | None = None  # the padded codebook head, set by pack_weights
        self._depth_inputs: torch.Tensor | None = None  # the projected embedding tables, set by pack_weights

    # --- prompt and prefill -------------------------------------------------------------

    def embed_frames(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [..., N] -> [..., H]: the sum of the frame's codebook embeddings
        table = self.backbone_model.embed_tokens.embed_audio_tokens
        return table(codes + self.audio_offsets).sum(dim=-2)

    def prompt_embeds(self, segments: Sequence[PromptSegment]) -> torch.Tensor:
        """Text turns as text embeddings; an audio-context turn adds its frames and then an
        all-EOS frame (audio end), as transformers' CSM processor lays them out."""
        device = self.lm_head.weight.device
        parts = []
        for segment in segments:
            ids = torch.as_tensor(list(segment.text_token_ids), dtype=torch.int64, device=device)
            parts.append(self.embed_text_tokens(ids))
            if segment.frames is not None:
                frames = segment.frames.to(device=device, dtype=torch.int64)
                eos = torch.full((1, self.num_codebooks), self.config.codebook_eos_token_id,
                                 dtype=torch.int64, device=device)
                parts.append(self.embed_frames(torch.cat([frames, eos])))
        return torch.cat(parts)

    def new_caches(self, num_slots: int, max_len: int, batch_size: int) -> CsmCaches:
        return CsmCaches(self.backbone_model.new_cache(num_slots, max_len),
                         self.depth_decoder.model.new_cache(batch_size, self.num_codebooks),
                         DepthRows.build(batch_size, self.num_codebooks, self.lm_head.weight.device))

    # --- the fused frame ------------------------------------------------------------------

    @property
    def fused(self) -> bool:
        """Whether frames take the fused path (after ``pack_weights``)."""
        return self.backbone_model.packed

    def pack_weights(self) -> None:
        """Switches frames to the fused path: packs both stacks' QKV and gate/up weights into
        views of one tensor each (no extra memory, but for the depth decoder's down weights, which it
        also keeps transposed after its gate/up rows: 67 MB for csm-1b in bf16; the backbone's too with
        ``BACKBONE_MLP_ROWS``: 537 MB), pads the codebook
        head, and projects codebooks
        1 .. N-2's embedding tables (``_depth_inputs``: the inputs of depth calls 2 .. N-1). Call once
        the model has its final device and dtype. Prefill keeps the plain path either way."""
        self.backbone_model.pack_weights(mlp_rows=BACKBONE_MLP_ROWS)
        self.depth_decoder.model.pack_weights(mlp_rows=True)  # stack_step's MLP_DOWN reads down's transpose
        # The head [N-1, H, V] as a view of [N-1, V_pad, H] with V padded to a multiple of 8 by
        # zero rows: each codebook's product then writes aligned [B, V_pad] logits (V = 2051 is
        # odd, which sends the library to a slow unaligned kernel), read back as [:, :V].
        head = self.depth_decoder.codebooks_head
        if self._head_rows is None:
            n, hidden, vocab = head.weight.shape
            rows = -(-vocab // 8) * 8
            packed = head.weight.new_zeros(n, rows, hidden)
            packed[:, :vocab].copy_(head.weight.detach().transpose(1, 2))
            head.weight = nn.Parameter(packed[:, :vocab].transpose(1, 2), requires_grad=False)
            self._head_rows = packed
        if self._depth_inputs is None:
            self._depth_inputs = self._projected_tables()

    @torch.no_grad()
    def _projected_tables(self) -> torch.Tensor:
        """[N-2, V, H_depth]: codebook k's embedding table (k = 1 .. N-2, the codes that depth calls
        take as input) times the depth decoder's input projector, in float64 (no TF32, whatever the
        process's matmul precision) and rounded once to the model's dtype. A depth call then reads
        its input row instead of streaming the projector's weights (4.2 MB at csm-1b) for one row:
        the projection is linear, so projecting the table once gives each code's row, as the
        per-call product would up to its fp32 sums' order and rounding. 126 MB at csm-1b in bf16."""
        depth = self.depth_decoder.model
        table, proj = depth.embed_tokens.weight, depth.inputs_embeds_projector.weight
        vocab, n = self.config.audio_vocab_size, self.num_codebooks
        out = table.new_empty(max(n - 2, 0), vocab, proj.shape[0])
        wide = proj.double()
        for k in range(1, n - 1):  # one codebook at a time: the float64 temporaries stay small
            out[k - 1].copy_(F.linear(table[k * vocab:(k + 1) * vocab].double(), wide))
        return out

    def prefill(self, embeds: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor,
                caches: CsmCaches) -> torch.Tensor:
        # embeds: [B, T, H] right-padded; lengths, slots: [B] -> last hidden [B, H]
        b, t, _ = embeds.shape
        max_pos = caches.backbone.max_len - 1
        positions = torch.arange(t, device=embeds.device).clamp(max=max_pos).expand(b, t)
        hidden = self.backbone_model(embeds, caches.backbone, slots, positions)
        # Padding positions wrote K/V past a row's end; each is rewritten by that row's
        # own frame step before any query can see it.
        return hidden[torch.arange(b, device=embeds.device), lengths - 1]

    # --- one frame ------------------------------------------------------------------------

    def _pick(self, inputs: FrameInputs, logits: torch.Tensor, k: int,
              logits_out: list | None) -> torch.Tensor:
        """Codebook k's code from its logits (kept in ``logits_out`` when asked)."""
        if logits_out is not None:
            logits_out.append(logits.float())
        return sample(logits, inputs.sampling, inputs.frame_index, k, inputs.history[:, k, :],
                      self.codebook_size)

    def _depth_codes_fused(self, inputs: FrameInputs, caches: CsmCaches, logits_out: list | None):
        """``_depth_codes`` on the fused path: the same steps, rows flattened, codebook k's embedding
        read from its slice of the table (no offset add), or with ``PROJECTED_INPUTS`` its projected
        row from ``_depth_inputs``. Where ``stack_step`` takes the rows (a CUDA device, up to
        ``STACK_STEP_ROWS`` rows a call), each depth call is one launch: the projection (the first
        call, or without projected tables: with the embedding lookup), the four layers, the final
        norm and the next codebook's head; elsewhere ``forward_rows`` and separate products."""
        b = inputs.hidden.shape[0]
        depth = self.depth_decoder.model
        table, vocab = depth.embed_tokens.weight, self.config.audio_vocab_size
        proj = depth.inputs_embeds_projector.weight
        # [N-2, V, H_depth]: codebooks 1 .. N-2's tables, projected (None: each call projects its rows)
        projected = self._depth_inputs if PROJECTED_INPUTS else None
        index = caches.depth_rows
        head_rows = self._head_rows  # [N-1, V_pad, H]
        cache = caches.depth

        def pick(logits: torch.Tensor, k: int) -> torch.Tensor:
            return self._pick(inputs, logits, k, logits_out)

        def step_logits(rows: tuple[torch.Tensor, ...], head: torch.Tensor, src: torch.Tensor,
                        codes: torch.Tensor | None = None, proj: torch.Tensor | None = None,
                        pairs: bool = False) -> torch.Tensor:
            # logits [b, V_pad] of one depth call over ``rows`` = (slots, positions, lengths); with
            # ``pairs`` the rows come two per batch row and only the second's logits are wanted. The
            # input: ``src`` (or its rows ``codes``), times ``proj`` where given
            inputs_ = dict(src=src, codes=codes, proj=proj, head=head)
            small = rows[0].shape[0] <= STACK_STEP_ROWS
            if small and stack_fits(depth.stack, cache.k, cache.v, *rows, **inputs_):
                logits = stack_step(depth.stack, cache.k, cache.v, *rows, **inputs_, tuning=DEPTH_TUNING)
                return logits.view(b, 2, -1)[:, 1] if pairs else logits
            x = src if codes is None else F.embedding(codes, src)
            out = depth.forward_rows(x if proj is None else F.linear(x, proj), cache, *rows)
            return F.linear(out.view(b, 2, -1)[:, 1] if pairs else out, head)

        code = pick(self.lm_head(inputs.hidden), 0)
        codes = [code]
        # rows (b, position 0: the backbone state) and (b, position 1: codebook 0's embedding)
        x = torch.stack([inputs.hidden, F.embedding(code, table[:vocab])], dim=1).view(2 * b, -1)
        first = (index.first_rows[: 2 * b], index.first_positions[: 2 * b], index.first_lengths[: 2 * b])
        logits = step_logits(first, head_rows[0], x, proj=proj, pairs=True)
        for k in range(1, self.num_codebooks):
            code = pick(logits[:, :vocab], k)
            codes.append(code)
            if k + 1 < self.num_codebooks:
                rows = (index.rows[:b], index.steps[k + 1, :b], index.steps[k + 2, :b])
                if projected is not None:
                    logits = step_logits(rows, head_rows[k], projected[k - 1], code)
                else:
                    logits = step_logits(rows, head_rows[k], table[k * vocab:(k + 1) * vocab], code, proj)
        return torch.stack(codes, dim=1)

    def _depth_codes(self, inputs: FrameInputs, caches: CsmCaches, logits_out: list | None):
        if self.fused:
            return self._depth_codes_fused(inputs, caches, logits_out)
        b = inputs.hidden.shape[0]
        device = inputs.hidden.device
        depth = self.depth_decoder.model
        rows = torch.arange(b, device=device)

        def pick(logits: torch.Tensor, k: int) -> torch.Tensor:
            return self._pick(inputs, logits, k, logits_out)

        code = pick(self.lm_head(inputs.hidden), 0)
        codes = [code]
        # Position 0: the backbone state; position 1: codebook 0's embedding.
        x = torch.stack([inputs.hidden, depth.embed_tokens(code)], dim=1)
        positions = torch.arange(2, device=device).expand(b, 2)
        out = depth(depth.inputs_embeds_projector(x), caches.depth, rows, positions)[:, 1]
        for k in range(1, self.num_codebooks):
            code = pick(out @ self.depth_decoder.codebooks_head.weight[k - 1], k)
            codes.append(code)
            if k + 1 < self.num_codebooks:
                x = depth.embed_tokens(code + k * self.config.audio_vocab_size)[:, None]
                positions = torch.full((b, 1), k + 1, dtype=torch.int64, device=device)
                out = depth(depth.inputs_embeds_projector(x), caches.depth, rows, positions)[:, 0]
        return torch.stack(codes, dim=1)

    def is_stop_frame(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, N] -> [B] bool
        return (codes[:, : self.num_codebooks - 1] == self.config.codebook_eos_token_id).all(dim=1)

    def decode_frame(self, inputs: FrameInputs, caches: CsmCaches,
                     return_logits: bool = False) -> FrameOutputs:
        logits: list[torch.Tensor] | None = [] if return_logits else None
        codes = self._depth_codes(inputs, caches, logits)  # [B, N]
        stop = self.is_stop_frame(codes) & (inputs.frame_index >= inputs.min_frames)
        if self.fused:
            backbone, cache = self.backbone_model, caches.backbone
            x = self.embed_frames(codes)
            rows = (inputs.slots, inputs.positions, inputs.positions + 1)
            if x.shape[0] <= BACKBONE_STACK_ROWS and stack_fits(
                backbone.stack, cache.k, cache.v, *rows, outside_attention=True, x=x
            ):
                hidden = stack_layers(backbone.stack, cache.k, cache.v, *rows, x=x, tuning=BACKBONE_TUNING)
            else:
                hidden = backbone.forward_rows(x, cache, *rows)
        else:
            embeds = self.embed_frames(codes)[:, None]           # [B, 1, H]
            hidden = self.backbone_model(embeds, caches.backbone, inputs.slots,
                                         inputs.positions[:, None])[:, 0]
        history = inputs.history
        if history.shape[-1] > 0:
            history = torch.cat([history[:, :, 1:], codes[:, :, None]], dim=-1)
        return FrameOutputs(codes=codes, stop=stop, hidden=hidden, history=history,
                            logits=torch.stack(logits, dim=1) if logits is not None else None)
