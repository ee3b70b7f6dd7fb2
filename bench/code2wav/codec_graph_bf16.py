"""Why Code2Wav's bf16 graph replay differs from its eager decode at B >= 8 (codec_gpu.json;
fp32 equal), and how far. GPU only (``--smoke``: the same code on the CPU, tiny Mimi, no
graphs).

    python -m bench.code2wav.codec_graph_bf16 [--out bench/results/code2wav/codec_graph_bf16.json]

For each shape (batch B, chunk T) of codec_gpu.json, from fresh slots and the same codes:

1. **Determinism**: eager twice, and graph replay twice; equal bit for bit or not.
2. **Graph against eager**: equal or not; the largest difference; each one's relative error
   against an fp32 decode of the same weights (a bf16 rounding difference leaves both at the
   same distance from fp32; a bug would put one far off).
3. **Where**: with a forward hook on every leaf module storing its input and output (clones:
   under capture they land in the graph's pool and hold the replay's values), the first
   module whose output differs between graph and eager while its input is equal, for the
   smallest shape that differs.
4. **Switches**: ``default`` lets cuDNN pick any algorithm (Code2Wav's
   ``engine.deterministic: false``); then the same comparison with cuDNN deterministic (the
   engine's default), with cuDNN off, and with bf16 matmul reductions in full precision, to
   name the library whose choice differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import torch

from bench.server.steps import codec_model, header
from services.code2wav.decoder import CodecDecoder

SHAPES = [(1, 2), (1, 8), (8, 2), (8, 8), (32, 2), (32, 8), (128, 2), (128, 8)]
SMOKE_SHAPES = [(1, 2), (2, 2)]


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


def eager(codec, batch: int, codes: torch.Tensor) -> torch.Tensor:
    ids = torch.arange(batch, device=codes.device)
    codec.reset(ids)
    return codec.decode_step(ids, codes).clone()


def replay(decoder: CodecDecoder, batch: int, codes: torch.Tensor) -> torch.Tensor:
    decoder.codec.reset(torch.arange(batch, device=codes.device))
    return decoder.decode(list(range(batch)), codes)


def compare(codec, decoder: CodecDecoder | None, reference, shapes) -> dict:
    out = {}
    for batch, frames in shapes:
        g = torch.Generator(device="cpu").manual_seed(batch * 100 + frames)
        codes = torch.randint(0, codec.config.codebook_size, (batch, codec.num_codebooks, frames),
                              generator=g).to(codec.upsample.conv.weight.device)
        e1, e2 = eager(codec, batch, codes), eager(codec, batch, codes)
        fp32 = eager(reference, batch, codes)
        entry = {"eager_repeatable": bool(torch.equal(e1, e2)), "eager_vs_fp32": rel(e1, fp32)}
        if decoder is not None and (batch, frames) in decoder.graphs:
            r1, r2 = replay(decoder, batch, codes), replay(decoder, batch, codes)
            entry.update({"graph_repeatable": bool(torch.equal(r1, r2)),
                          "graph_equals_eager": bool(torch.equal(r1, e1)),
                          "graph_vs_eager_max_abs": float((r1.float() - e1.float()).abs().max()),
                          "graph_vs_eager_rel": rel(r1, e1), "graph_vs_fp32": rel(r1, fp32)})
        out[f"B={batch},T={frames}"] = entry
    return out


class Taps:
    """Forward hooks on every leaf module: a clone of its first input and its output."""

    def __init__(self, codec) -> None:
        self.values: dict[str, tuple[torch.Tensor | None, torch.Tensor | None]] = {}
        self.order: list[str] = []
        self.handles = [m.register_forward_hook(self._hook(name)) for name, m in codec.named_modules()
                        if not list(m.children())]

    def _hook(self, name: str):
        def hook(_module, args, output):
            first = args[0] if args and isinstance(args[0], torch.Tensor) else None
            out = output if isinstance(output, torch.Tensor) else None
            if name not in self.values:
                self.order.append(name)
            self.values[name] = (None if first is None else first.clone(),
                                 None if out is None else out.clone())
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _captured_step(codec, ids: torch.Tensor, codes: torch.Tensor) -> None:
    """decode_step captured in a CUDA graph (warmed up on a side stream first, as the
    decoder does) and replayed once from fresh slots."""
    device = codes.device
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        codec.reset(ids)
        codec.decode_step(ids, codes)
    torch.cuda.current_stream(device).wait_stream(stream)
    codec.reset(ids)
    with torch.cuda.graph(graph):
        codec.decode_step(ids, codes)
    codec.reset(ids)
    graph.replay()
    torch.cuda.synchronize(device)


def locate(codec, batch: int, frames: int, captured: bool = True) -> dict:
    """The first module whose output differs between a captured replay and eager
    (``captured=False``, for the CPU: eager against eager, which must find none)."""
    device = codec.upsample.conv.weight.device
    codes = torch.randint(0, codec.config.codebook_size, (batch, codec.num_codebooks, frames), device=device)
    ids = torch.arange(batch, device=device)
    taps = Taps(codec)
    try:
        codec.reset(ids)
        codec.decode_step(ids, codes)
        eager_values = dict(taps.values)
        if captured:
            _captured_step(codec, ids, codes)
        else:
            codec.reset(ids)
            codec.decode_step(ids, codes)
        graph_values = dict(taps.values)
    finally:
        taps.remove()
    for name in taps.order:
        (e_in, e_out), (g_in, g_out) = eager_values[name], graph_values[name]
        if e_out is None or g_out is None or torch.equal(e_out, g_out):
            continue
        module = dict(codec.named_modules())[name]
        return {"module": name, "type": type(module).__name__, "repr": repr(module)[:200],
                "input_equal": e_in is not None and g_in is not None and bool(torch.equal(e_in, g_in)),
                "input_shape": None if e_in is None else list(e_in.shape),
                "output_max_abs": float((e_out.float() - g_out.float()).abs().max()),
                "output_rel": rel(g_out, e_out)}
    return {"module": None, "note": "every leaf module's output equal"}


@contextlib.contextmanager
def switch(name: str):
    saved = (torch.backends.cudnn.deterministic, torch.backends.cudnn.enabled,
             torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)
    try:
        if name == "cudnn_deterministic":
            torch.backends.cudnn.deterministic = True
        elif name == "cudnn_off":
            torch.backends.cudnn.enabled = False
        elif name == "bf16_full_precision_reduction":
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        yield
    finally:
        (torch.backends.cudnn.deterministic, torch.backends.cudnn.enabled,
         torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction) = saved


def run(smoke: bool) -> dict:
    device = torch.device("cpu" if smoke else "cuda")
    shapes = SMOKE_SHAPES if smoke else SHAPES
    codec = codec_model(device, smoke)
    reference = codec_model(device, smoke).float()  # the same weights, upcast exactly: only the
    reference.load_state_dict({k: v.float() for k, v in codec.state_dict().items()})  # arithmetic differs
    reference.allocate(max(b for b, _ in shapes) + 1)
    result = {**header(device), "smoke": smoke, "dtype": str(codec.upsample.conv.weight.dtype)}
    with torch.inference_mode():
        for name in ("default", "cudnn_deterministic", "cudnn_off", "bf16_full_precision_reduction"):
            if smoke and name != "default":
                continue
            with switch(name):
                decoder = CodecDecoder(codec, max(b for b, _ in shapes),
                                       buckets=sorted({b for b, _ in shapes}),
                                       chunk_frames=sorted({t for _, t in shapes}),
                                       max_graphs=0 if smoke else len(shapes), max_graph_mb=16384,
                                       deterministic=name == "cudnn_deterministic")
                result[name] = compare(codec, None if smoke else decoder, reference, shapes)
                differing = [s for s in shapes if not result[name][f"B={s[0]},T={s[1]}"].get(
                    "graph_equals_eager", True)]
                if differing or smoke:
                    result[name]["first_differing_module"] = locate(codec, *(differing or shapes)[0],
                                                                    captured=not smoke)
                print(name, json.dumps(result[name])[:600], flush=True)
                del decoder
                if not smoke:
                    torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results/code2wav/codec_graph_bf16.json"))
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("bench.code2wav.codec_graph_bf16 needs a CUDA GPU (--smoke runs on the CPU)", file=sys.stderr)
        return 2
    result = run(args.smoke)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
