"""What runs on the talker's engine thread: the engine, its consumers' edges, and the
commands the gRPC servicer posts (Attach, Submit, Cancel, Stats).

Commands are plain callables taking the core; the servicer waits for their answers on
futures resolved with ``loop.call_soon_threadsafe``. Nothing here touches the event loop but
the admission verdicts' hand-off to their watchers (services/talker/verdicts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.common.errors import AlreadyExists, FailedPrecondition, NotFound, ResourceExhausted
from services.talker.consumers import Consumers
from services.talker.engine import TalkerEngine
from services.talker.metrics import FIRST_RECORD_PARTS, SLACK_EDGES
from services.talker.pacing import BOUNDS
from services.talker.request import TalkerRequest
from services.talker.scheduler import Overloaded, QueueFull
from services.talker.sessions import Segment, SessionError
from services.talker.verdicts import VerdictFeed
from services.transport import Endpoint


@dataclass
class Admission:
    """The refusal a typical request would get now (scheduler.Overloaded) or None, and how many
    more the servicer may post before the next verdict (``posted`` counts them). ``busy``: the
    engine thread was stepping when it gave the verdict, so it takes the next commands only after
    a step (``step_s`` lately)."""

    refusing: Overloaded | None
    room: int
    posted: int = 0
    busy: bool = False
    step_s: float = 0.1

    def claim(self) -> tuple[Overloaded | None, bool]:
        """The servicer's: (the refusal to answer at once, or None; whether the request is
        admitted on this verdict). Past ``room`` while the engine steps, a refusal at once: the
        room is what could start within ``max_queue_wait_s``, and the engine thread would answer
        only after its step, longer than a refusal may take. Past ``room`` while it is idle, the
        request goes to the engine thread, which answers at once with every check in order (a
        handle already in flight before capacity) and renews the verdict: (None, False)."""
        if self.refusing is not None:
            return self.refusing, False
        if self.posted >= self.room:
            return self.past_room(), False
        self.posted += 1
        return None, True

    def past_room(self) -> Overloaded | None:
        """The refusal of a request past ``room`` (None while the engine is idle: it answers)."""
        if not self.busy:
            return None
        return Overloaded(f"the {self.room} request(s) the talker's last step had room for are taken; "
                          f"the next step renews it", self.step_s)


@dataclass(frozen=True)
class StatsSnapshot:
    running: int
    waiting: int
    free_slots: int
    paused_rows: int
    steps_per_s: float
    frames_per_s: float
    mean_frames_per_step: float


class TalkerCore:
    """The Engine of the talker's EngineThread."""

    def __init__(self, engine: TalkerEngine, consumers: Consumers,
                 verdicts: VerdictFeed | None = None) -> None:
        self.engine = engine
        self.consumers = consumers
        self.verdicts = verdicts or VerdictFeed()  # what Talker.WatchAdmission streams
        self._published: tuple[str, int] = ("", 0)  # the verdict last published: (refusal, room)
        self._window = (engine.clock(), 0, 0)  # start, steps, frames of the Stats window
        self._typical_prompt = 100.0  # prompt positions of recent requests (weighted)
        # the engine thread's verdict after its last step, read by the servicer's event loop to
        # refuse at once while a step runs: a new one each step (its count starts again)
        self.admission = Admission(None, 1 << 30)
        self.refused_early = 0  # Submits the servicer refused on that verdict

    # --- EngineThread protocol ------------------------------------------------------------------

    @property
    def defer_replies(self) -> bool:
        """Answers after the step (EngineThread): on a device that runs on its own, the commands
        are taken while it waits for the next launch, and an answer sent then wakes the event loop
        into that wait (the GIL); on the CPU the step is the device's work, too long to hold them."""
        return self.engine.pipelined

    def handle(self, command) -> None:
        self.engine.counters.commands += 1
        command(self)

    def collect(self) -> bool:
        """The device work in flight, collected before the commands of the next step."""
        return self.engine.collect()

    def step(self) -> bool:
        self.engine.scheduler.set_consumer_tick(self.consumers.tick_s())
        self.engine.scheduler.set_consumer_first_audio(self.consumers.first_audio_s())
        busy = self.engine.step()
        self._update_admission()
        return busy

    def _update_admission(self) -> None:
        """What the servicer may answer a Submit at once, without waiting for this thread (which
        takes commands only between steps): the refusal a typical request would get now."""
        scheduler, now = self.engine.scheduler, self.engine.clock()
        scheduler.first_audio.lately(now)  # the metric's value, whichever rule decides
        refusing = scheduler.refusal(now, self._typical_prompt)
        room = 0 if refusing is not None else scheduler.admissible(now, round(self._typical_prompt))
        self.admission = admission = Admission(refusing, room, busy=self.engine.busy,
                                               step_s=scheduler.period_s or 0.1)
        refusal = "" if refusing is None else overloaded(refusing).message
        past = admission.past_room() if refusing is None else None
        verdict = (refusal, room if past is not None else 0)
        # the watchers get each verdict that differs from the last, and every one with a room: each
        # renews it (a gateway counts its Submits against the latest), even at the same number
        if verdict != self._published or verdict[1]:
            self._published = verdict
            self.verdicts.publish(refusal, 0.0 if refusing is None else refusing.retry_after_s,
                                  room=verdict[1], past_room=None if past is None else overloaded(past))

    def tick(self) -> None:
        for consumer_id in self.consumers.tick():
            self.engine.drop_consumer(consumer_id)
            self.consumers.remove(consumer_id)

    def keepalive(self) -> None:
        """The engine thread's keeper, during a long step: this side's heartbeats only."""
        self.consumers.keepalive()

    def idle(self) -> bool:
        return not self.engine.busy

    # --- commands ---------------------------------------------------------------------------------

    def attach(self, consumer_id: str, instance_token: int) -> Endpoint:
        endpoint, replaced = self.consumers.attach(consumer_id, instance_token)
        if replaced:  # a new instance: the old ring's rows cannot be delivered any more
            self.engine.drop_consumer(consumer_id)
        return endpoint

    def submit(self, request: TalkerRequest, *, checked: bool = False) -> int:
        """``checked``: admitted by the servicer on ``admission`` (the capacity checks are done)."""
        self._typical_prompt += 0.1 * (request.prompt_len - self._typical_prompt)
        if self.consumers.sink_for(request.consumer_id) is None:
            raise FailedPrecondition(f"consumer_id: {request.consumer_id!r} has not attached")
        try:
            position = self.engine.scheduler.add(request, checked=checked)
        except QueueFull as exc:
            raise ResourceExhausted(f"talker queue full: {exc}") from None
        except Overloaded as exc:
            raise overloaded(exc) from None
        except KeyError:
            raise AlreadyExists(f"handle {request.handle} is already in flight for consumer "
                                f"{request.consumer_id!r}") from None
        if self.admission.posted >= self.admission.room:
            # its verdict is spent and the requests it let in are in the scheduler now: while
            # Submits queue up faster than this thread steps (a starved thread takes them in one
            # batch), the verdict is renewed here rather than only after the next step
            self._update_admission()
        return position

    def cancel(self, consumer_id: str, handle: int) -> bool:
        return self.engine.scheduler.cancel(consumer_id, handle)

    def append(self, consumer_id: str, handle: int, segment: Segment) -> int:
        """A session's next segment (queued); how many are to be spoken before it."""
        try:
            return self.engine.scheduler.append(consumer_id, handle, segment)
        except KeyError as exc:
            raise NotFound(str(exc.args[0])) from None
        except SessionError as exc:
            raise FailedPrecondition(str(exc)) from None

    def clear(self, consumer_id: str, handle: int) -> tuple[bool, int]:
        """Barge-in on a session: (found, queued segments dropped)."""
        return self.engine.scheduler.clear(consumer_id, handle)

    def stats(self) -> StatsSnapshot:
        scheduler, counters = self.engine.scheduler, self.engine.counters
        start, steps, frames = self._window
        now = self.engine.clock()
        elapsed = max(now - start, 1e-9)
        snapshot = StatsSnapshot(
            running=len(scheduler.running), waiting=len(scheduler.waiting),
            # rows that could start now: a free slot and a batch row (idle sessions keep their slots)
            free_slots=min(len(scheduler.slots), scheduler.max_num_seqs - len(scheduler.running)),
            paused_rows=scheduler.paused, steps_per_s=(counters.steps - steps) / elapsed,
            frames_per_s=(counters.frames - frames) / elapsed,
            mean_frames_per_step=counters.step_frames / counters.steps if counters.steps else 0.0)
        self._window = (now, counters.steps, counters.frames)
        return snapshot

    def metrics(self) -> dict:
        """Read at scrape time from the metrics thread (plain reads of counters)."""
        scheduler, counters = self.engine.scheduler, self.engine.counters
        refused = scheduler.refused_overload + self.refused_early
        return {**_scheduler_metrics(scheduler), **_step_metrics(counters),
                "admissions_refused_slack": ("counter", "requests refused: one more stream would not be fed "
                                             "in real time or start soon", refused),
                **_prefill_cost_metrics(counters), **self._prefill_graph_metrics()}

    def _prefill_graph_metrics(self) -> dict:
        """What capturing the prefill graphs cost (zeros where none were captured: the CPU, graphs off)."""
        stats = self.engine.runner.prefill_graph_stats
        return {"prefill_graph_capture_seconds": ("gauge", "start-up time capturing prefill graphs",
                                                  stats.capture_s),
                "prefill_graph_reserved_bytes": ("gauge", "GPU memory the prefill graph pool reserved",
                                                 stats.memory_reserved_bytes),
                "prefill_graph_buckets": ("gauge", "prefill (rows, tokens) buckets with a graph",
                                          len(stats.captured))}

    def close(self) -> None:
        self.engine.drain()
        self.consumers.close()
        if self.engine.step_log is not None:
            self.engine.step_log.close()


def overloaded(exc: Overloaded) -> ResourceExhausted:
    return ResourceExhausted(f"talker at capacity: {exc}", retry_after=exc.retry_after_s)


def _slack_histogram(counters) -> tuple[list, float]:
    cumulative = np.cumsum(counters.slack_counts).tolist()
    edges = [str(edge) for edge in SLACK_EDGES] + ["+Inf"]
    return list(zip(edges, cumulative, strict=True)), counters.slack_sum


def _prefill_cost_metrics(counters) -> dict:
    """What prefill costs the steps: its calls, the positions they ran with their padding, and
    the decode steps' time apart by whether they prefilled first."""
    return {"prefill_calls": ("counter", "prefill calls (graph replays or eager ones)",
                              counters.prefill_calls),
            "prefill_padded_positions": ("counter", "positions those calls ran, padding included",
                                         counters.prefill_padded),
            "steps_with_prefill": ("counter", "decode steps that prefilled first",
                                   counters.steps_with_prefill),
            "steps_with_prefill_seconds": ("counter", "those steps' time, launch to results",
                                           counters.steps_with_prefill_s),
            "steps_without_prefill_seconds": ("counter", "the other decode steps' time, launch to results",
                                              counters.steps_without_prefill_s)}


def _scheduler_metrics(scheduler) -> dict:
    """The scheduler's gauges and counters: rows, queue, sessions, prefill grants, first audio."""
    return {
        "running": ("gauge", "rows running", len(scheduler.running)),
        "pacing_path_seconds": ("gauge", "a record's way to its listener as pacing counts it: "
                                "path_s and Code2Wav's reported decode tick",
                                scheduler.pacing.path_s),
        "queue_depth": ("gauge", "requests waiting for a slot", len(scheduler.waiting)),
        "sessions": ("gauge", "sessions in flight (running, waiting or idle)", scheduler.sessions),
        "sessions_idle": ("gauge", "sessions between segments (a slot each, no batch row)",
                          len(scheduler.idle)),
        "session_segments": ("counter", "sessions' segments after their first",
                             scheduler.session_counts["segments"]),
        "session_positions_reused": ("counter", "KV positions a session's segment found in its slot "
                                     "(earlier turns not prefilled again)",
                                     scheduler.session_counts["positions_reused"]),
        "session_positions_prefilled": ("counter", "KV positions sessions' later segments prefilled",
                                        scheduler.session_counts["positions_prefilled"]),
        "session_context_rebuilt": ("counter", "later segments that prefilled the whole context "
                                    "(past max_len: oldest turns dropped)",
                                    scheduler.session_counts["context_rebuilt"]),
        "paused_rows": ("gauge", "rows paused on a full ring", scheduler.paused),
        "prefill_grant_steps": ("counter", "steps planned while prompts waited for prefill",
                                scheduler.grant_counts["steps"]),
        "prefill_granted_positions": ("counter", "prompt positions those steps were allowed (the "
                                      "speaking rows' slack cuts prefill_token_budget)",
                                      scheduler.grant_counts["positions"]),
        "first_audio_lately_seconds": ("gauge", "p90 of the first records written in the last 0.5 s, "
                                       "arrival to write (admission by first audio; -1: too few)",
                                       -1.0 if scheduler.first_audio.last is None
                                       else scheduler.first_audio.last),
        "consumer_first_audio_seconds": ("gauge", "the first audio Code2Wav reports lately: p90 of "
                                         "its first chunks in the last 0.5 s, from its Open "
                                         "(admission reads it once reported; 0: none)",
                                         scheduler.consumer_first_audio_s),
    }


def _step_metrics(counters) -> dict:
    """The engine's step counters and its rows' histograms."""
    return {
        "frames": ("counter", "frames generated", counters.frames),
        "steps": ("counter", "engine steps", counters.steps),
        "step_schedule_seconds": ("counter", "engine time planning steps", counters.schedule_s),
        "step_prefill_seconds": ("counter", "engine time prefilling admitted rows",
                                 counters.prefill_s),
        "step_decode_seconds": ("counter", "engine time launching decode steps (on a synchronous "
                                "device: running them)", counters.decode_s),
        "step_wait_seconds": ("counter", "engine time waiting for a launched step's results",
                              counters.wait_s),
        "step_emit_seconds": ("counter", "engine time turning frames into records and writing them",
                              counters.emit_s),
        "step_host_seconds": ("counter", "engine time in steps other than waiting for the device",
                              counters.host_s),
        "steps_overlapped": ("counter", "steps whose records were written while the device ran "
                             "the next (host work overlapped with the device)",
                             counters.overlapped_steps),
        "step_frames": ("counter", "frames asked per row, summed over steps (mean K: / steps)",
                        counters.step_frames),
        "prefill_steps": ("counter", "steps that prefilled prompt chunks", counters.prefill_steps),
        "prefill_tokens": ("counter", "prompt positions prefilled", counters.prefill_tokens),
        "row_slack_seconds": ("histogram", "a row's slack (audio ahead of its listener) when its "
                              "record is written", _slack_histogram(counters)),
        **{f"first_record_{part}_seconds": ("histogram", text, counters.first_record[part].metric())
           for part, text in FIRST_RECORD_PARTS.items()},
        **{f"steps_k_bound_{bound}": ("counter", f"decode steps whose K was limited by {bound}",
                                      counters.k_bounds.get(bound, 0)) for bound in BOUNDS},
    }
