"""Library ops at the talker's shapes under an NVIDIA MPS active-thread limit: each op's result
(finite or not, and a digest) in a child with no daemon, with MPS and no limit, and at a limit,
to find which op gives other numbers or NaN there (bench notes 2026-12-05, run 16: under a limit
of 75 the talker's requests stop early even with every graph and kernel of ours off). Under each
limit the ops run twice: as they are, and with cuBLASLt told the SMs the process may hold (torch's
SM carveout), since it otherwise targets the device's count. GPU only; starts its own control
daemon in a private folder and stops it.

    python -m bench.probes.mps_ops [--limits 75] [--out mps_ops.json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from bench.probes.mps_talker import _run, under_limits
from bench.server.report import write_json

ROWS = (1, 8, 16, 64, 128, 256)
LINEARS = ((2048, 2048), (2048, 8192), (8192, 2048), (2048, 3072), (1024, 1024), (1024, 8192), (2048, 1024))


def ops(carveout: bool = False) -> None:
    """The child: one JSON line, op name -> [finite, digest of its result]. ``carveout``: cuBLASLt
    told the SMs this process may hold (torch's SM carveout: the device's less the MPS share's)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    device, out = torch.device("cuda", 0), {}
    if carveout:
        from kernels.sms import usable_sms

        torch._C._set_sm_carveout_experimental(
            torch.cuda.get_device_properties(device).multi_processor_count - usable_sms(device))

    def note(name: str, value: torch.Tensor) -> None:
        host = value.float().cpu()
        out[name] = [bool(torch.isfinite(host).all()), hashlib.sha1(host.numpy().tobytes()).hexdigest()[:12]]

    for k, n in LINEARS:
        w = (torch.randn(n, k, device=device) / k ** 0.5).to(torch.bfloat16)
        for rows in ROWS:
            x = torch.randn(rows, k, device=device).to(torch.bfloat16)
            note(f"linear_{rows}x{k}x{n}", F.linear(x, w))
            if rows in (64, 256):  # prefill's shapes: many positions a row
                note(f"linear_{rows * 16}x{k}x{n}", F.linear(x.repeat(16, 1), w))
    for batch, length in ((1, 64), (8, 64), (64, 16), (64, 32), (64, 64), (16, 256)):
        q, k_, v = (torch.randn(batch, 32, length, 64, device=device, dtype=torch.bfloat16) for _ in range(3))
        note(f"sdpa_causal_{batch}x{length}", F.scaled_dot_product_attention(q, k_, v, is_causal=True))
        mask = torch.ones(length, length, device=device, dtype=torch.bool).tril()
        note(f"sdpa_mask_{batch}x{length}", F.scaled_dot_product_attention(q, k_, v, attn_mask=mask))
    for rows in ROWS:
        logits = torch.randn(rows, 2051, device=device)
        note(f"softmax_{rows}", torch.softmax(logits, -1))
        note(f"topk_{rows}", torch.topk(logits, 50, -1).values)
        note(f"sort_{rows}", torch.sort(logits, -1, descending=True).values)
        note(f"cumsum_{rows}", torch.cumsum(torch.softmax(logits, -1), -1))
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.probes.mps_ops",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", choices=("plain", "carveout"), help=argparse.SUPPRESS)
    parser.add_argument("--limits", default="none,75")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.child:
        ops(args.child == "carveout")
        return
    base, found = dict(os.environ), {}

    def child(env: dict, kind: str = "plain") -> dict:
        got = _run([sys.executable, "-m", "bench.probes.mps_ops", "--child", kind], env, 300)
        try:
            return json.loads(got["output"].splitlines()[-1])
        except (json.JSONDecodeError, IndexError):
            return {"error": got}

    found["no_daemon"] = child(base)
    limits = tuple(None if x == "none" else x for x in args.limits.split(","))

    def both(name: str, env: dict) -> None:
        found[name] = child(env)
        if name != "mps_no_limit":  # under a limit, also with cuBLASLt told the share
            found[f"{name}_carveout"] = child(env, "carveout")

    under_limits(base, limits, found, both)
    reference = found["no_daemon"]
    summary = {name: {op: value for op, value in got.items() if reference.get(op) != value}
               for name, got in found.items() if isinstance(got, dict) and name != "no_daemon"}
    result = {"differs_from_no_daemon": summary, "found": found}
    print(json.dumps(summary, indent=1))
    if args.out is not None:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
