"""bench.talker.fusion's exactness checks (3. in its description): the tiny model's fused codes
against its plain ones through the runner's graphs, and csm-1b's first frame teacher-forced and eight
frames free-running, each variant against fp32 plain."""

from __future__ import annotations

import json

import torch

from bench.talker.frame import random_model
from bench.talker.gpu import CSM_1B, prefill_all
from models.csm.config import CsmConfig
from models.csm.model import CsmTalker
from models.family import FrameInputs
from services.talker.runner import Runner


def first_frame(runner: Runner, forced: torch.Tensor | None = None):
    """One frame for the runner's largest bucket from its pooled state, which is left untouched:
    (logits [B, N, V] fp64, codes [B, N], next hidden [B, H] fp64). With ``forced`` codes
    [B, N], each codebook's logits are recorded and the forced code is fed on (teacher
    forcing), so every variant's depth logits are compared on the same inputs."""
    bucket = runner.buckets[-1]
    ids = torch.arange(bucket, device="cuda")
    buf = runner.pool
    sampling = type(buf.sampling)(**{k: v[ids].clone() for k, v in vars(buf.sampling).items()})
    inputs = FrameInputs(hidden=buf.hidden[ids].clone(), slots=ids, positions=buf.positions[ids].clone(),
                         frame_index=buf.frame_index[ids].clone(), min_frames=buf.min_frames[ids].clone(),
                         sampling=sampling, history=buf.history[ids].clone())
    k, v = runner.caches.backbone.k.clone(), runner.caches.backbone.v.clone()
    model, recorded = runner.model, []

    def record(inputs, logits, codebook, logits_out):  # the model's pick, recording (and forcing) codes
        recorded.append(logits.double())
        picked = CsmTalker.pick(model, inputs, logits, codebook, logits_out)
        return picked if forced is None else forced[:, codebook]

    model.pick = record  # this model's frames pick through it, until it is deleted
    try:
        with torch.inference_mode():
            out = model.decode_frame(inputs, runner.caches)
    finally:
        del model.pick
    runner.caches.backbone.k.copy_(k)
    runner.caches.backbone.v.copy_(v)
    return torch.stack(recorded, dim=1), out.codes, out.hidden.double()


def relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def exactness(result: dict, save) -> None:
    """The exactness checks into ``result``, which ``save`` writes after the tiny model's."""
    from models.tiny.talker import tiny_config

    tiny_buckets = [1, 2, 4, 8, 16]
    for sampled in (False, True):
        codes = {}
        for fused in (False, True):
            model = random_model(tiny_config(), torch.float32)
            if fused:
                model.pack_weights()
            runner = Runner(model, num_slots=16, max_len=256, buckets=tiny_buckets, k_max=8,
                            max_repetition_window=8, use_graphs=True)
            codes[fused] = {}
            for b in tiny_buckets:  # every bucket from freshly prefilled rows
                prefill_all(runner, 16, sampled)
                codes[fused][b] = runner.decode(list(range(b)), 8)
        key = f"tiny_fp32_fused_equals_plain_{'seeded' if sampled else 'greedy'}"
        result[key] = {f"B={b}": bool((codes[True][b] == codes[False][b]).all()) for b in tiny_buckets}
        print(json.dumps({key: result[key]}), flush=True)
    save()

    csm1b_exactness(result, 8, "csm1b_")
    save()
    # one row: the depth calls after the first take the one-row kernel (MLP_DOWN, BK_QKV), which 8 rows
    # never reach
    csm1b_exactness(result, 1, "csm1b_one_row_")


def csm1b_exactness(result: dict, rows: int, prefix: str) -> None:
    """csm-1b's checks at ``rows`` rows, into ``result`` under keys starting ``prefix``."""
    import kernels.stack_step as stack_kernel

    forced = None
    logits, hidden, codes, fell_back = {}, {}, {}, {}
    for dtype in (torch.float32, torch.bfloat16):
        for fused in (False, True):
            model = random_model(CSM_1B, dtype)
            if fused:
                model.pack_weights()
            runner = Runner(model, num_slots=rows, max_len=64, buckets=[rows], k_max=8,
                            max_repetition_window=16, use_graphs=False)
            prefill_all(runner, rows, False)
            if forced is None:  # the fp32 plain reference runs free; the rest follow its codes
                _, forced, _ = first_frame(runner)
            logits[dtype, fused], _, hidden[dtype, fused] = first_frame(runner, forced)
            codes[dtype, fused] = runner.decode(list(range(rows)), 8)[:, :, :-1]
            if fused:  # whether stack_step ran these calls or its latch handed them to the twin
                failure = stack_kernel.LATCH.failure
                fell_back[str(dtype).removeprefix("torch.")] = None if failure is None else repr(failure)
                stack_kernel.LATCH.reset()
            del model, runner
            torch.cuda.empty_cache()
    ref = (torch.float32, False)
    size = CsmConfig.from_dict(CSM_1B).codebook_size
    variants = {"fp32_fused": (torch.float32, True), "bf16_plain": (torch.bfloat16, False),
                "bf16_fused": (torch.bfloat16, True)}
    result[f"{prefix}first_frame_teacher_forced_vs_fp32_plain"] = {
        name: {"logits_rel_error": relative(logits[key], logits[ref]),
               "next_hidden_rel_error": relative(hidden[key], hidden[ref]),
               "argmax_mismatch": float((logits[key][..., :size].argmax(-1) != forced).double().mean())}
        for name, key in variants.items()}
    result[f"{prefix}stack_step_latch_failure"] = fell_back  # None: the kernel ran every fused call
    mismatch = lambda a, b: float((codes[a] != codes[b]).mean())  # noqa: E731
    result[f"{prefix}free_running_code_mismatch_8_frames_{rows}_rows"] = {
        "fp32_fused_vs_fp32_plain": mismatch((torch.float32, True), ref),
        "bf16_fused_vs_bf16_plain": mismatch((torch.bfloat16, True), (torch.bfloat16, False)),
        "bf16_plain_vs_fp32_plain": mismatch((torch.bfloat16, False), ref)}
    print(json.dumps({k: v for k, v in result.items() if k.startswith(prefix)}), flush=True)
