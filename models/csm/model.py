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

Steps 2 and 4 run in the model's frame, chosen once: ``frame_plain.PlainFrame`` (the plain layers) until
``pack_weights`` switches to ``frame_fused.FusedFrame`` (the packed weights and the kernels).

Parameter names are the on-disk CSM layout (transformers' CsmForConditionalGeneration),
so checkpoints load by name. ``embed_audio_tokens`` is tied to the depth decoder's
``embed_tokens`` (one tensor, saved once as ``depth_decoder.model.embed_tokens.weight``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from kernels.sampler import sample  # the Triton kernel on CUDA, its eager twin elsewhere
from models.csm.config import CsmConfig
from models.csm.frame_fused import DEFAULT_SETTINGS, FusedFrame, FusedSettings
from models.csm.frame_plain import PlainFrame
from models.csm.modules import KVCache, Transformer
from models.family import FrameInputs, FrameOutputs, PromptSegment


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
    audio_context = True

    def __init__(self, config: CsmConfig) -> None:
        super().__init__()
        self.config = config
        self.num_codebooks = config.num_codebooks
        self.codebook_size = config.codebook_size
        self.text_vocab_size = config.text_vocab_size
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
        self.frame: PlainFrame | FusedFrame = PlainFrame(self)  # the fused one from pack_weights on

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

    def pack_prompt(self, segments: Sequence[PromptSegment]) -> np.ndarray:
        """The prompt as host rows ``[L, N + 1]`` int64, one per KV position, laid out as
        ``prompt_embeds`` lays them out; see ``pack_prompt`` below."""
        return pack_prompt(segments, self.num_codebooks, self.config.codebook_eos_token_id)

    def pack_slot_state(self, segments: Sequence[PromptSegment]) -> None:
        """CSM keeps no per-slot state beyond the KV cache and the runner's pools."""
        return None

    def write_slot_state(self, caches: CsmCaches, slots: torch.Tensor, states: torch.Tensor) -> None:
        """Never called (``pack_slot_state`` gives None)."""

    def embed_packed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Packed prompt rows ``[..., T, N + 1]`` (``pack_prompt``'s layout) -> ``[..., T, H]``, equal
        to ``prompt_embeds``. Branch-free (both tables are read at every position and ``where``
        picks), so a batch of chunks embeds in one call that a CUDA graph can capture."""
        n = self.num_codebooks
        text_ids = tokens[..., n]
        text = self.embed_text_tokens(text_ids.clamp(min=0))
        audio = self.embed_frames(tokens[..., :n].clamp(min=0))
        return torch.where((text_ids >= 0)[..., None], text, audio)

    def new_caches(self, num_slots: int, max_len: int, batch_size: int) -> CsmCaches:
        return CsmCaches(self.backbone_model.new_cache(num_slots, max_len),
                         self.depth_decoder.model.new_cache(batch_size, self.num_codebooks),
                         DepthRows.build(batch_size, self.num_codebooks, self.lm_head.weight.device))

    # --- the fused frame's weights ---------------------------------------------------------

    @property
    def fused(self) -> bool:
        """Whether frames take the fused path (after ``pack_weights``)."""
        return isinstance(self.frame, FusedFrame)

    def pack_weights(self, settings: FusedSettings = DEFAULT_SETTINGS) -> None:
        """Switches frames to the fused path (``frame_fused``, under ``settings``): packs both stacks' QKV
        and gate/up weights into views of one tensor each (no extra memory, but for the depth decoder's
        down weights, which it also keeps transposed after its gate/up rows: 67 MB for csm-1b in bf16; the
        backbone's too with ``settings.backbone_mlp_rows``: 537 MB), pads the codebook head, and projects
        codebooks 1 .. N-2's embedding tables (``_depth_inputs``: the inputs of depth calls 2 .. N-1). Call
        once the model has its final device and dtype; a later call packs nothing more (the backbone keeps
        the mlp rows it was first given) and sets the frame's settings. Prefill then takes the packed
        backbone's fused layers too (``Transformer.forward_chunks``)."""
        self.backbone_model.pack_weights(mlp_rows=settings.backbone_mlp_rows)
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
        self.frame = FusedFrame(self, settings)

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
                caches: CsmCaches, starts: torch.Tensor | None = None) -> torch.Tensor:
        # embeds: [B, T, H] right-padded; lengths, slots, starts: [B] -> last hidden [B, H]
        # Row b's tokens go to positions starts[b] + 0 .. T-1 (0 .. T-1 without starts); its
        # queries see keys 0 .. p of its slot, so a chunk continues the chunks before it.
        b, t, _ = embeds.shape
        max_pos = caches.backbone.max_len - 1
        positions = torch.arange(t, device=embeds.device).expand(b, t)
        if starts is not None:
            positions = positions + starts[:, None]
        backbone, positions = self.backbone_model, positions.clamp(max=max_pos)
        if backbone.packed:  # pack_weights: the fused layers' launches (forward_chunks)
            hidden = backbone.forward_chunks(embeds, caches.backbone, slots, positions)
        else:
            hidden = backbone(embeds, caches.backbone, slots, positions)
        # Padding positions wrote K/V past a row's end (clamped into the cache); each is rewritten
        # by that row's next chunk or its own frame step before any query can see it.
        return hidden[torch.arange(b, device=embeds.device), lengths - 1]

    # --- one frame ------------------------------------------------------------------------

    def pick(self, inputs: FrameInputs, logits: torch.Tensor, k: int,
             logits_out: list | None) -> torch.Tensor:
        """Codebook k's code from its logits (kept in ``logits_out`` when asked); the frames call it."""
        if logits_out is not None:
            logits_out.append(logits.float())
        return sample(logits, inputs.sampling, inputs.frame_index, k, inputs.history[:, k, :],
                      self.codebook_size)

    def is_stop_frame(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, N] -> [B] bool
        return (codes[:, : self.num_codebooks - 1] == self.config.codebook_eos_token_id).all(dim=1)

    def decode_frame(self, inputs: FrameInputs, caches: CsmCaches,
                     return_logits: bool = False) -> FrameOutputs:
        logits: list[torch.Tensor] | None = [] if return_logits else None
        codes = self.frame.depth_codes(inputs, caches, logits)  # [B, N]
        stop = self.is_stop_frame(codes) & (inputs.frame_index >= inputs.min_frames)
        hidden = self.frame.backbone_step(codes, inputs, caches)
        history = inputs.history
        if history.shape[-1] > 0:
            history = torch.cat([history[:, :, 1:], codes[:, :, None]], dim=-1)
        return FrameOutputs(codes=codes, stop=stop, hidden=hidden, history=history,
                            logits=torch.stack(logits, dim=1) if logits is not None else None)


def pack_prompt(segments: Sequence[PromptSegment], num_codebooks: int, eos_id: int) -> np.ndarray:
    """The prompt as ``[L, N + 1]`` int64 host rows, one per KV position (N = num_codebooks). A
    text position holds its token id in column N and -1 in columns 0 .. N-1; an audio position
    (an audio-context turn's frames, then its all-EOS end frame) holds its codes in columns
    0 .. N-1 and -1 in column N. -1 marks "not this kind" both ways, so a row says what it is.
    Built on the host when the request arrives, so the engine copies one array per batch."""
    width, parts = num_codebooks + 1, []
    for i, segment in enumerate(segments):
        ids = np.asarray(segment.text_token_ids, dtype=np.int64).reshape(-1)
        text = np.full((len(ids), width), -1, dtype=np.int64)
        text[:, num_codebooks] = ids
        parts.append(text)
        if segment.frames is not None:
            frames = np.asarray(segment.frames, dtype=np.int64)
            if frames.ndim != 2 or frames.shape[1] != num_codebooks:
                raise ValueError(f"segments[{i}].frames: shape {tuple(frames.shape)}, "
                                 f"[num_frames, {num_codebooks}] expected")
            audio = np.full((len(frames) + 1, width), -1, dtype=np.int64)
            audio[:-1, :num_codebooks] = frames
            audio[-1, :num_codebooks] = eos_id
            parts.append(audio)
    return np.concatenate(parts) if parts else np.empty((0, width), dtype=np.int64)
