"""Mimi's split residual vector quantizer: codes <-> latents.

Codebook vectors are derived: ``embed_sum / cluster_usage.clamp(min=1e-5)``. The first
``num_semantic_quantizers`` codebooks belong to the semantic RVQ, the rest to the
acoustic RVQ; each RVQ has 1x1 input/output projections when its dimension differs from
the model's. Names follow the on-disk layout (``quantizer.semantic_residual_vector_
quantizer.layers.{i}.codebook.embed_sum``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.mimi.config import MimiConfig

EPSILON = 1e-5


class Codebook(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.ones(1))
        self.register_buffer("cluster_usage", torch.ones(config.codebook_size))
        self.register_buffer("embed_sum", torch.zeros(config.codebook_size, config.codebook_dim))
        self.register_buffer("embed", torch.zeros(0), persistent=False)

    def refresh(self) -> None:
        """Derives the codebook vectors (after loading)."""
        self.embed = self.embed_sum / self.cluster_usage.clamp(min=EPSILON)[:, None]


class VectorQuantization(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.codebook = Codebook(config)


class ResidualVectorQuantizer(nn.Module):
    def __init__(self, config: MimiConfig, num_quantizers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(VectorQuantization(config) for _ in range(num_quantizers))
        self.input_proj = self.output_proj = None
        if config.vq_hidden_size != config.hidden_size:
            self.input_proj = nn.Conv1d(config.hidden_size, config.vq_hidden_size, 1, bias=False)
            self.output_proj = nn.Conv1d(config.vq_hidden_size, config.hidden_size, 1, bias=False)
        # every codebook's vectors in one table and where each starts in it (refresh_table): a
        # decode looks all its codes up at once, not one launch per codebook (and one add each)
        self.register_buffer("table", torch.zeros(0), persistent=False)
        self.register_buffer("offsets", torch.zeros(0, dtype=torch.int64), persistent=False)

    def refresh_table(self) -> None:
        """After the codebooks' vectors are derived (Codebook.refresh)."""
        embeds = [layer.codebook.embed for layer in self.layers]
        self.table = torch.cat(embeds) if embeds else torch.zeros(0)
        sizes = torch.tensor([0] + [e.shape[0] for e in embeds[:-1]], dtype=torch.int64)
        self.offsets = sizes.cumsum(0).to(self.table.device)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, K, T] -> [B, hidden, T]: the K codebooks' vectors summed (in fp32 at least:
        # one rounding, not one an add)
        k = codes.shape[1]
        vectors = F.embedding(codes + self.offsets[:k, None], self.table)        # [B, K, T, D]
        out = vectors.sum(dim=1, dtype=torch.promote_types(vectors.dtype, torch.float32))
        out = out.to(vectors.dtype).transpose(1, 2)                                # [B, D, T]
        return self.output_proj(out) if self.output_proj is not None else out

    def encode(self, latents: torch.Tensor, num_quantizers: int) -> torch.Tensor:
        # latents: [B, hidden, T] -> codes [B, K, T] (nearest vector per residual stage)
        x = self.input_proj(latents) if self.input_proj is not None else latents
        residual = x.transpose(1, 2)                                         # [B, T, D]
        codes = []
        for layer in self.layers[:num_quantizers]:
            embed = layer.codebook.embed
            flat = residual.reshape(-1, residual.shape[-1])
            index = torch.cdist(flat[None].float(), embed[None].float(), p=2)[0].argmin(dim=-1)
            index = index.view(residual.shape[:-1])
            residual = residual - F.embedding(index, embed)
            codes.append(index)
        return torch.stack(codes, dim=1)


class SplitResidualVectorQuantizer(nn.Module):
    def __init__(self, config: MimiConfig) -> None:
        super().__init__()
        self.num_semantic = config.num_semantic_quantizers
        self.semantic_residual_vector_quantizer = ResidualVectorQuantizer(
            config, config.num_semantic_quantizers)
        self.acoustic_residual_vector_quantizer = ResidualVectorQuantizer(
            config, config.num_quantizers - config.num_semantic_quantizers)

    def refresh(self) -> None:
        for module in self.modules():
            if isinstance(module, Codebook):
                module.refresh()
        self.semantic_residual_vector_quantizer.refresh_table()
        self.acoustic_residual_vector_quantizer.refresh_table()

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        # codes: [B, K, T] with K >= num_semantic_quantizers -> [B, hidden, T]
        out = self.semantic_residual_vector_quantizer.decode(codes[:, : self.num_semantic])
        if codes.shape[1] > self.num_semantic:
            out = out + self.acoustic_residual_vector_quantizer.decode(codes[:, self.num_semantic:])
        return out

    def encode(self, latents: torch.Tensor, num_quantizers: int) -> torch.Tensor:
        codes = self.semantic_residual_vector_quantizer.encode(latents, self.num_semantic)
        if num_quantizers > self.num_semantic:
            acoustic = self.acoustic_residual_vector_quantizer.encode(
                latents, num_quantizers - self.num_semantic)
            codes = torch.cat([codes, acoustic], dim=1)
        return codes
