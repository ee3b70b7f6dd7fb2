"""Probe: rope_kv's bf16 q against its twin and against fp32 math rounded once, and the conversions
the compiled kernel contains (PTX cvt and fma counts). GPU only:

    python -m bench.probes.rope_rounding

Before the products were rounded through opaque PTX conversions, the kernel matched neither the
twin (4929 of 32768 outputs an ulp off) nor one-rounding math (4155), and its PTX held an fma per
output: the compiler had folded one product's bf16 round trip into the sum.
"""

from __future__ import annotations

import argparse
import sys

import torch

from kernels import rope_kv
from models.csm.config import RopeConfig
from models.csm.modules import RotaryTable


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench.probes.rope_rounding needs a CUDA GPU")
    torch.manual_seed(0)
    rows, num_q, num_kv, dim = 16, 32, 8, 64
    table = RotaryTable(RopeConfig(rope_type="default", theta=500000.0), dim, 256)
    table.materialize("cuda")
    qkv = torch.randn(rows, (num_q + 2 * num_kv) * dim, device="cuda").bfloat16()
    positions = torch.randint(0, 256, (rows,), device="cuda")
    slots = torch.arange(rows, device="cuda")
    caches = [torch.zeros(rows, 256, num_kv, dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    q = rope_kv.rope_kv_triton(qkv, table.cos, table.sin, positions, slots, caches[0], caches[1], num_q)
    twin = rope_kv.rope_kv_eager(qkv, table.cos, table.sin, positions, slots, caches[2], caches[3], num_q)
    x = qkv[:, : num_q * dim].view(rows, num_q, dim).float()
    cos = table.cos[positions].bfloat16().float()[:, None]
    sin = table.sin[positions].bfloat16().float()[:, None]
    rotated = torch.cat((-x[..., dim // 2:], x[..., : dim // 2]), -1)
    once = (x * cos + rotated * sin).bfloat16()  # products and sum in fp32, one rounding
    print("q outputs", q.numel())
    print("kernel != twin", int((q != twin).sum()))
    print("kernel != one rounding", int((q != once).sum()))
    print("twin != one rounding", int((twin != once).sum()))
    print("k cache kernel != twin", int((caches[0] != caches[2]).sum()))
    for compiled in list(rope_kv._rope_kv_kernel.device_caches[0][0].values())[:1]:
        lines = compiled.asm["ptx"].splitlines()
        print("ptx conversions:", sorted({line.split()[0] for line in lines if "cvt." in line}))
        print("ptx fma.rn.f32:", sum("fma.rn.f32" in line for line in lines))


if __name__ == "__main__":
    main()
