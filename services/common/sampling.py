"""A request's sampling settings, shared by every stage (no torch, no grpc): the knobs of
the sampler (docs/architecture.md, Sampling) and the seed of its draws.

Each is a frozen dataclass that checks itself on construction and raises
:class:`~services.common.config.ConfigValueError` naming the offending field, so the same
class is a YAML config section (the loader reports the file and key) and a request's
value (the servicers report ``sampling.<field>``).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.common.config import ConfigValueError

__all__ = ["Sampling", "SamplingDefaults"]


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampler's knobs (docs/architecture.md, Sampling) without the seed; greedy by default."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    repetition_window: int = 0

    def __post_init__(self) -> None:
        checks = [("temperature", self.temperature >= 0, ">= 0"), ("top_k", self.top_k >= 0, ">= 0"),
                  ("top_p", 0 < self.top_p <= 1, "in (0, 1]"),
                  ("repetition_penalty", self.repetition_penalty > 0, "> 0"),
                  ("repetition_window", self.repetition_window >= 0, ">= 0")]
        for name, ok, bound in checks:  # comparisons with NaN are False: NaN is refused too
            if not ok:
                raise ConfigValueError(name, f"must be {bound}, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Sampling(SamplingDefaults):
    """One request's sampling settings: the knobs and the seed of its Gumbel draws."""

    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0 <= self.seed < 2**64:
            raise ConfigValueError("seed", f"must be in [0, 2**64), got {self.seed!r}")
