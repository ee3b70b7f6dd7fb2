"""The talker scheduler's admission rules (a mixin of :class:`services.talker.scheduler.Scheduler`):
whether one more request would be refused, and how many more could be taken now. Pure Python.

New work is refused (``Overloaded``) when one more stream would not be fed faster than real
time by steps of the measured size short enough for a first chunk (admission by slack,
``pacing.fits``), or when it would wait longer than
``max_queue_wait_s`` for a slot (at the rate slots have lately freed) or for the prompts before
it to be prefilled, or while the first audio of the streams admitted lately came later than
``admission_first_audio_s`` (the promise kept, measured: ``RecentFirstAudio``). An idle session
counts as a stream: it comes back with its next segment.
"""

from __future__ import annotations

import math

from services.common.first_audio import (
    FIRST_AUDIO_MIN,
    FIRST_AUDIO_QUANTILE,
    FIRST_AUDIO_WINDOW_S,
    RecentFirstAudio,
)
from services.talker.pacing import FIRST_K, fits

__all__ = ["FIRST_AUDIO_MIN", "FIRST_AUDIO_QUANTILE", "FIRST_AUDIO_WINDOW_S", "AdmissionRules", "Overloaded",
           "RecentFirstAudio"]


class Overloaded(Exception):
    """One more stream would push the running ones behind real time."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AdmissionRules:
    """Reads the scheduler's state (running, waiting, idle, slots, times); changes nothing."""

    def refusal(self, now: float, prompt_len: int) -> Overloaded | None:
        """Why a request of ``prompt_len`` positions arriving at ``now`` would be refused, or None:
        one more stream would not be fed in real time at the measured step times (admission by
        slack), or it would wait longer than ``max_queue_wait_s`` before it speaks: for a slot,
        when every slot is taken (it starts as running rows end, at the rate they have lately
        been ending; unknown before a few have, then the queue's count bound alone applies), or
        for the prompts queued before it to be prefilled (the positions steps were granted lately,
        at most ``prefill_token_budget``, a step as long as the busy steps lately were), or while
        the streams admitted lately got their first audio later than ``admission_first_audio_s``
        (0: not refused so; :meth:`_first_audio_late`). ``admission_headroom`` None: no
        admission by slack."""
        streams = len(self.running) + len(self.waiting) + len(self.idle) + 1
        if streams == 1:
            return None  # alone it is served as fast as this device can: refusing helps nobody
        headroom = self.admission_headroom
        if headroom is not None and not fits(min(streams, self.max_num_seqs), self.bucket_for, self.pacing,
                                             self.times, headroom, self._host_promised_s()):
            left = min((r.max_frames - r.frames_done for r in self.running), default=0)
            return Overloaded(f"{streams - 1} streams already use the talker's real-time capacity (no step "
                              f"short enough for a first chunk feeds {streams} {1 + headroom:g}x faster "
                              f"than real time)", max(0.1, left / self.pacing.frame_rate))
        late = self._first_audio_late(now)
        if late is not None:
            return late
        wait = max(self._slot_wait(now), self._prefill_wait(prompt_len))
        if wait <= self.max_queue_wait_s:
            return None
        return Overloaded(f"about {wait:.2f} s before it could start ({len(self.waiting)} request(s) "
                          f"wait for a slot, {self._backlog_tokens()} prompt positions for prefill; "
                          f"max_queue_wait_s {self.max_queue_wait_s:g})", min(wait, 60.0))

    def _first_audio_late(self, now: float) -> Overloaded | None:
        """Refuses while the streams admitted lately got their first audio later than
        ``admission_first_audio_s``: as Code2Wav measured it (``consumer_first_audio_s``: its first
        chunks' p90 from its Open to the chunk sent, reported with its tick) once a consumer has
        reported one (then 0, too few lately, refuses nobody: while it refuses, its own window
        empties first), else as the talker's first records' p90 (arrival to write) plus
        ``path_s``, the way pacing allows a record (Code2Wav's longest tick with its spread: a
        bound, not a first chunk's usual way)."""
        target = self.admission_first_audio_s
        if not target:
            return None
        window = self.first_audio
        if self.consumer_reports_first_audio:
            if not self.consumer_first_audio_s:
                return None
            took, what = self.consumer_first_audio_s, (
                f"p{100 * window.quantile:.0f} of the first chunks Code2Wav sent in the last "
                f"{window.window_s:g} s, from its Open")
        else:
            lately = window.lately(now)
            if lately is None:
                return None
            took, what = lately + self.pacing.path_s, (
                f"p{100 * window.quantile:.0f} of the first records written in the last "
                f"{window.window_s:g} s, their way to the listener included")
        if took <= target:
            return None
        return Overloaded(f"first audio lately took {1e3 * took:.0f} ms ({what}; admission_first_audio_s "
                          f"{target:g})", window.window_s)

    def admissible(self, now: float, prompt_len: int) -> int:
        """About how many more requests of ``prompt_len`` positions could be taken now before the
        waits ``refusal`` checks pass ``max_queue_wait_s`` (0 when one would be refused)."""
        if self.refusal(now, prompt_len) is not None:
            return 0
        room = self.max_num_seqs  # at most a full batch more between two looks
        released = self._released
        if len(released) >= 2 and now > released[0]:
            rate = (len(released) - 1) / (now - released[0])
            free = min(len(self.slots), self.max_num_seqs - len(self.running))
            room = min(room, int(free + rate * self.max_queue_wait_s) - len(self.waiting))
        if self.period_s:  # as _prefill_wait counts: whole steps' grants before the last one's
            steps = math.floor(self.max_queue_wait_s / self.period_s) + 1
            tokens = steps * self._step_grant() - self._backlog_tokens()
            room = min(room, int(tokens / max(1, prompt_len)))
        return max(1, room)

    def admission_view(self, now: float) -> dict:
        """What admission by slack reads for one more stream at ``now`` (the step log's
        ``admission``): the streams, the bucket they would run in and where its time comes from
        (its clean line, its steps with prefill inside, or the buckets around it), the step's
        estimate at K = 1 and ``FIRST_K``, the loop's own time beyond it, the first records'
        time lately (admission by first audio) and the verdict."""
        streams = len(self.running) + len(self.waiting) + len(self.idle)
        rows = min(streams + 1, self.max_num_seqs)
        try:
            bucket = self.bucket_for(rows)
        except ValueError:
            return {"streams": streams, "bucket": None, "fits": False}
        times, host = self.times, self._host_promised_s()
        source = ("clean" if bucket in times.steps else "provisional" if bucket in times.provisional
                  else "around")
        ms = lambda s: None if s is None else round(s * 1e3, 3)  # noqa: E731
        return {"streams": streams, "bucket": bucket, "line": source,
                "k1_ms": ms(times.estimate(bucket, 1)), "k2_ms": ms(times.estimate(bucket, FIRST_K)),
                "host_ms": ms(host), "period_ms": ms(self.period_s), "path_ms": ms(self.pacing.path_s),
                "per_token_us": round(times.per_token_s * 1e6, 3), "grant": self._step_grant(),
                "first_audio_ms": ms(self.first_audio.lately(now)),
                "consumer_first_audio_ms": ms(self.consumer_first_audio_s),
                "fits": self.admission_headroom is None or fits(rows, self.bucket_for, self.pacing, times,
                                                                 self.admission_headroom, host)}

    def _slot_wait(self, now: float) -> float:
        ahead = len(self.waiting) - min(len(self.slots), self.max_num_seqs - len(self.running))
        released = self._released
        if ahead < 0 or len(released) < 2 or now <= released[0]:
            return 0.0
        return (ahead + 1) * (now - released[0]) / (len(released) - 1)

    def _backlog_tokens(self) -> int:
        return (sum(r.prompt_len - r.prefilled for r in self.running if r.prefilling)
                + sum(r.prompt_len for r in self.waiting))

    def _step_grant(self) -> int:
        """Prompt positions a step prefills: ``prefill_token_budget``, or what steps were granted
        lately while prompts waited (the speaking rows' slack cuts it), if less."""
        if self.prefill_grant is None or not self.running:  # no speaking row bounds it
            return self.prefill_token_budget
        grant = self.prefill_grant
        return max(1, int(min(self.prefill_token_budget, grant)))

    def _prefill_wait(self, prompt_len: int) -> float:
        if self.period_s is None:
            return 0.0
        steps = (self._backlog_tokens() + prompt_len) // self._step_grant()
        return steps * self.period_s
