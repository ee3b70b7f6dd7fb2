"""The server bench's tables of where a tier's time went, read from each tier's engine numbers:
first audio by the idle before it (the sequential C=1 tier), the talker's step split and what
limited K, first audio's parts, the refusals and first audio by the second it was asked.
bench/server/report.py puts them under a run's table of tiers."""

from __future__ import annotations

from bench.server.probes import STEP_PARTS


def fmt(value, digits: int = 1) -> str:
    """A table cell: "-" for None, a float to ``digits`` places."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def idle_table(tiers: dict) -> list[str]:
    """Markdown: the sequential C=1 tier's time to first audio by the idle before the request
    (nothing when no tier has one)."""
    rows = [(c, t["ttfa_by_idle_ms"]) for c, t in sorted(tiers.items(), key=lambda kv: int(kv[0]))
            if t.get("ttfa_by_idle_ms")]
    if not rows:
        return []
    lines = ["Sequential C=1, time to first audio by the idle before the request (after the previous "
             "one ended):", "", "| C | idle s | requests | TTFA p50 / p90 / p99 ms |", "|---|---|---|---|"]
    for c, by_idle in rows:
        lines += [f"| {c} | {gap} | {v.get('requests')} | {fmt(v.get('p50'))} / {fmt(v.get('p90'))} / "
                  f"{fmt(v.get('p99'))} |" for gap, v in by_idle.items()]
    return [*lines, ""]


def step_split_table(tiers: dict) -> list[str]:
    """Markdown: each tier's talker step split (nothing when no tier has one)."""
    rows = [(c, t["talker"]["step_split_ms"]) for c, t in sorted(tiers.items(), key=lambda kv: int(kv[0]))
            if t.get("talker", {}).get("step_split_ms")]
    if not rows:
        return []
    head = " | ".join((*STEP_PARTS, "other"))
    lines = [f"Talker step, ms per decode step: {head}; and what limited K (share of the steps).", "",
             f"| C | step ms | mean K | {head} | K limited by |",
             "|---|---|---|" + "---|" * (len(STEP_PARTS) + 2)]
    for c, split in rows:
        talker = tiers[c]["talker"]
        bounds = talker.get("k_bound_share") or {}
        limits = ", ".join(f"{b} {v:.0%}" for b, v in sorted(bounds.items(), key=lambda kv: -kv[1]) if v)
        lines.append(f"| {c} | {fmt(talker.get('step_ms'), 2)} | {fmt(talker.get('mean_k'), 2)} | "
                     + " | ".join(fmt(split[part], 2) for part in (*STEP_PARTS, "other"))
                     + f" | {limits or '-'} |")
    return [*lines, ""]


def prefill_cost_table(tiers: dict) -> list[str]:
    """Markdown: what prefill cost each tier's decode steps (nothing when no tier has it)."""
    rows = [(c, t["talker"]["prefill_cost"]) for c, t in sorted(tiers.items(), key=lambda kv: int(kv[0]))
            if t.get("talker", {}).get("prefill_cost")]
    if not rows:
        return []
    lines = ["Prefill in the steps: the share of decode steps that prefilled first, their mean ms (launch "
             "to results) against the others', the calls a prefill made, and positions run over real.", "",
             "| C | steps with prefill | ms with / without | calls a prefill | padded / real |",
             "|---|---|---|---|---|"]
    lines += [f"| {c} | {cost['share_with_prefill']:.0%} | {fmt(cost['step_ms_with_prefill'])} / "
              f"{fmt(cost['step_ms_without_prefill'])} | {fmt(cost['calls_per_prefill'], 2)} | "
              f"{fmt(cost['padded_per_real'], 2)} |" for c, cost in rows]
    return [*lines, ""]


def code2wav_table(tiers: dict) -> list[str]:
    """Markdown: Code2Wav's decode calls and the tick it reported to the talker (docs/protocol.md,
    Pacing), with its chunks by why they were cut (nothing when no tier has them)."""
    rows = [(c, t["code2wav"]) for c, t in sorted(tiers.items(), key=lambda kv: int(kv[0]))
            if (t.get("code2wav") or {}).get("cuts")]
    if not rows:
        return []
    lines = ["Code2Wav: ms a decode call, chunks a call, and so for a tick's urgent calls (first chunks, "
             "listeners under two ticks) and the rest; a first chunk's mean ms off the ring until its call "
             "began and until it was sent; the decode tick it reported at the tier's end (mean and two "
             "deviations), its chunks by why they were cut, and where the clients' stalls were made: those "
             "Code2Wav's model of each listener saw (from its sends), those the gateway's saw (from its "
             "receipts: made by then), and the clients' own.", "",
             "| C | ms a call | chunks a call | urgent: ms / chunks | rest: ms / chunks "
             "| first chunk: wait / sent | tick ms | first / need / size / end "
             "| stalls: Code2Wav / gateway / clients |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {c} | {fmt(cw.get('decode_ms_per_call'))} | {fmt(cw.get('chunks_per_call'))} | "
              f"{fmt(cw.get('urgent_ms_per_call'))} / {fmt(cw.get('urgent_chunks_per_call'))} | "
              f"{fmt(cw.get('rest_ms_per_call'))} / {fmt(cw.get('rest_chunks_per_call'))} | "
              f"{fmt(cw.get('first_chunk_wait_ms'))} / {fmt(cw.get('first_chunk_ms'))} | "
              f"{fmt(cw.get('tick_ms_at_end'))} | "
              + " / ".join(fmt(cw["cuts"].get(why), 0) for why in ("first", "need", "size", "end"))
              + f" | {fmt(cw.get('modeled_underruns'), 0)} / "
              f"{fmt((tiers[c].get('gateway') or {}).get('modeled_underruns'), 0)} / "
              f"{fmt(tiers[c].get('underruns'), 0)} |"
              for c, cw in rows]
    return [*lines, ""]


def relay_cell(gateway: dict, left: float | None, code2wav: dict | None = None) -> str:
    """The first chunk's relay as measured at the gateway, share over 30 ms, Code2Wav's event loop
    part of it (queued -> taken + handed to gRPC -> taken) where it counted them, and the remainder
    of "rest" beside it; the remainder alone for a gateway without the histogram."""
    measured = gateway.get("relay_ms_mean")
    if measured is None:
        return fmt(left, 1)
    over = gateway.get("relay_over_30ms")
    share = "" if over is None else f", {100 * over:.0f}% > 30 ms"
    loop, write = ((code2wav or {}).get(key) for key in ("first_chunk_loop_ms", "first_chunk_write_ms"))
    inside = "" if loop is None or write is None else f"; C2W loop {fmt(loop, 1)} + write {fmt(write, 1)}"
    return f"{fmt(measured, 1)}{share}{inside} ({fmt(left, 1)})"


def first_record_table(tiers: dict) -> list[str]:
    """Markdown: where first audio goes, per tier: the talker's parts of its first records (mean ms) beside
    the gateway's mean time to first audio; "rest" is what the talker does not see (the gateway
    before Submit and after the chunk, the ring, Code2Wav's first decode, the hops), and "of it C2W"
    Code2Wav's part of it (first record taken off the ring -> first chunk sent), "of it ring"
    Code2Wav's open -> first frames off the ring less the talker's parts (the Submit's way to the
    talker and the record's wait for Code2Wav's tick under way), "of it relay" the Open's way to
    Code2Wav and the first chunk's from Code2Wav's engine thread through its event loop and gRPC to
    the gateway: as the gateway measured it per request (with the share over 30 ms; of it, Code2Wav's
    event loop: the chunk queued -> its handler took it, + handed to gRPC -> gRPC took it) and, in
    parentheses, what the other columns leave of "rest", "of it Open" the gateway's Code2Wav
    Open (call to handle, before the Submit; the Submit's answer beside it, which overlaps the
    talker's "wait"); "grant / in" the prompt positions a step was allowed and prefilled, mean over
    the steps prompts waited."""
    rows = [(c, t) for c, t in sorted(tiers.items(), key=lambda kv: int(kv[0]))
            if t.get("talker", {}).get("first_record_ms")]
    if not rows:
        return []
    lines = ["First audio, mean ms: the talker's first record (Submit -> prefill queued -> first step "
             "launched -> record written) and the rest of the gateway's time to first audio.", "",
             "| C | gateway TTFA mean | wait | prefill | step | rest | of it C2W | of it ring | "
             "of it relay | of it Open (Submit) | grant / in |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, tier in rows:
        first = tier["talker"]["first_record_ms"]
        gateway = tier.get("gateway", {})
        server = gateway.get("server_ttfa_mean_ms")
        talker = first["wait"] + first["prefill"] + first["step"]
        rest = None if server is None else server - talker
        opened_to_frames = tier.get("code2wav", {}).get("first_frame_ms")
        ring = None if opened_to_frames is None else opened_to_frames - talker
        c2w = tier.get("code2wav", {}).get("first_chunk_ms")
        left = None if None in (rest, ring, c2w) else rest - ring - c2w
        relay = relay_cell(gateway, left, tier.get("code2wav"))
        grant = tier["talker"].get("prefill_grant") or {}
        allowed, prefilled = grant.get("positions_per_step"), grant.get("prefilled_per_step")
        lines.append(f"| {c} | {fmt(server, 1)} | {fmt(first['wait'], 2)} | {fmt(first['prefill'], 2)} | "
                     f"{fmt(first['step'], 2)} | {fmt(rest, 1)} | "
                     f"{fmt(c2w, 1)} | {fmt(ring, 1)} | {relay} | "
                     f"{fmt(gateway.get('open_ms_mean'), 1)} ({fmt(gateway.get('submit_ms_mean'), 1)}) | "
                     f"{fmt(allowed, 0)} / {fmt(prefilled, 0)} |")
    return [*lines, ""]


def refusal_table(tiers: dict) -> list[str]:
    """Markdown: each tier's refusals, how long they took from the send and what they said (the
    load report's messages, numbers folded to #)."""
    rows = [(c, t["loadgen"]) for c, t in sorted(tiers.items(), key=lambda kv: int(kv[0]))
            if (t.get("loadgen") or {}).get("refusal_s")]
    if not rows:
        return []
    lines = ["Refusals: from the send to RESOURCE_EXHAUSTED, how many the gateway answered itself (on its "
             "talker's watched verdict or a refusal of a moment ago), the share that took over 50 ms inside "
             "the gateway (from the request's start there), of those it answered and of those a stage "
             "answered (a client's time beyond it was spent outside the gateway), the share of its event "
             "loop's wakes later than 25 / 50 ms (a stall of every request it carries; its garbage "
             "collections that long), and why.", "",
             "| C | refused | p50 / p99 ms | held at the gateway | > 50 ms in the gateway: held / by a stage "
             "| gateway loop late > 25 / 50 ms | messages |",
             "|---|---|---|---|---|---|---|"]
    for c, report in rows:
        took = report["refusal_s"]
        why = "; ".join(f"{n} x {text}" for text, n in report.get("refusals", {}).items())
        gateway = tiers[c].get("gateway", {})
        late = " / ".join("-" if gateway.get(k) is None else f"{100 * gateway[k]:.1f}%"
                          for k in ("loop_lag_over_25ms", "loop_lag_over_50ms"))
        collections = (tiers[c].get("gc") or {}).get("gateway") or {}
        if collections.get("over_25ms") is not None:
            late += f" ({collections['over_25ms']} GC > 25 ms)"
        lines.append(f"| {c} | {report['rejected']} | {fmt(_ms(took['p50']))} / {fmt(_ms(took['p99']))} | "
                     f"{fmt(gateway.get('refusals_held'), 0)} | {_inside(gateway)} | {late} | "
                     f"{why.replace('|', '/')} |")
    return [*lines, ""]


def tail_seconds_table(tiers: dict, worst: int = 3) -> list[str]:
    """Markdown: where each tier's tail of first audio was made, by the second its requests were
    sent in (the load report's ``ttfa_by_second_s``): the spread of the seconds' p99 and the
    ``worst`` seconds by p99 (nothing when no tier has it)."""
    rows = [(c, t["ttfa_by_second_ms"]) for c, t in sorted(tiers.items(), key=lambda kv: int(kv[0]))
            if t.get("ttfa_by_second_ms")]
    if not rows:
        return []
    lines = ["First audio by the second its request was sent in (from the tier's first send): the "
             "seconds' p99 (least / median / most) and the seconds of the highest p99 (first audios "
             "that second, p50 / p99 / max ms). A tail made in a few seconds is a transient; one "
             "spread over the run is the tier's.", "",
             "| C | seconds | p99 by second, ms | highest: second (n) p50 / p99 / max |", "|---|---|---|---|"]
    for c, by_second in rows:
        p99s = sorted(row[3] for row in by_second)
        spread = f"{p99s[0]:.1f} / {p99s[len(p99s) // 2]:.1f} / {p99s[-1]:.1f}"
        top = sorted(by_second, key=lambda row: -row[3])[:worst]
        cells = "; ".join(f"{second} ({n}) {p50:.1f} / {p99:.1f} / {most:.1f}"
                          for second, n, p50, p99, most in top)
        lines.append(f"| {c} | {len(by_second)} | {spread} | {cells} |")
    return [*lines, ""]


def _inside(gateway: dict) -> str:
    """The refusals over 50 ms inside the gateway, of those it answered and of those a stage did:
    "1.2% of 731 / 40.0% of 50" ("-" for a gateway without the histograms)."""
    parts = []
    for where in ("here", "stages"):
        n, share = gateway.get(f"refusals_{where}"), gateway.get(f"refusal_{where}_over_50ms")
        parts.append("-" if n is None else f"{100 * share:.1f}% of {n}" if share is not None else f"- of {n}")
    return " / ".join(parts)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3
