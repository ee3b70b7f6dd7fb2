"""The tables of ``bench/stack_cpu/tiers.py``: which run is a tier's worst, the markdown table of
one result (the worst run of each tier) and the before/after table of two results."""

from __future__ import annotations

import math


def tier_keys(result: dict) -> list[str]:
    """Every tier any run measured, in order of C."""
    keys = {c for run in result.get("runs", []) for c in run.get("tiers", {})}
    return sorted(keys, key=int)


def worst_key(tier: dict) -> tuple[float, float]:
    """What makes a run a tier's worst: most stalls, then the higher TTFA p90 (no first audio
    at all counts as the highest)."""
    p90 = tier["ttfa_ms"]["p90"]
    return (tier["stalls"], math.inf if p90 is None else p90)


def worst_runs(runs: list[dict]) -> dict[str, dict]:
    """Per tier, the worst run's tier record with ``run`` (its number) and ``of_runs`` (how
    many runs measured the tier); ties beyond the rule go to the earliest run."""
    worst = {}
    for c in tier_keys({"runs": runs}):
        measured = [(run["run"], run["tiers"][c]) for run in runs if c in run.get("tiers", {})]
        number, tier = max(measured, key=lambda item: worst_key(item[1]))  # max: the first of equals
        worst[c] = {"run": number, "of_runs": len(measured),
                    "stalls_each_run": [t["stalls"] for _, t in measured], **tier}
    return worst


def _num(value, digits: int = 1) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _ttfa(tier: dict) -> str:
    t = tier["ttfa_ms"]
    return " / ".join(_num(t[q]) for q in ("p50", "p90", "p99"))


def _errors(tier: dict) -> str:
    return ", ".join(f"{code} {n}" for code, n in tier["errors"].items()) or "0"


def thread_summary(run: dict) -> dict[str, str]:
    """Per stage, in words, the torch threads a run's stage got: what the stage said at start-up,
    else torch's own default in the stages' environment (a probe process's), unless the tree's
    code sets them."""
    default, hits = run.get("torch_default_threads") or {}, run.get("code_sets_threads") or []
    started = run.get("started_threads") or {}
    out = {}
    for stage, seen in (run.get("threads") or {}).items():
        env = f"OMP_NUM_THREADS={seen.get('OMP_NUM_THREADS') or 'unset'}"
        if not seen.get("torch_loaded"):
            out[stage] = f"no torch loaded ({seen.get('os_threads')} OS threads)"
        elif stage in started:
            out[stage] = (f"{started[stage]} intra-op, as the stage says ({env}; "
                          f"{seen.get('os_threads')} OS threads)")
        elif hits:
            out[stage] = f"set by the tree's code ({hits[0]}; {len(hits)} place(s)), {env}"
        else:
            out[stage] = (f"{default.get('intra_op')} intra-op / {default.get('inter_op')} inter-op "
                          f"(what torch picks with {env}: the tree sets none; "
                          f"{seen.get('os_threads')} OS threads)")
    return out


def _threads_line(result: dict) -> str:
    stages = result.get("threads", {}).get("stages") or {}
    return "; ".join(f"{stage}: {text}" for stage, text in stages.items()) or "not observed"


def header_lines(result: dict) -> list[str]:
    tree, machine, s = result["tree"], result["machine"], result["settings"]
    dirty = " (dirty: uncommitted changes)" if tree.get("dirty") else ""
    return [
        f"### stack_cpu `{result['label']}`: {tree.get('commit') or 'unknown commit'}{dirty}",
        "",
        f"Tree {tree['root']}; {machine['cpu_model']}, {machine['cores_usable']} cores usable, Python "
        f"{machine['python']}, torch {machine['torch']}, grpcio {machine['grpcio']}.",
        f"The stack as `voxring up` starts it (deploy/configs, addresses moved into a private folder), "
        f"voxring-tiny; closed loop, {s['requests']} requests a tier (at least C) of "
        f"{s['audio_seconds']:g} s of audio each; {s['runs']} run(s), each tier's worst shown (most "
        f"stalls, then higher TTFA p90).",
        f"Stage threads: {_threads_line(result)}.",
        "",
    ]


def result_table(result: dict) -> str:
    """The markdown table of one result: per tier, its worst run."""
    lines = header_lines(result)
    lines += ["| C | demand audio-s/s | delivered audio-s/s | stalls | stalled s | TTFA p50 / p90 / p99 ms "
              "| rejected | errors | worst run | stalls, each run | other work, cores |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c, tier in result.get("worst", {}).items():
        lines.append(f"| {c} | {_num(tier['demand_audio_s_per_s'])} | {_num(tier['audio_s_per_s'], 2)} "
                     f"| {tier['stalls']} | {_num(tier['stalled_s'], 2)} | {_ttfa(tier)} "
                     f"| {tier['rejected']} | {_errors(tier)} | {tier['run']} of {tier['of_runs']} "
                     f"| {' / '.join(map(str, tier['stalls_each_run']))} "
                     f"| {_num(tier['cpu_cores_busy'].get('others'), 2)} |")
    lines += ["", "Other work: the machine's busy cores over the tier that neither the stages nor the load "
              "generator account for (another process sharing the CPU; near 0 on a quiet machine)."]
    errors = [f"run {run['run']}: {run['error']}" for run in result.get("runs", []) if run.get("error")]
    if errors:
        lines += ["", "Runs that ended early: " + "; ".join(errors) + "."]
    return "\n".join(lines) + "\n"


def _pair(before: dict | None, after: dict | None, field, digits: int = 1) -> str:
    def one(tier: dict | None) -> str:
        if tier is None:
            return "-"
        value = field(tier)
        return str(value) if isinstance(value, int) else _num(value, digits)
    return f"{one(before)} | {one(after)}"


def compare_table(before: dict, after: dict) -> str:
    """Before and after side by side, per tier (each side's worst run)."""
    names = (before["label"], after["label"])
    lines = ["### stack_cpu: before / after", ""]
    for name, result in zip(names, (before, after), strict=True):
        tree, s = result["tree"], result["settings"]
        lines.append(f"- `{name}`: {tree.get('commit') or 'unknown'}{' (dirty)' if tree.get('dirty') else ''}"
                     f" in {tree['root']}; {s['runs']} run(s), {s['requests']} requests a tier of "
                     f"{s['audio_seconds']:g} s; stage threads: {_threads_line(result)}")
    if before["settings"] != after["settings"]:
        lines.append("- the two were run with different settings: compare with care")
    lines += ["", "Each tier's worst run on each side (most stalls, then higher TTFA p90).", "",
              f"| C | stalls {names[0]} | stalls {names[1]} | TTFA p50 ms {names[0]} | {names[1]} "
              f"| TTFA p90 ms {names[0]} | {names[1]} | audio-s/s {names[0]} | {names[1]} |",
              "|---|---|---|---|---|---|---|---|---|"]
    worst_b, worst_a = before.get("worst", {}), after.get("worst", {})
    for c in sorted(set(worst_b) | set(worst_a), key=int):
        b, a = worst_b.get(c), worst_a.get(c)
        lines.append(f"| {c} | {_pair(b, a, lambda t: t['stalls'])} "
                     f"| {_pair(b, a, lambda t: t['ttfa_ms']['p50'])} "
                     f"| {_pair(b, a, lambda t: t['ttfa_ms']['p90'])} "
                     f"| {_pair(b, a, lambda t: t['audio_s_per_s'], 2)} |")
    return "\n".join(lines) + "\n"
