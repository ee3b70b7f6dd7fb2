"""The serving-loop issues' acceptance, read off simulated tiers: the per-tier numbers each is
judged on (the talker's: stalls, first audio, K, refusals and how fast they come, the burst
against its prefill compute floor; Code2Wav's: audio-s/s, its process's CPU, chunks per decode
call) and each criterion with its value and verdict, so a before table and an after table are
judged by the same lines."""

from __future__ import annotations

CLEAN_UP_TO = 1024
TTFA_P50_MS_AT_64, TTFA_P99_MS_AT_1024 = 60.0, 150.0
MEAN_K_AT_256 = 4.0
OVERLOAD_TIER, REFUSAL_MS = 2048, 50.0
BURST_RATIO = 1.5
# Code2Wav's serving loop: with both stages modeled
C2W_CLEAN_UP_TO, C2W_AUDIO_AT_1024, C2W_TTFA_P50_MS_AT_64 = 1024, 1000.0, 60.0


def _v(value, unit: str = "") -> str:
    return "-" if value is None else f"{value:g}{unit}"


def tier_table(tiers: dict) -> list[str]:
    """One line a tier of what the acceptance reads (burst columns when the tiers carry them)."""
    burst = any("burst" in r for r in tiers.values())
    head = ("| C | admitted / refused | refusal ms p50 / p99 / max | underruns | clean | TTFA p50 / p99 ms | "
            "mean K | K bounds |")
    if burst:
        head += " prefill floor ms (admitted) | one step ms (K) | TTFA p99 / (floor + step) |"
    lines = [head, "|" + "---|" * head.count(" |")]
    for c in sorted(tiers, key=int):
        r = tiers[c]
        ref, talker = r["refusals"], r["talker"]
        refusal = " / ".join(_v(ref["refusal_ms"][q]) for q in ("p50", "p99", "max"))
        bounds = ", ".join(f"{k} {n}" for k, n in sorted((talker.get("k_bounds") or {}).items())) or "-"
        line = (f"| {c} | {ref['admitted']} / {ref['refused']} | {refusal} | {r['underruns']} | "
                f"{'yes' if r['clean'] else 'no'} | {_v(r['ttfa_ms']['p50'])} / {_v(r['ttfa_ms']['p99'])} | "
                f"{talker['mean_k']} | {bounds} |")
        if burst:
            b = r["burst"]
            line += (f" {_v(b['prefill_floor_ms'])} ({_v(b['admitted_prefill_floor_ms'])}) | "
                     f"{_v(b['one_step_ms'])} ({_v(b['one_step_k'])}) | "
                     f"{_v(b['ttfa_p99_over_floor_step'])} |")
        lines.append(line)
    return lines


def criteria(tiers: dict) -> list[tuple[str, str, bool | None]]:
    """(criterion, the value read, met) for each acceptance line these tiers can judge; met is
    None where the tier it needs was not run."""
    t = {int(c): r for c, r in tiers.items()}
    out = []
    upto = [c for c in sorted(t) if c <= CLEAN_UP_TO]
    read = [f"C={c}: {t[c]['underruns']}" + (f" ({t[c]['rejected']} refused)" if t[c]["rejected"] else "")
            for c in upto]
    out.append((f"every tier clean (0 stalls) up to {CLEAN_UP_TO:,}", ", ".join(read) or "-",
                all(t[c]["underruns"] == 0 and not t[c]["errors"] for c in upto) if upto else None))
    for c, q, bar in ((64, "p50", TTFA_P50_MS_AT_64), (1024, "p99", TTFA_P99_MS_AT_1024)):
        value = t[c]["ttfa_ms"][q] if c in t else None
        out.append((f"TTFA {q} <= {bar:g} ms at C={c:,}", _v(value, " ms"),
                    None if value is None else value <= bar))
    k = t[256]["talker"]["mean_k"] if 256 in t else None
    out.append((f"mean K >= {MEAN_K_AT_256:g} at C=256", _v(k), None if k is None else k >= MEAN_K_AT_256))
    overload = f"C={OVERLOAD_TIER:,}: admitted streams 0 stalls, the rest refused in <= {REFUSAL_MS:g} ms"
    if OVERLOAD_TIER in t:
        r = t[OVERLOAD_TIER]
        ref = r["refusals"]
        slowest = ref["refusal_ms"]["max"]
        read = (f"{ref['admitted']} admitted, {r['underruns']} stalls; {ref['refused']} refused, "
                f"slowest {_v(slowest, ' ms')}")
        out.append((overload, read,
                    r["underruns"] == 0 and not r["errors"] and (slowest is None or slowest <= REFUSAL_MS)))
    else:
        out.append((overload, "-", None))
    for c in sorted(t):
        b = t[c].get("burst")
        if b is not None:
            ratio = b["ttfa_p99_over_floor_step"]
            out.append((f"burst C={c:,}: TTFA p99 within {BURST_RATIO:g}x (prefill floor + one step)",
                        _v(ratio, "x"), None if ratio is None else ratio <= BURST_RATIO))
    return out


def code2wav_table(tiers: dict) -> list[str]:
    head = ("| C | underruns | refused | audio-s/s | TTFA p50 ms | Code2Wav CPU cores | chunks/s | "
            "frames a chunk | chunks a decode call |")
    lines = [head, "|" + "---|" * head.count(" |")]
    for c in sorted(tiers, key=int):
        r = tiers[c]
        c2w = r["code2wav"]
        lines.append(f"| {c} | {r['underruns']} | {r['rejected']} | {r['audio_s_per_s']} | "
                     f"{_v(r['ttfa_ms']['p50'])} | {r['cpu_cores_busy'].get('code2wav')} | "
                     f"{c2w['chunks_per_s']} | {_v(c2w.get('mean_chunk_frames'))} | "
                     f"{_v(c2w.get('chunks_per_call'))} |")
    return lines


def code2wav_criteria(tiers: dict) -> list[tuple[str, str, bool | None]]:
    """Code2Wav's serving-loop issue: every tier clean (no stall, no refusal) up to 1,024, at
    least 1,000 audio-s/s at C=1,024, TTFA p50 at C=64."""
    t = {int(c): r for c, r in tiers.items()}
    upto = [c for c in sorted(t) if c <= C2W_CLEAN_UP_TO]
    read = [f"C={c}: {t[c]['underruns']}" + (f" ({t[c]['rejected']} refused)" if t[c]["rejected"] else "")
            for c in upto]
    out = [(f"every tier clean (0 stalls, none refused) up to {C2W_CLEAN_UP_TO:,}", ", ".join(read) or "-",
            all(t[c]["underruns"] == 0 and not t[c]["errors"] and not t[c]["rejected"] for c in upto)
            if upto else None)]
    audio = t[1024]["audio_s_per_s"] if 1024 in t else None
    out.append((f">= {C2W_AUDIO_AT_1024:,g} audio-s/s at C=1,024", _v(audio),
                None if audio is None else audio >= C2W_AUDIO_AT_1024))
    ttfa = t[64]["ttfa_ms"]["p50"] if 64 in t else None
    out.append((f"TTFA p50 <= {C2W_TTFA_P50_MS_AT_64:g} ms at C=64", _v(ttfa, " ms"),
                None if ttfa is None else ttfa <= C2W_TTFA_P50_MS_AT_64))
    return out


def markdown(tiers: dict) -> list[str]:
    verdict = {True: "met", False: "**not met**", None: "not run"}
    lines = ["Acceptance (the talker's serving-loop issue; `bench/sim/acceptance.py`):", "",
             *tier_table(tiers), "", "| criterion | value | verdict |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {verdict[met]} |" for name, value, met in criteria(tiers)]
    lines += ["", "Acceptance (Code2Wav's serving-loop issue):", "", *code2wav_table(tiers), "",
              "| criterion | value | verdict |", "|---|---|---|"]
    lines += [f"| {name} | {value} | {verdict[met]} |" for name, value, met in code2wav_criteria(tiers)]
    return lines
