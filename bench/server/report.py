"""The result files: what every one records (commit, GPU, versions, host), written whole or
not at all; and, from every ``server_gpu_tiers_*.json`` and ``server_gpu_baseline*.json``
in a folder, the markdown table (``server_gpu.md``) and the plots (``server_gpu_ttfa.png``,
``server_gpu_audio_rate.png``)."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import time
from importlib import metadata
from pathlib import Path

from bench.server import log
from bench.server.gpu import gpu_info, run_cmd
from bench.server.settings import LAYOUTS, REPO, Settings, mode_prefix, overrides_env
from bench.server.tier_tables import (
    code2wav_table,
    first_record_table,
    fmt,
    idle_table,
    prefill_cost_table,
    refusal_table,
    step_split_table,
    tail_seconds_table,
)


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)  # a kill never leaves half a file


def versions() -> dict:
    out = {"python": platform.python_version()}
    for dist in ("torch", "triton", "transformers", "grpcio", "protobuf", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def commit() -> str:
    # the device's copy of the tree has no .git: pass VOXRING_COMMIT there
    if os.environ.get("VOXRING_COMMIT"):
        return os.environ["VOXRING_COMMIT"]
    code, out = run_cmd(["git", "-C", str(REPO), "rev-parse", "HEAD"])
    return out if code == 0 else "unknown"


def base_result(s: Settings) -> dict:
    return {"commit": commit(), "gpu": gpu_info() if not s.smoke else {"name": "cpu (smoke)"},
            "versions": versions(), "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "env_overrides": overrides_env(), "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "tokenizer": s.tokenizer}


def clean_through(tiers: dict) -> int:
    """The largest C up to which every tier is clean (0 if the first is not): "real-time
    streams" is the highest clean tier, which a lower tier's stalls do not lower."""
    through = 0
    for c, tier in sorted(tiers.items(), key=lambda kv: int(kv[0])):
        if not tier.get("clean"):
            break
        through = int(c)
    return through


def _stall_chunks(counts: dict | None) -> str:
    """Which chunk of a stream the stalls waited for, as ' (chunk 2: 3, 3: 1)' after the count."""
    if not counts:
        return ""
    return " (chunk " + ", ".join(f"{k}: {n}" for k, n in counts.items()) + ")"


def report(out: Path) -> str:
    """The markdown table of every result file in ``out``, and the plots (matplotlib, if
    installed); returns the markdown (also written to ``server_gpu.md``)."""
    runs = {}
    for path in sorted(out.glob("server_gpu_tiers_*.json")):
        with contextlib.suppress(ValueError):
            data = json.loads(path.read_text())
            runs[data.get("mode", path.stem)] = data
    lines = []
    for mode, data in runs.items():
        lines += run_table(mode, data)
    lines += scale_out_tables(runs)
    for path in sorted(out.glob("server_gpu_baseline*.json")):
        with contextlib.suppress(ValueError):
            lines += baseline_table(json.loads(path.read_text()))
    text = "\n".join(lines) + "\n"
    (out / "server_gpu.md").write_text(text)
    plots(out, runs)
    return text


def load_text(mode: str, data: dict) -> str:
    """Which load a result file's tiers ran, in a sentence (files from before --load: fixed)."""
    load = data.get("load", "fixed")
    if load == "fixed":
        per_tier = "2 requests" if "smoke" in mode else f"{data.get('requests_per_stream')} x C requests"
        return (f"Load: fixed, {per_tier} per tier of {data.get('audio_seconds')} s audio each "
                "(one fixed prompt, C at a time)")
    low, high = data.get("audio_range") or ("?", "?")
    texts = f"corpus texts, audio {low}-{high} s each, uniform (seed {data.get('load_seed')})"
    if load == "poisson":
        text = (f"Load: poisson, {data.get('requests_per_stream')} x C requests per tier in an open "
                f"loop at C / {data.get('audio_seconds')} s arrivals per second (C streams in flight "
                f"on average), {texts}")
    else:
        text = f"Load: burst, C requests at once per tier, {texts}"
    gateways = data.get("gateways") or 1
    if (data.get("client_connections") or 1) > 1:
        text += (f", over {data['client_connections']} client connections"
                 + (" to each gateway" if gateways > 1 else ""))
    if gateways > 1:
        text += f", spread evenly over {gateways} gateway processes"
    if (data.get("client_processes") or 1) > 1:
        text += f", sent from {data['client_processes']} client processes"
    if data.get("sequential_requests") is None:  # files from before the sequential C=1 tier
        return text
    gaps = ", ".join(f"{gap:g}" for gap in data.get("idle_gaps") or ())
    return (f"{text}. C=1 is sequential: {data['sequential_requests']} requests one at a time, each "
            f"sent once the previous one ended, after an idle of {gaps} s in turn (first audio by idle "
            "below; no steady rate)")


def tokenizer_text(data: dict) -> str:
    """Which tokenizer made the prompts (files from before --tokenizer: the byte-level one)."""
    tokenizer = data.get("tokenizer", "byte")
    name = f"the {tokenizer} tokenizer" if tokenizer else "the checkpoint's own tokenizer"
    return f"prompts tokenized by {name}"


def run_table(mode: str, data: dict) -> list[str]:
    """Markdown: one result file's heading, its load and the table of its tiers."""
    mps = data.get("mps")
    note = ""
    if mps is not None and mps.get("requested") and not mps.get("active"):
        note = f" — MPS requested but NOT active ({mps.get('error', 'unknown')})"
    gpu = data.get("gpu", {})
    gpus_used = data.get("gpus_used", 1)
    scheduled = data.get("load", "fixed") != "fixed"
    lines = [f"### {mode}: {gpu.get('name', '?')}, driver {gpu.get('driver', '-')}, torch "
             f"{data.get('versions', {}).get('torch')}, commit {data.get('commit', '?')[:12]}{note}", "",
             f"Layout: {data.get('layout_text', LAYOUTS['one'])}. {load_text(mode, data)}; "
             f"{tokenizer_text(data)}; "
             f"each tier capped at {data.get('tier_max_s')} s"
             f"{' or what its schedule needs' if scheduled else ''}. Real-time streams: "
             f"**{data.get('realtime_streams', data.get('realtime_streams_per_gpu', 0))}** on "
             f"{gpus_used} GPU{'s' if gpus_used > 1 else ''} "
             f"({data.get('realtime_streams_per_gpu', 0)} per GPU); every tier clean up to "
             f"**{clean_through(data.get('tiers', {}))}**. {CLEAN_TEXT} {STEADY_TEXT}", "",
             "| C | admitted / rejected | TTFA p50 / p90 / p99 ms | gap p99 ms | underruns | "
             "audio-s/s | steady audio-s/s | RTF | talker frames/s | step ms | mean K | rows/step | "
             "C2W chunks/s | gateway CPU cores | GPU MiB peak | PCM mismatches / short | clean |"
             + (" in flight mean / peak | audio-s asked / delivered |" if scheduled else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|" + "---|---|" * scheduled]
    for c, t in sorted(data.get("tiers", {}).items(), key=lambda kv: int(kv[0])):
        lines.append(_tier_row(c, t) + (_load_cells(t) if scheduled else ""))
    lines.append("")
    tiers = data.get("tiers", {})
    return (lines + idle_table(tiers) + step_split_table(tiers) + prefill_cost_table(tiers)
            + code2wav_table(tiers) + first_record_table(tiers)
            + refusal_table(tiers) + tail_seconds_table(tiers))


CLEAN_TEXT = ("Clean: every request admitted and completed, zero underruns, not cut by the cap, every "
              "request's PCM samples = its usage frames x sample rate / frame rate, and none delivered "
              "under 99% of the audio it asked for on its length cap (a stop frame may end one early).")
STEADY_TEXT = ("Steady audio-s/s: the audio received from 2 s after the tier's first send to its last "
               "send, over that window.")


def _load_cells(t: dict) -> str:
    """A poisson or burst tier's extra cells: streams in flight, audio asked and delivered."""
    return (f" {fmt(t.get('mean_in_flight'), 2)} / {fmt(t.get('max_in_flight'))} | "
            f"{fmt(t.get('requested_audio_s'))} / {fmt(t.get('delivered_audio_s'))} |")


def _tier_row(c: str, t: dict) -> str:
    tk, cw, ttfa = t.get("talker", {}), t.get("code2wav", {}), t["ttfa_ms"]
    errors = f" ({', '.join(f'{k} {v}' for k, v in t['errors'].items())})" if t["errors"] else ""
    return (f"| {c} | {t['admitted']} / {t['rejected']}{errors} | {fmt(ttfa['p50'])} / "
            f"{fmt(ttfa['p90'])} / {fmt(ttfa['p99'])} | {fmt(t['gap_p99_ms'])} | "
            f"{t['underruns']}{_stall_chunks(t.get('stalls_by_chunk'))} | "
            f"{fmt(t['audio_s_per_s'])} | {fmt(t.get('steady_audio_s_per_s'))} | {fmt(t['rtf'], 3)} | "
            f"{fmt(tk.get('frames_per_s'))} | {fmt(tk.get('step_ms'))} | {fmt(tk.get('mean_k'), 2)} | "
            f"{fmt(tk.get('mean_rows_per_step'))} | {fmt(cw.get('chunks_per_s'))} | "
            f"{fmt(_gateway_cores(t), 2)} | "
            f"{_memory(t.get('gpu_memory_mib', {}).get('peak'))} | "
            f"{fmt(t.get('sample_mismatches'))} / {fmt(t.get('audio_shortfalls'))} | "
            f"{'yes' if t['clean'] else 'no'}{' (partial)' if t['status'] == 'partial' else ''} |")


def _gateway_cores(t: dict) -> float | None:
    """The gateways' CPU cores in a tier (all of them; older results: the one gateway's)."""
    return (t.get("gateway") or {}).get("cpu_cores", t.get("cpu_cores_busy", {}).get("gateway"))


def _memory(peak) -> str:
    """A tier's peak GPU memory: one number (older results) or one per GPU."""
    if isinstance(peak, dict):
        return " + ".join(str(peak[k]) for k in sorted(peak)) if peak else "-"
    return fmt(peak)


def scale_out_tables(runs: dict) -> list[str]:
    """Each multi-GPU layout (or run of several gateways) against the one-pair, one-gateway run
    with the same MPS setting and load (when both are in the folder): audio-s/s per tier and its
    ratio, the largest clean tier, time to first audio at equal load per GPU (the one-pair run at
    C against this one at 2C), and the gateways' CPU per stream."""
    lines: list[str] = []
    for mode, data in runs.items():
        layout = data.get("layout", "one")
        if layout == "one" and (data.get("gateways") or 1) == 1:
            continue
        label = mode_prefix(layout, data.get("gateways") or 1)  # the layout, and N gateways where N > 1
        base_mode = mode.removeprefix(f"{label}-")
        base = runs.get(base_mode)
        if base is None:
            continue
        tiers, base_tiers = data.get("tiers", {}), base.get("tiers", {})
        clean = data.get("realtime_streams", 0)
        base_clean = base.get("realtime_streams", base.get("realtime_streams_per_gpu", 0))
        ratio = f"{clean / base_clean:.2f}x" if base_clean else "-"
        gpus = data.get("gpus_used", 2)
        lines += [f"### Scale-out: {mode} against {base_mode} (one pair on one GPU)", "",
                  f"Largest tier with every request admitted, completed and zero underruns: **{clean}** "
                  f"against **{base_clean}** ({ratio}).", "",
                  f"| C | audio-s/s, one pair | audio-s/s, {label} | ratio | clean, one pair / {label} | "
                  f"gateway CPU cores per stream ({label}) | gateway CPU ms per audio-s ({label}) |",
                  "|---|---|---|---|---|---|---|"]
        for c in sorted({*map(int, tiers), *map(int, base_tiers)}):
            t, b = tiers.get(str(c)), base_tiers.get(str(c))
            a1 = b["audio_s_per_s"] if b else None
            a2 = t["audio_s_per_s"] if t else None
            gw = (t or {}).get("gateway", {})
            lines.append(f"| {c} | {fmt(a1)} | {fmt(a2)} | "
                         f"{f'{a2 / a1:.2f}x' if a1 and a2 else '-'} | "
                         f"{'yes' if b and b['clean'] else 'no' if b else '-'} / "
                         f"{'yes' if t and t['clean'] else 'no' if t else '-'} | "
                         f"{fmt(gw.get('cpu_cores_per_stream'), 4)} | "
                         f"{fmt(gw.get('cpu_ms_per_audio_s'), 2)} |")
        lines += ["", f"Time to first audio at equal load per GPU (one pair at C streams, {label} at "
                  f"{gpus}C over {gpus} GPUs):", "",
                  f"| C per GPU | one pair: TTFA p50 / p99 ms | {label} at {gpus}C: TTFA p50 / p99 ms | "
                  f"underruns, one pair / {label} |", "|---|---|---|---|"]
        for c in sorted(map(int, base_tiers)):
            b, t = base_tiers[str(c)], tiers.get(str(gpus * c))
            if t is None:
                continue
            lines.append(f"| {c} | {fmt(b['ttfa_ms']['p50'])} / {fmt(b['ttfa_ms']['p99'])} | "
                         f"{fmt(t['ttfa_ms']['p50'])} / {fmt(t['ttfa_ms']['p99'])} | "
                         f"{b['underruns']} / {t['underruns']} |")
        lines.append("")
    return lines


def baseline_table(data: dict) -> list[str]:
    vox, hf = data.get("voxring", {}), data.get("transformers", {})
    gpu = data.get("gpu", {}).get("name", "?")
    lines = [f"### Baseline: {gpu}, one checkpoint ({data.get('checkpoint')}), commit {data.get('commit')}",
             "", "| | B=1 | B=8 |", "|---|---|---|"]

    def row(label: str, get) -> None:
        lines.append(f"| {label} | {fmt(get('B=1'))} | {fmt(get('B=8'))} |")

    row("voxring talker, device ms per frame (CUDA graph)",
        lambda b: vox.get(b, {}).get("device_ms_per_frame"))
    row("voxring talker, frames/s (device)", lambda b: vox.get(b, {}).get("device_frames_per_s"))
    row("voxring talker, frames/s (whole K=8 step, wall)",
        lambda b: vox.get(b, {}).get("wall_frames_per_s"))
    row(f"transformers generate, frames/s ({hf.get('B=1', {}).get('frames', '-')} frames, greedy)",
        lambda b: hf.get(b, {}).get("frames_per_s"))
    lines.append("")
    if "floor_ms_B1" in vox:
        lines.append(f"Weight-read floor at B=1: {vox['floor_bytes_GB']} GB / {vox['copy_bandwidth_TBps']} "
                     f"TB/s = {vox['floor_ms_B1']} ms; the frame takes {vox.get('B=1', {}).get('vs_floor')}x "
                     "that.")
    for name, side in (("voxring", vox), ("transformers", hf)):
        if "error" in side or "skipped" in side:
            lines.append(f"{name}: {side.get('error') or side.get('skipped')}")
    return [*lines, ""]


def _nan(value: float | None) -> float:
    return float("nan") if value is None else value


def _log_if_positive(ax) -> str:
    """A log y axis when any plotted value is positive (matplotlib refuses one otherwise)."""
    import math

    for line in ax.get_lines():
        for y in line.get_ydata():
            with contextlib.suppress(TypeError, ValueError):
                if math.isfinite(float(y)) and float(y) > 0:
                    return "log"
    return "linear"


def _tier_axis(ax, runs: dict) -> None:
    """A base-2 log axis labelled with the tiers themselves."""
    from matplotlib.ticker import NullLocator

    ticks = sorted({t["concurrency"] for data in runs.values() for t in data.get("tiers", {}).values()})
    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(NullLocator())
    if ticks:
        ax.set_xticks(ticks, [str(t) for t in ticks])


def _save_plot(plt, fig, ax, runs: dict, path: Path, ylabel: str, title: str) -> None:
    """Labels, axes, grid and legend of one plot against concurrency; writes it and closes it."""
    ax.set(yscale=_log_if_positive(ax), xlabel="concurrent streams", ylabel=ylabel, title=title)
    _tier_axis(ax, runs)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plots(out: Path, runs: dict) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed: no plots (the JSON and the table hold every number)")
        return
    runs = {mode: data for mode, data in runs.items() if data.get("tiers")}
    if not runs:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, data in runs.items():
        tiers = sorted(data.get("tiers", {}).values(), key=lambda t: t["concurrency"])
        xs = [t["concurrency"] for t in tiers]
        for key, style in (("p50", "-o"), ("p99", "--s")):
            ax.plot(xs, [_nan(t["ttfa_ms"][key]) for t in tiers], style, label=f"{mode} {key}")
    _save_plot(plt, fig, ax, runs, out / "server_gpu_ttfa.png", "time to first audio (ms)",
               "Time to first audio vs concurrency")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    top = 1
    for mode, data in runs.items():
        tiers = sorted(data.get("tiers", {}).values(), key=lambda t: t["concurrency"])
        xs = [t["concurrency"] for t in tiers]
        top = max([top, *xs])
        ax.plot(xs, [_nan(t["audio_s_per_s"]) for t in tiers], "-o", label=mode)
    ax.plot([1, top], [1, top], ":", color="gray", label="real time for every stream")
    _save_plot(plt, fig, ax, runs, out / "server_gpu_audio_rate.png", "audio seconds per second",
               "Audio produced vs concurrency")
    log(f"plots: {out / 'server_gpu_ttfa.png'}, {out / 'server_gpu_audio_rate.png'}")
