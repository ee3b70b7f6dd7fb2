"""The gateway pipeline's /metrics: its requests, frames and audio, sessions, refusals (held here,
and how long each took inside the gateway), the listener stalls it saw, its Opens and Submits, its
first chunks' way from Code2Wav."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.gateway.pipeline import SynthesisPipeline

def pipeline_metrics(pipeline: SynthesisPipeline) -> dict:
    """The pipeline's counters and histograms as its /metrics serve them."""
    return {"active_streams": ("gauge", "requests in flight at this gateway", pipeline.router.in_flight),
            "engine_pairs": ("gauge", "engine pairs taking new requests", len(pipeline.router.pairs)),
            "requests_completed": ("counter", "requests that ended normally", pipeline.completed),
            "frames": ("counter", "codec frames delivered", pipeline.frames),
            "audio_seconds": ("counter", "seconds of audio delivered", pipeline.audio_seconds),
            "streaming_sessions": ("counter", "streaming sessions ended (segments a session: "
                                   "streaming_segments / streaming_sessions)", pipeline.sessions),
            "streaming_segments": ("counter", "segments the ended sessions spoke", pipeline.session_segments),
            "listener_underruns": ("counter", "chunks of a one-segment request that reached the "
                                   "gateway after its model of the listener (playback from the "
                                   "first chunk received) ran dry", pipeline.listener_underruns),
            "requests_refused_held": ("counter", "requests refused by the gateway on a talker's "
                                      "watched verdict or its refusal of a moment ago "
                                      "(routing.REFUSAL_HOLD_S), without a round trip",
                                      pipeline.refusals_held),
            **_start_metrics(pipeline)}


def _start_metrics(pipeline: SynthesisPipeline) -> dict:
    counts, refusals = pipeline.start_counts, pipeline.refusal_time
    return {"refusal_here_seconds": ("histogram", "a request's refusal for capacity answered by this "
                                     "gateway (its limit, a talker's verdict or held refusal), from "
                                     "its start here", refusals["here"].metric()),
            "refusal_stages_seconds": ("histogram", "the same, answered by a stage (after Code2Wav's "
                                       "Open and the talker's Submit)", refusals["stages"].metric()),
            "first_chunk_relay_seconds": ("histogram", "a one-segment request's first chunk from "
                                          "Code2Wav's send to its receipt here, the Open's way to "
                                          "Code2Wav included", pipeline.first_chunk_relay.metric()),
            "start_opens": ("counter", "Code2Wav Opens answered with a handle", counts["opens"]),
            "start_open_seconds": ("counter", "their seconds, from the call to the handle",
                                   counts["open_s"]),
            "start_submits": ("counter", "talker Submits answered (admitted or refused)",
                              counts["submits"]),
            "start_submit_seconds": ("counter", "their seconds, from the call to the answer",
                                     counts["submit_s"])}
