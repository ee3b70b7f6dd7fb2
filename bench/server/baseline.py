"""``--part baseline``: on one checkpoint, voxring's talker frame (the runner's CUDA graph)
beside its weight-read floor, and transformers' ``CsmForConditionalGeneration.generate``,
at batch 1 and 8."""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.server import log
from bench.server.report import base_result, write_json
from bench.server.settings import PROMPT, STOP_MARGIN_S, Settings


def part_baseline(s: Settings) -> int:
    """voxring's talker frame vs its floor, and transformers' generate, on one checkpoint."""
    import torch

    if not s.smoke and not torch.cuda.is_available():
        raise SystemExit("server_gpu: --part baseline needs a CUDA GPU (or --smoke)")
    path = s.out / ("server_gpu_baseline_smoke.json" if s.smoke else "server_gpu_baseline.json")
    result = {**base_result(s), "part": "baseline", "hf_frames": s.hf_frames}
    if s.smoke:
        from models.tiny.talker import ensure_tiny_checkpoint

        folder = s.checkpoint or ensure_tiny_checkpoint()
        device, dtype = torch.device("cpu"), torch.float32
    else:
        from bench.server.checkpoint import ensure_full_checkpoint

        folder = s.checkpoint or ensure_full_checkpoint(s.checkpoint_root, tokenizer=s.tokenizer)[0]
        device, dtype = torch.device("cuda"), torch.bfloat16
    result["checkpoint"] = folder.name
    write_json(path, result)
    code = 0
    for name, fn in (("voxring", voxring_frame), ("transformers", transformers_generate)):
        if s.left() < STOP_MARGIN_S:
            result[name] = {"skipped": "wall cap"}
            code = 3
            continue
        try:
            result[name] = fn(folder, device, dtype, s)
        except Exception as exc:  # one side failing must not lose the other's numbers
            log(f"{name}: {type(exc).__name__}: {exc}")
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
            code = 1
        if device.type == "cuda":
            torch.cuda.empty_cache()
        write_json(path, result)
        log(f"{name}: {json.dumps(result[name])}")
    return code


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def voxring_frame(folder: Path, device, dtype, s: Settings) -> dict:
    import torch

    import kernels
    from bench.talker.gpu import (
        copy_bandwidth,
        device_ms_per_frame,
        frame_floor_bytes,
        prefill_all,
        step_wall_ms,
    )
    from models.csm.loader import load_talker
    from services.talker.runner import Runner

    kernels.configure(sampler=True, decode_attention=True, fused_layers=True)  # the server's defaults
    model = load_talker(folder, dtype, device)
    floor_bytes = frame_floor_bytes(model)  # from parameters (packing adds copies, no bytes to read)
    out: dict = {"floor_bytes_GB": round(floor_bytes / 1e9, 3)}
    if device.type == "cuda":
        model.pack_weights()
        bandwidth = copy_bandwidth()
        torch.cuda.empty_cache()
        out["copy_bandwidth_TBps"] = round(bandwidth / 1e12, 3)
        out["floor_ms_B1"] = round(floor_bytes / bandwidth * 1e3, 3)
    runner = Runner(model, num_slots=8, max_len=256, buckets=[1, 8], k_max=8, max_repetition_window=16,
                    use_graphs=device.type == "cuda")
    prefill_all(runner, 8, False)  # greedy rows
    for b in (1, 8):
        entry = {}
        if device.type == "cuda":
            ms = device_ms_per_frame(runner, b)
            entry.update({"device_ms_per_frame": round(ms, 3), "device_frames_per_s": round(b * 1e3 / ms, 1)})
            if b == 1:
                entry["vs_floor"] = round(ms / out["floor_ms_B1"], 2)
        wall = step_wall_ms(runner, b, 8, steps=10 if device.type == "cuda" else 2)  # K=8 frames per step
        entry.update({"step_wall_ms_K8": round(wall, 2), "wall_frames_per_s": round(b * 8 * 1e3 / wall, 1)})
        out[f"B={b}"] = entry
    del runner, model
    return out


def transformers_generate(folder: Path, device, dtype, s: Settings) -> dict:
    import torch

    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError:
        return {"skipped": "transformers is not installed"}
    from tokenizers import Tokenizer

    hf_logging.set_verbosity_error()
    started = time.perf_counter()
    model = transformers.CsmForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(device).eval()
    out: dict = {"version": transformers.__version__, "load_s": round(time.perf_counter() - started, 1),
                 "dtype": str(dtype).removeprefix("torch."), "greedy": True,
                 "tied_by_hand": _tie_audio_embeddings(model)}
    codebook_size = model.config.codec_config.codebook_size
    suppress = list(range(codebook_size, model.config.vocab_size))  # ids Mimi cannot decode
    ids = Tokenizer.from_file(str(folder / "tokenizer.json")).encode(f"[0]{PROMPT}").ids  # bos ... eos

    def generate(batch: int, frames: int):
        input_ids = torch.tensor([ids] * batch, device=device)
        with torch.inference_mode():
            return model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                  max_new_tokens=frames, do_sample=False,
                                  depth_decoder_do_sample=False, suppress_tokens=suppress,
                                  depth_decoder_suppress_tokens=suppress, return_dict_in_generate=True)

    generate(1, 2)  # warm-up (kernels, allocator)
    for batch in (1, 8):
        _sync(device)
        started = time.perf_counter()
        result = generate(batch, s.hf_frames)
        _sync(device)
        wall = time.perf_counter() - started
        frames = int(result.sequences.shape[1])  # [B, frames, codebooks]: generated frames only
        out[f"B={batch}"] = {"frames": frames, "wall_s": round(wall, 3),
                             "frames_per_s": round(batch * frames / wall, 1),
                             "ms_per_frame_step": round(wall * 1e3 / max(frames, 1), 2)}
    return out


def _tie_audio_embeddings(model) -> list[str]:
    """The checkpoint stores the audio embedding the backbone and the depth decoder share once
    (``loader.TIED``, as csm-1b does). transformers versions that load it tied (5.24) need
    nothing; those whose CsmConfig turns tying off (5.17) leave the backbone's copy missing,
    randomly initialised: point it at the stored tensor, so both models run the same weights.
    Returns the parameters tied here."""
    from models.csm.loader import TIED

    tied = []
    for alias, stored in TIED.items():
        weight = model.get_parameter(stored)
        if model.get_parameter(alias).data_ptr() != weight.data_ptr():
            owner, _, name = alias.rpartition(".")
            setattr(model.get_submodule(owner), name, weight)
            tied.append(alias)
    return tied
