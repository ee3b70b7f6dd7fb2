"""Per-thread instructions in each loop of ``stack_step``'s one launch, compiled for the H200 (sm_90)
on any machine (CPU is enough): a product loop runs one warp per scheduler, so its time per block
follows the instructions each thread issues, and a change to a loop can be counted before it is timed.

    python -m bench.probes.sass_loops ['{"KQ_QKV": 1}' ...]   # tunings (JSON) over the default; one row

Prints one JSON line per tuning: for each loop of at least 40 instructions (its back edge found in
nvdisasm's output), the instruction count, the main opcodes, and the kernel functions its source lines
fall in (``_flat_dual`` with ``_operand``: the QKV or gate/up loop; ``_flat_single``: the projection,
output, down or head loop; ``_rstd``: a norm's sums; ``_phase_attention``: attention), over the files of
kernels/stack_step/ and kernels/tl_common.py."""

from __future__ import annotations

import argparse
import ast
import collections
import json
import re
import subprocess
import tempfile
from pathlib import Path

import triton

from tests.unit import stack_step_hopper

PACKAGE = Path(__file__).resolve().parents[2] / "kernels" / "stack_step"
OPCODES = ("HMMA", "LDGSTS", "UTMALDG", "LDG", "LDS", "LDSM", "STS", "BAR", "F2F", "FMUL", "FFMA", "SEL")


def functions() -> dict[tuple[str, int], str]:
    """(file name, source line) -> the name of the kernel function it is in, over the package's files and
    the shared helpers' (kernels/tl_common.py)."""
    where = {}
    for path in [*sorted(PACKAGE.glob("*.py")), PACKAGE.parent / "tl_common.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef):
                for line in range(node.lineno, node.end_lineno + 1):
                    where.setdefault((path.name, line), node.name)
    return where


def loops(tuning: dict | None) -> list[dict]:
    kernel = stack_step_hopper.compile_kernel(tuning)
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        text = subprocess.run([str(nvdisasm), "-g", "-c", str(cubin)], capture_output=True, text=True,
                              check=True, timeout=300).stdout
    instructions, labels, line = [], {}, None
    for raw in text.splitlines():
        if m := re.match(r'\s*//## File "(.*?)", line (\d+)', raw):
            line = (Path(m.group(1)).name, int(m.group(2)))
        elif m := re.match(r"\s*\.(L_x_\d+):", raw):
            labels[m.group(1)] = len(instructions)
        elif m := re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?);", raw):
            instructions.append((line, m.group(1)))
    where = functions()
    found = []
    for end, (_, text) in enumerate(instructions):
        m = re.search(r"BRA\b.*?`?\(?\.(L_x_\d+)", text)
        if not m or labels.get(m.group(1), end) >= end or end - labels[m.group(1)] + 1 < 40:
            continue
        body = instructions[labels[m.group(1)] : end + 1]
        if len(body) > 1000:  # the layer loop and the phases around the product loops
            continue
        ops = collections.Counter()
        for _, ins in body:
            op = re.sub(r"^@!?U?P[T0-9]+\s+", "", ins.strip()).split()[0].split(".")[0]
            ops[op] += 1
        names = collections.Counter(where.get(n, "?") for n, _ in body if n)
        found.append({"instructions": len(body), "ops": {k: ops[k] for k in OPCODES if ops[k]},
                      "functions": dict(names.most_common(4))})
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tunings", nargs="*", type=json.loads, default=[{}],
                        help="tunings over the default, as JSON (default: the default alone)")
    for tuning in parser.parse_args().tunings:
        print(json.dumps({"tuning": tuning, "loops": loops(tuning)}))


if __name__ == "__main__":
    main()
