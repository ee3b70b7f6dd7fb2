"""The talker scheduler's prefill rules (a mixin of :class:`services.talker.scheduler.Scheduler`):
which chunks of the admitted prompts a step prefills. The step's budget is ``prefill_token_budget``
and what the slack of the rows already speaking affords (pacing.prefill_tokens_allowed), at least
``min_chunk_tokens`` so prompts always advance; the grant admission reads is that budget, weighted
over the steps. Pure Python.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from services.talker.pacing import due, prefill_tokens_allowed
from services.talker.request import TalkerRequest


@dataclass
class PrefillChunk:
    """Positions [start, start + count) of a request's prompt; ``final``: its prompt's last."""

    request: TalkerRequest
    start: int
    count: int

    @property
    def final(self) -> bool:
        return self.start + self.count == self.request.prompt_len


class PrefillRules:
    """The prefill half of the scheduler (it supplies running, pacing, times, bucket_for,
    max_num_seqs, prefill_token_budget, min_chunk_tokens, prefill_grant, grant_counts and
    _outlook)."""

    def _prefill_chunks(self, now: float, decode: list[TalkerRequest],
                        dues: list[float] | None = None) -> list[PrefillChunk]:
        """Chunks of the admitted prompts, in admission order, within the step's token budget:
        ``prefill_token_budget`` and what the slack of the rows already speaking affords (at
        least ``min_chunk_tokens``, so prompts always advance). Rows still silent do not bound
        it: they wait for prefill as much as anyone (a burst's prompts go in as fast as the
        budget allows). With no prompt waiting, a grant below the budget is still renewed (what
        this step would have allowed), so admission does not judge new prompts by a late row
        that is gone. ``dues``: the decoding rows' due times, where the caller has them."""
        pending = [r for r in self.running if r.prefilling]
        if not pending:
            if self.prefill_grant is not None and self.prefill_grant < self.prefill_token_budget:
                self._grant(self._prefill_allowance(now, decode, 0, dues), counted=False)
            return []
        budget = self._prefill_allowance(now, decode, len(pending), dues)
        self._grant(budget, counted=True)
        chunks = []
        for request in pending:
            count = min(request.prompt_len - request.prefilled, budget)
            if count <= 0:
                break
            chunks.append(PrefillChunk(request, request.prefilled, count))
            request.prefilled += count
            budget -= count
        return chunks

    def _prefill_allowance(self, now: float, decode: list[TalkerRequest], pending: int,
                           dues: list[float] | None = None) -> int:
        """Prompt positions this step may prefill (see _prefill_chunks)."""
        if dues is None:
            dues = [due(r, self.pacing) for r in decode]
        # a speaking row late already still bounds it: prefill would only lengthen its stall
        speaking_due = min((d for d, r in zip(dues, decode, strict=True) if r.first_written_at is not None),
                           default=math.inf) - self.pacing.margin_s
        # the step's frames are timed at the bucket it may grow to: the prompts that finish join it
        joined = min(len(decode) + max(1, pending), self.max_num_seqs)
        outlook = dataclasses.replace(self._outlook(now, 0.0, decode, dues), row_due=speaking_due,
                                      bucket=self.bucket_for(max(1, joined)))
        affordable = prefill_tokens_allowed(outlook, self.pacing, self.times)
        return int(min(self.prefill_token_budget, max(affordable, self.min_chunk_tokens)))

    def _grant(self, budget: int, *, counted: bool) -> None:
        old = self.prefill_grant
        grant = budget if old is None else old + 0.25 * (budget - old)
        self.prefill_grant = budget if abs(budget - grant) < 1 else grant  # settles: no renewals forever
        if counted:
            self.grant_counts["steps"] += 1
            self.grant_counts["positions"] += budget
