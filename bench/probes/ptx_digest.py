"""One sha256 of the PTX a talker kernel compiles to for an H200 (sm_90), per specialisation the talker's
runner launches, on any machine (CPU is enough): meta tensors go through the JIT's own specialisation
(``create_function_from_signature``, as ``JITFunction.run`` binds a launch), so each digest is that of
the program the GPU would run. A change that keeps every digest keeps the device code. Which calls take
the kernels, and at which tunings, is the model's (``models.csm.frame_fused.DEFAULT_SETTINGS``).

    TRITON_DISABLE_LINE_INFO=1 python -m bench.probes.ptx_digest [--out FILE.json] [--only TEXT]

Line info is off because Triton embeds source paths and line numbers in the PTX. The specialisations:
for csm-1b and voxring-tiny in fp32, bf16 and fp16,

* ``stack_step``'s one launch for every depth call a bucket of the runner (1, 2, 4, .., 64) sends it
  (calls of at most 16 rows): the first call of 2 B rows (the backbone state and codebook 0's embedding,
  times the projector), the later calls of B rows from the projected tables, and (``gather``, the frames
  without projected tables) the embedding rows times the projector; the depth tuning, the depth stack
  with the mlp rows as ``pack_weights`` lays them out, and without;
* ``stack_layers``' launches for the backbone steps that take it (one row), at the backbone's tuning,
  without the mlp rows (the default) and with;
* decode attention (the backbone's steps and the depth calls past 16 rows), rope_kv, silu_mul, rms_norm
  (with and without a residual) and the sampler at the shapes of their calls in the fused frame.

Writes {key: sha256} as JSON (sorted keys). ``--only``: the keys containing TEXT.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":
    sys.exit("ptx_digest compiles for the GPU: run it without TRITON_INTERPRET=1")
if os.environ.get("TRITON_DISABLE_LINE_INFO") != "1":
    sys.exit("ptx_digest: set TRITON_DISABLE_LINE_INFO=1 (the PTX would carry source paths and lines)")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile, make_backend
from triton.runtime.jit import create_function_from_signature

from bench.talker.gpu import CSM_1B
from kernels import decode_attention, rms_norm, rope_kv, sampler, silu_mul
from kernels import stack_step as ss
from models.csm.config import CsmConfig
from models.csm.frame_fused import DEFAULT_SETTINGS
from models.tiny.talker import tiny_config

TARGET = GPUTarget("cuda", 90, 32)
SMS = 132  # the H200's: one program per SM
BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # the talker's default buckets (services/talker/config.py)
SETTINGS = DEFAULT_SETTINGS  # the talker's fused frame: which calls take the kernel, at which tunings
STACK_ROWS = SETTINGS.stack_step_rows  # depth calls of at most this many rows take stack_step
WINDOW = 64  # the engine's max_repetition_window: the history's width
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MODELS = {"csm-1b": CSM_1B, "tiny": tiny_config()}
Case = tuple[str, object, tuple, dict]  # key, the @triton.jit function, its launch's args and kwargs


def meta(*size: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*size, dtype=dtype, device="meta")


def stack_weights(cfg, dtype: torch.dtype, mlp_rows: bool) -> ss.StackWeights:
    """A stack as ``Transformer.pack_weights`` lays it out (gate_up a view of the mlp rows where they are)."""
    layers, h, inter = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    mlp = meta(layers, 3 * inter, h, dtype=dtype)
    weights = ss.StackWeights(
        qkv=meta(layers, (hq + 2 * hkv) * d, h, dtype=dtype), o=meta(layers, h, hq * d, dtype=dtype),
        gate_up=mlp[:, : 2 * inter] if mlp_rows else meta(layers, 2 * inter, h, dtype=dtype),
        down=meta(layers, h, inter, dtype=dtype), input_norm=meta(layers, h, dtype=dtype),
        post_norm=meta(layers, h, dtype=dtype), final_norm=meta(h, dtype=dtype),
        cos=meta(cfg.max_position_embeddings, d, dtype=torch.float32),
        sin=meta(cfg.max_position_embeddings, d, dtype=torch.float32),
        num_q_heads=hq, num_kv_heads=hkv, head_dim=d, eps=cfg.rms_norm_eps, mlp=mlp if mlp_rows else None)
    return weights


def cache(cfg, slots: int, max_len: int, dtype: torch.dtype) -> torch.Tensor:
    return meta(cfg.num_layers, slots, max_len, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)


def index(rows: int) -> torch.Tensor:
    return meta(rows, dtype=torch.int64)


def one_launch(key: str, plan: tuple, num_layers: int) -> Iterator[Case]:
    """stack_step's one launch (``stack_step_triton``, not phased)."""
    args, static, _, _, _ = plan
    launch = (1, 0, num_layers, ss.ALL_LAYER_PHASES, ss.ALL_LAYER_PHASES, 0, 1)
    yield key, ss._stack_step_kernel, (*args, *launch), dict(SYNC=True, **static)


def layers_launches(key: str, plan: tuple, num_layers: int) -> Iterator[Case]:
    """stack_layers' launches (``stack_layers_triton``, not phased), as launch0 .. launchL."""
    args, static, _, _, tune = plan
    after = sum(p for p in ss.layer_phases(tune, static["MLP_DOWN"]) if p not in (ss.QKV, ss.ATT))
    last = num_layers - 1
    launches = [(0, 1, ss.QKV, ss.QKV, ss.QKV, 0)]
    launches += [(layer, layer + 2, after, ss.QKV, ss.QKV, 0) for layer in range(last)]
    launches += [(last, last + 1, after, after, 0, 1)]
    for i, launch in enumerate(launches):
        yield f"{key}/launch{i}", ss._stack_step_kernel, (*args, 0, *launch), dict(SYNC=True, **static)


def stack_cases(name: str, config: CsmConfig, dtype_name: str) -> Iterator[Case]:
    dtype = DTYPES[dtype_name]
    depth, backbone, n = config.depth, config.backbone, config.num_codebooks
    vocab, head_rows = config.audio_vocab_size, -(-config.audio_vocab_size // 8) * 8
    head = meta(head_rows, depth.hidden_size, dtype=dtype)
    proj = meta(depth.hidden_size, backbone.hidden_size, dtype=dtype)
    depth_cache = cache(depth, BUCKETS[-1], n, dtype)
    for mlp_rows in (True, False):
        weights = stack_weights(depth, dtype, mlp_rows)
        mlp = "mlp_rows" if mlp_rows else "no_mlp_rows"
        calls = [("first", 2 * b, dict(src=meta(2 * b, backbone.hidden_size, dtype=dtype), proj=proj))
                 for b in BUCKETS if 2 * b <= STACK_ROWS]
        for b in (b for b in BUCKETS if b <= STACK_ROWS):
            codes = index(b)
            calls.append(("table", b, dict(src=meta(vocab, depth.hidden_size, dtype=dtype), codes=codes)))
            calls.append(("gather", b, dict(src=meta(vocab, backbone.hidden_size, dtype=dtype), codes=codes,
                                            proj=proj)))
        for way, rows, inputs in calls:
            plan = ss.launch_plan(weights, depth_cache, depth_cache, index(rows), index(rows), index(rows),
                                  **inputs, head=head, num_programs=SMS, compiled=True,
                                  tuning=SETTINGS.depth_tuning)
            key = f"stack_step/{name}/{dtype_name}/depth_{way}/rows={rows}/{mlp}"
            yield from one_launch(key, plan, depth.num_layers)
    backbone_cache = cache(backbone, BUCKETS[-1] + 1, config.max_len, dtype)
    width = backbone.num_heads * backbone.head_dim
    for mlp_rows in (False, True):
        weights = stack_weights(backbone, dtype, mlp_rows)
        for b in (b for b in BUCKETS if b <= SETTINGS.backbone_stack_rows):
            x, q, attn = (meta(b, w, dtype=dtype) for w in (backbone.hidden_size, width, width))
            plan = ss.launch_plan(weights, backbone_cache, backbone_cache, index(b), index(b), index(b), x=x,
                                  num_programs=SMS, compiled=True, tuning=SETTINGS.backbone_tuning, q=q,
                                  attn=attn)
            mlp = "mlp_rows" if mlp_rows else "no_mlp_rows"
            yield from layers_launches(f"stack_layers/{name}/{dtype_name}/backbone/rows={b}/{mlp}", plan,
                                       backbone.num_layers)


def attention_cases(name: str, config: CsmConfig, dtype_name: str) -> Iterator[Case]:
    """decode_attention_triton's launches: the backbone's steps (every bucket) and the depth calls that
    take forward_rows (more than STACK_ROWS rows: the first call of 2 B rows, the later ones of B)."""
    dtype = DTYPES[dtype_name]
    stacks = [("backbone", config.backbone, BUCKETS[-1] + 1, config.max_len, BUCKETS)]
    depth_rows = sorted({r for b in BUCKETS for r in (2 * b, b) if r > STACK_ROWS})
    stacks.append(("depth", config.depth, BUCKETS[-1], config.num_codebooks, depth_rows))
    for stack, cfg, slots, max_len, batches in stacks:
        hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        layer_cache = cache(cfg, slots, max_len, dtype)[0]
        for batch in batches:
            q = meta(batch, hq, d, dtype=dtype)
            block_n = 64 if dtype != torch.float32 else 32 if d <= 64 else 16
            block_n = min(block_n, max(16, triton.next_power_of_2(max_len)))
            splits = decode_attention.choose_num_splits(batch, hkv, max_len, SMS)
            group, block_d = hq // hkv, max(16, triton.next_power_of_2(d))
            acc = q if splits == 1 else meta(batch, hq, splits, d, dtype=torch.float32)
            row_max = q if splits == 1 else meta(batch, hq, splits, dtype=torch.float32)
            args = (q, q.stride(0), q.stride(1), layer_cache, *layer_cache.stride()[:3], layer_cache,
                    *layer_cache.stride()[:3], index(batch), index(batch), acc, q.stride(0), q.stride(1),
                    row_max, row_max, d**-0.5, max_len, hq)
            kwargs = dict(GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=d,
                          BLOCK_D=block_d, BLOCK_N=block_n, NUM_SPLITS=splits,
                          num_warps=8 if dtype == torch.float32 and d > 64 else 4, UPCAST=False)
            key = f"decode_attention/{name}/{dtype_name}/{stack}/rows={batch}"
            yield f"{key}/split", decode_attention._split_kernel, args, kwargs
            if splits > 1:
                args = (acc, row_max, row_max, q, q.stride(0), q.stride(1), hq)
                kwargs = dict(HEAD_DIM=d, BLOCK_D=block_d, NUM_SPLITS=splits,
                              SPLITS_PAD=triton.next_power_of_2(splits), num_warps=1 if block_d <= 64 else 2)
                yield f"{key}/combine", decode_attention._combine_kernel, args, kwargs


def layer_op_cases(name: str, config: CsmConfig, dtype_name: str) -> Iterator[Case]:
    """rope_kv, silu_mul and rms_norm as forward_rows launches them (the rows are the grid: one shape)."""
    dtype = DTYPES[dtype_name]
    for stack, cfg, slots, max_len in (("backbone", config.backbone, BUCKETS[-1] + 1, config.max_len),
                                       ("depth", config.depth, BUCKETS[-1], config.num_codebooks)):
        h, inter, hq, hkv, d = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                                cfg.head_dim)
        rows, key = 32, f"{name}/{dtype_name}/{stack}"
        width = (hq + 2 * hkv) * d
        qkv, q = meta(rows, width, dtype=dtype), meta(rows, hq, d, dtype=dtype)
        table = meta(cfg.max_position_embeddings, d, dtype=torch.float32)
        layer_cache = cache(cfg, slots, max_len, dtype)[0]
        heads_pad, half_pad = triton.next_power_of_2(hq + 2 * hkv), max(16, triton.next_power_of_2(d // 2))
        args = (qkv, width, table, table, d, index(rows), index(rows), q, hq * d, d, layer_cache,
                *layer_cache.stride()[:3], layer_cache, *layer_cache.stride()[:3])
        kwargs = dict(NUM_Q=hq, NUM_KV=hkv, HALF=d // 2, HEADS_PAD=heads_pad, HALF_PAD=half_pad, OPAQUE=True,
                      num_warps=4 if heads_pad * half_pad <= 4096 else 8)
        yield f"rope_kv/{key}", rope_kv._rope_kv_kernel, args, kwargs
        gate_up, act = meta(rows, 2 * inter, dtype=dtype), meta(rows, inter, dtype=dtype)
        kwargs = dict(BLOCK=min(1024, max(16, triton.next_power_of_2(inter))), LIBDEVICE=True, num_warps=4)
        yield f"silu_mul/{key}", silu_mul._silu_mul_kernel, (gate_up, 2 * inter, act, inter, inter), kwargs
        x, weight = meta(rows, h, dtype=dtype), meta(h, dtype=dtype)
        block = max(16, triton.next_power_of_2(h))
        for residual in (True, False):
            args = (x, h, x, h, weight, x, h, x, h, h, cfg.rms_norm_eps)
            kwargs = dict(HAS_RESIDUAL=residual, BLOCK=block, num_warps=min(16, max(1, block // 512)))
            yield (f"rms_norm/{key}/{'residual' if residual else 'no_residual'}", rms_norm._rms_norm_kernel,
                   args, kwargs)


def sampler_cases(name: str, config: CsmConfig, dtype_name: str) -> Iterator[Case]:
    """The sampler's launches: codebook 0's logits [B, V] and the depth heads' [B, V_pad][:, :V], each
    with the history's codebook column [B, W] of [B, N, W]."""
    dtype = DTYPES[dtype_name]
    vocab, padded = config.audio_vocab_size, -(-config.audio_vocab_size // 8) * 8
    block = max(16, triton.next_power_of_2(vocab))
    for batch in BUCKETS:
        history = meta(batch, config.num_codebooks, WINDOW, dtype=torch.int64)[:, 1, :]
        floats, ints = meta(batch, dtype=torch.float32), index(batch)
        for head, stride in (("lm_head", vocab), ("depth_head", padded)):
            logits = meta(batch, stride, dtype=dtype)[:, :vocab]
            args = (logits, logits.stride(0), history, history.stride(0), history.stride(1), WINDOW, floats,
                    ints, floats, floats, ints, ints, ints, None, ints, 1, config.codebook_size, vocab)
            kwargs = dict(BLOCK=block, WRITE_X=False, LIBDEVICE=True, num_warps=4 if block <= 1024 else 8)
            yield f"sampler/{name}/{dtype_name}/{head}/rows={batch}", sampler._sampler_kernel, args, kwargs


def cases() -> Iterator[Case]:
    for name, raw in MODELS.items():
        config = CsmConfig.from_dict(raw)
        for dtype_name in DTYPES:
            for make in (stack_cases, attention_cases, layer_op_cases, sampler_cases):
                yield from make(name, config, dtype_name)


def ptx(fn, args: tuple, kwargs: dict, compiled: dict) -> str:
    """The PTX of fn's launch with ``args`` and ``kwargs``, bound and specialised as the JIT does
    (``JITFunction.run``); ``compiled`` keeps each specialisation's PTX."""
    backend = make_backend(TARGET)
    kwargs = dict(kwargs, debug=bool(fn.debug) or triton.knobs.runtime.debug,
                  instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    spec = repr((fn.__name__, signature, sorted(constexprs.items(), key=str), sorted(attrs.items(), key=str),
                 sorted(options.__dict__.items())))
    if spec not in compiled:
        kernel = compile(ASTSource(fn, signature, constexprs, attrs), target=TARGET, options=options.__dict__)
        compiled[spec] = kernel.asm["ptx"]
    return compiled[spec]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("bench/results/probes/stack_step_ptx.json"))
    parser.add_argument("--only", default="", help="the keys containing this text")
    args = parser.parse_args()
    digests, compiled = {}, {}
    for key, fn, launch_args, kwargs in cases():
        if args.only in key:
            digests[key] = hashlib.sha256(ptx(fn, launch_args, kwargs, compiled).encode()).hexdigest()
            print(f"{key} {digests[key][:16]}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(sorted(digests.items())), indent=1) + "\n")
    print(f"{len(digests)} digests, {len(compiled)} specialisations compiled: {args.out}")


if __name__ == "__main__":
    main()
