"""The tiny talker's fused frame (``pack_weights``: the packed weights, ``frame_fused``) against its plain
one (``frame_plain``) through the Runner, with the kernels' twins and, on a CPU machine under Triton's
interpreter, with the kernels: codes, logits and the next state; the projected depth inputs and the
depth stack's mlp rows; which calls take stack_step, stack_layers or forward_rows."""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import numpy as np
import pytest
import torch

import kernels
from kernels.latch import KernelLatch
from kernels.sampler_twin import SamplingParams
from models.csm.config import CsmConfig
from models.csm.frame_fused import FusedFrame, FusedSettings
from models.csm.model import CsmTalker
from models.family import FrameInputs, FrameOutputs, PromptSegment
from models.tiny.talker import tiny_config
from services.common.sampling import Sampling
from services.talker.runner import PrefillRow, Runner
from tests.unit.fused_layer_support import (
    DEVICE,
    KERNEL_MODULES,
    new_latches,
    relative_error,
)


def tiny_talker() -> CsmTalker:
    """voxring-tiny's architecture in fp32 on the CPU with fresh seeded weights (no checkpoint file)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = CsmTalker(CsmConfig.from_dict(tiny_config())).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.normal_(0, 1 / p.shape[-1] ** 0.5 if "embed" not in name else 1.0)
    return model


def plain_and_fused(device: str = "cpu") -> tuple[CsmTalker, CsmTalker]:
    """Two copies of one tiny talker on ``device``: plain, and packed (``pack_weights`` after the move)."""
    plain = tiny_talker()
    fused = copy.deepcopy(plain).to(device)
    fused.pack_weights()
    plain = plain.to(device)
    assert not plain.fused and fused.fused
    return plain, fused


def prompt(slot: int) -> list[PromptSegment]:
    """A different text for each slot: its own length (rows stand at different positions) and last token."""
    return [PromptSegment([256, *((37 * slot + 11 * i + 5) % 256 for i in range(3 + 2 * slot))])]


def greedy(slot: int) -> Sampling:
    return Sampling()


def seeded(slot: int) -> Sampling:
    return Sampling(temperature=0.9, top_k=20, top_p=0.95, seed=7 + slot)


def make_runner(model: CsmTalker, buckets=(1, 2, 4), use_graphs: bool = False) -> Runner:
    return Runner(model, num_slots=8, max_len=64, buckets=list(buckets), k_max=4, max_repetition_window=4,
                  use_graphs=use_graphs)


@dataclass
class Decoded:
    """What k frames of slots 0 .. rows - 1 leave behind: the codes (int32 [k, rows, N + 1], codes
    then stop flag) and the state the next step would read: the backbone's hidden state, its KV
    cache rows and the depth decoder's (frame scratch of the last frame)."""

    codes: np.ndarray
    state: dict[str, torch.Tensor]

    def assert_matches(self, plain: Decoded) -> None:
        """Codes equal; the state within fp32 reduction-order noise. The tiny random model's greedy
        codes hardly depend on attention (a wrong rotation or key count can leave them unchanged),
        its state does."""
        assert self.codes.shape == plain.codes.shape
        assert (self.codes == plain.codes).all(), (self.codes, plain.codes)
        for name, value in self.state.items():
            assert relative_error(value, plain.state[name]) < 1e-5, name


def decode(runner: Runner, rows: int, k: int, sampling: Callable[[int], Sampling] = greedy) -> Decoded:
    """Prefills slots 0 .. rows - 1 and decodes k frames of them."""
    runner.prefill([PrefillRow.whole(slot, runner.model.pack_prompt(prompt(slot)), sampling(slot))
                    for slot in range(rows)])
    codes = runner.decode(list(range(rows)), k)
    caches = runner.caches
    state = {"hidden": runner.pool.hidden[:rows], "backbone.k": caches.backbone.k[:, :rows],
             "backbone.v": caches.backbone.v[:, :rows], "depth.k": caches.depth.k[:, :rows],
             "depth.v": caches.depth.v[:, :rows]}
    return Decoded(codes, {name: value.detach().clone().cpu() for name, value in state.items()})


def first_frame(model: CsmTalker, rows: int) -> FrameOutputs:
    """decode_frame with logits for slots 0 .. rows - 1 straight after prefill (no runner padding)."""
    runner = make_runner(model)
    runner.prefill([PrefillRow.whole(slot, model.pack_prompt(prompt(slot)), greedy(slot))
                    for slot in range(rows)])
    pool, slots = runner.pool, torch.arange(rows, device=runner.device)
    sampling = SamplingParams(**{f.name: getattr(pool.sampling, f.name)[slots]
                                 for f in fields(SamplingParams)})
    inputs = FrameInputs(hidden=pool.hidden[slots], slots=slots, positions=pool.positions[slots],
                         frame_index=pool.frame_index[slots], min_frames=pool.min_frames[slots],
                         sampling=sampling, history=pool.history[slots])
    with torch.inference_mode():
        return model.decode_frame(inputs, runner.caches, return_logits=True)


def assert_frames_match(fused: FrameOutputs, plain: FrameOutputs) -> None:
    assert torch.equal(fused.codes, plain.codes) and torch.equal(fused.stop, plain.stop)
    assert relative_error(fused.logits, plain.logits) < 1e-5
    assert relative_error(fused.hidden, plain.hidden) < 1e-5
    assert torch.equal(fused.history, plain.history)


@pytest.fixture(scope="module")
def talkers() -> tuple[CsmTalker, CsmTalker]:
    return plain_and_fused()


@pytest.fixture
def fresh_latches(monkeypatch) -> dict[str, KernelLatch]:
    """A new latch for each kernel of the package, so no test leaves one tripped or switched off."""
    return new_latches(monkeypatch)


@pytest.fixture
def on_the_kernels(fresh_latches, monkeypatch) -> Counter:
    """The fused path's drop-ins (the fused-layer kernels, stack_step among them, and decode
    attention; the sampler stays on its twin) send CPU tensors to their kernels, the interpreter
    here; counts each launcher's calls. After the test: no latch tripped."""
    launches: Counter = Counter()
    for name in (*kernels.FUSED_LAYER_KERNELS, "decode_attention"):
        module = KERNEL_MODULES[name]
        monkeypatch.setattr(module, "kernel_device", lambda tensor: True)
        for launcher in [attr for attr in vars(module) if attr.endswith("_triton")]:
            real = getattr(module, launcher)

            def counted(*args, _real=real, _name=launcher, **kwargs):
                launches[_name] += 1
                return _real(*args, **kwargs)

            monkeypatch.setattr(module, launcher, counted)
    yield launches
    tripped = {name: latch.failure for name, latch in fresh_latches.items() if latch.failure is not None}
    assert not tripped, f"latches tripped: {tripped}"


# One frame of the tiny talker: the backbone's 4 layers through forward_rows (a layer: two norms, one
# rope_attention (its rows own their slots), one silu_mul; the stack's final norm), or for buckets of at
# most ``backbone_stack_rows`` rows (the fused frame's settings; 1 by default) in one stack_layers call; and
# the depth decoder's 7 calls (the first two positions together, then one per codebook 2 .. 7): each one
# stack_step, or, for calls of more rows than ``stack_step_rows``, forward_rows through its 2 layers (the
# first call's two rows a slot with rope_kv and decode attention, the later calls' with rope_attention). A
# bucket of b rows makes a first call of 2 b rows and six calls of b rows. The tiny model's buckets (1, 2,
# 4) all fit the default depth limit (16), so the tests that need both paths set both limits to 2
# (``limit_2``). stack_layers calls decode attention's launcher once a layer (counted too: it calls it
# through kernels.decode_attention, whose launcher the fixture wraps).
BACKBONE_LAYERS_PER_FRAME = 4
DEPTH_CALLS_PER_FRAME = 7
DEPTH_LAYERS = 2


def stack_calls(bucket: int, settings: FusedSettings) -> int:
    """Depth calls per frame that take stack_step for a bucket of ``bucket`` rows."""
    limit = settings.stack_step_rows
    return (2 * bucket <= limit) + (DEPTH_CALLS_PER_FRAME - 1) * (bucket <= limit)


def prefill_launches(calls: int) -> Counter:
    """The launches of ``calls`` prefill calls on the packed backbone (``forward_chunks``): per layer two
    norms, one rope_kv (rows of one prompt share its slot), one silu_mul; the stack's final norm.
    Prefill attention has its own switch (not a fused-layer kernel) and stays on its twin here."""
    layers = calls * BACKBONE_LAYERS_PER_FRAME
    return Counter({"rms_norm_triton": 2 * layers + calls, "rope_kv_triton": layers,
                    "silu_mul_triton": layers})


def assert_frames_ran_on_the_kernels(launches: Counter, frames: int, bucket: int,
                                     settings: FusedSettings, prefills: int = 1) -> None:
    """One prefill call (``decode``, ``first_frame``) and ``frames`` frames of a ``bucket`` launched
    exactly these kernels."""
    stack = stack_calls(bucket, settings)
    row_calls = DEPTH_CALLS_PER_FRAME - stack  # depth calls through forward_rows, per frame
    first_rows = 2 * bucket > settings.stack_step_rows  # the first depth call (two rows a slot) among them
    backbone_rows = bucket > settings.backbone_stack_rows  # the backbone through forward_rows
    layers = frames * (BACKBONE_LAYERS_PER_FRAME * backbone_rows + DEPTH_LAYERS * row_calls)
    shared = frames * DEPTH_LAYERS * first_rows  # layers whose rows share slots: rope_kv + decode attention
    want = Counter({"rms_norm_triton": 2 * layers + frames * (backbone_rows + row_calls),
                    "rope_kv_triton": shared, "rope_attention_triton": layers - shared,
                    "decode_attention_triton": shared + (
                        frames * BACKBONE_LAYERS_PER_FRAME * (not backbone_rows)),
                    "silu_mul_triton": layers, "stack_step_triton": frames * stack,
                    "stack_layers_triton": frames * (not backbone_rows)})
    assert launches == want + prefill_launches(prefills)


@pytest.fixture
def limit_2(talkers, monkeypatch) -> None:
    """Depth calls of more than 2 rows take forward_rows: buckets 1, 2 and 4 then take stack_step
    for all, some and none of their depth calls; and backbone steps of up to 2 rows take stack_layers
    (buckets 1 and 2; bucket 4 forward_rows)."""
    fused = talkers[1]
    settings = replace(fused.frame.settings, stack_step_rows=2, backbone_stack_rows=2)
    monkeypatch.setattr(fused, "frame", FusedFrame(fused, settings))


@pytest.fixture(scope="module")
def plain_codes(talkers) -> dict[tuple[int, str], Decoded]:
    """The plain model's codes and state per (rows, sampling, K), computed once."""
    plain = talkers[0]
    cases = [(1, greedy, 2), (2, greedy, 2), (3, greedy, 2), (4, greedy, 2), (2, seeded, 2), (3, seeded, 2),
             (2, greedy, 1), (4, greedy, 1), (2, seeded, 1)]
    return {(rows, sampling.__name__, k): decode(make_runner(plain), rows, k, sampling)
            for rows, sampling, k in cases}


def test_plain_codes_tell_rows_and_frames_apart(plain_codes):
    # A fused path that mixed up rows, slots or positions must change these codes.
    codes = plain_codes[(4, "greedy", 2)].codes
    assert codes.shape == (2, 4, 9)
    assert len({tuple(row) for row in codes[0, :, :8].tolist()}) == 4
    assert not (codes[0] == codes[1]).all()
    assert not (plain_codes[(2, "seeded", 2)].codes == plain_codes[(2, "greedy", 2)].codes).all()  # sampled


@pytest.mark.parametrize("rows", [1, 2, 3, 4])  # every bucket of (1, 2, 4), and 3 rows padded to 4
def test_fused_frames_on_the_twins_equal_the_plain_model(talkers, plain_codes, rows: int):
    decode(make_runner(talkers[1]), rows, 2).assert_matches(plain_codes[(rows, "greedy", 2)])


def test_fused_seeded_sampling_on_the_twins_equals_the_plain_model(talkers, plain_codes):
    decode(make_runner(talkers[1]), 3, 2, seeded).assert_matches(plain_codes[(3, "seeded", 2)])


def test_fused_frame_logits_equal_the_plain_model(talkers):
    plain, fused = talkers
    assert_frames_match(first_frame(fused, 3), first_frame(plain, 3))


def test_projected_depth_inputs_are_each_codes_projected_embedding(talkers):
    # pack_weights projects codebooks 1 .. N-2's embedding tables once (depth calls 2 .. N-1 take those
    # codes): in float64, rounded once to the model's dtype.
    plain, fused = talkers
    depth = fused.depth_decoder.model
    n, vocab = fused.num_codebooks, fused.config.audio_vocab_size
    proj = depth.inputs_embeds_projector.weight
    tables = fused._depth_inputs
    assert tables.shape == (n - 2, vocab, proj.shape[0]) and tables.dtype == torch.float32
    for k in (1, n // 2, n - 2):
        rows = depth.embed_tokens.weight[k * vocab:(k + 1) * vocab]
        want = (rows.double() @ proj.double().T).float()  # not fp32 products: 2e-6 off
        torch.testing.assert_close(tables[k - 1], want, rtol=2.5e-7, atol=1e-9)
    half = copy.deepcopy(plain).to(torch.bfloat16)
    half.pack_weights()
    depth = half.depth_decoder.model
    rows = depth.embed_tokens.weight[(n - 2) * vocab:(n - 1) * vocab]
    want = (rows.double() @ depth.inputs_embeds_projector.weight.double().T).to(torch.bfloat16)
    assert half._depth_inputs.dtype == torch.bfloat16 and torch.equal(half._depth_inputs[n - 3], want)


def test_the_depth_stack_carries_downs_transpose_beside_gate_up(talkers):
    # pack_weights lays each depth layer's gate and up rows and then down's transpose in one tensor
    # (stack_step's MLP_DOWN streams them as one product); gate_up, the linears and forward_rows read
    # views of it; the backbone keeps no copy (backbone_mlp_rows is off: its steps take forward_rows).
    plain, fused = talkers
    depth, backbone = fused.depth_decoder.model, fused.backbone_model
    stack, inter = depth.stack, depth.cfg.intermediate_size
    assert stack.mlp is not None and stack.mlp.shape == (len(depth.layers), 3 * inter, depth.cfg.hidden_size)
    assert stack.gate_up.data_ptr() == stack.mlp.data_ptr() and stack.gate_up.shape[1] == 2 * inter
    for i, layer in enumerate(depth.layers):
        assert torch.equal(stack.mlp[i, 2 * inter:], layer.mlp.down_proj.weight.t())
        assert torch.equal(stack.mlp[i, :inter], plain.depth_decoder.model.layers[i].mlp.gate_proj.weight)
        assert layer.mlp.gate_up_weight.data_ptr() == stack.mlp[i].data_ptr()
        assert layer.mlp.up_proj.weight.data_ptr() == stack.mlp[i, inter:].data_ptr()
    assert backbone.stack.mlp is None


def test_fused_frames_read_the_projected_inputs_and_can_project_instead(talkers, plain_codes, monkeypatch):
    # The frames read the projected rows (zeroed rows change the codes), and with projected_inputs off
    # each depth call projects its embedding rows again, with the same codes.
    fused = talkers[1]
    monkeypatch.setattr(fused, "_depth_inputs", torch.zeros_like(fused._depth_inputs))
    assert not (decode(make_runner(fused), 2, 2).codes == plain_codes[(2, "greedy", 2)].codes).all()
    projecting = replace(fused.frame.settings, projected_inputs=False)
    monkeypatch.setattr(fused, "frame", FusedFrame(fused, projecting))
    decode(make_runner(fused), 2, 2).assert_matches(plain_codes[(2, "greedy", 2)])


# Under the interpreter a frame costs seconds (most in stack_step and stack_layers), so the frames that
# carry their state into a second one are those of one row (every call a stack_step, the backbone's
# stack_layers) and of a padded bucket 4 (every call forward_rows); the other paths take one frame.
interpreter_only = pytest.mark.skipif(DEVICE != "cpu", reason="on CUDA: tests/gpu/test_kernels_cuda.py")


@interpreter_only
# buckets 1 (every depth call a stack_step), 2 (both paths) and 4 (forward_rows; 3 rows padded)
@pytest.mark.parametrize(("rows", "k"), [(1, 2), (2, 1), (3, 2)])
def test_fused_frames_on_the_kernels_equal_the_plain_model(
    talkers, plain_codes, on_the_kernels, limit_2, rows: int, k: int
):
    settings = talkers[1].frame.settings
    assert [stack_calls(b, settings) for b in (1, 2, 4)] == [7, 6, 0]
    decode(make_runner(talkers[1]), rows, k).assert_matches(plain_codes[(rows, "greedy", k)])
    assert_frames_ran_on_the_kernels(on_the_kernels, k, 1 if rows == 1 else 2 if rows == 2 else 4, settings)


@interpreter_only
def test_fused_frames_at_the_default_limit_take_stack_step_for_every_depth_call(
    talkers, plain_codes, on_the_kernels
):
    # bucket 4: a first depth call of 8 rows, then six of 4, every one a stack_step launch
    settings = talkers[1].frame.settings
    assert settings.stack_step_rows == 16 and stack_calls(4, settings) == DEPTH_CALLS_PER_FRAME
    decode(make_runner(talkers[1]), 4, 1).assert_matches(plain_codes[(4, "greedy", 1)])
    assert_frames_ran_on_the_kernels(on_the_kernels, 1, 4, settings)


@interpreter_only
def test_fused_seeded_sampling_on_the_kernels_equals_the_plain_model(
    talkers, plain_codes, on_the_kernels, limit_2
):
    decode(make_runner(talkers[1]), 2, 1, seeded).assert_matches(plain_codes[(2, "seeded", 1)])
    assert_frames_ran_on_the_kernels(on_the_kernels, 1, 2, talkers[1].frame.settings)


@interpreter_only
def test_fused_frame_logits_on_the_kernels_equal_the_plain_model(talkers, on_the_kernels, limit_2):
    plain, fused = talkers
    want = first_frame(plain, 2)
    assert not on_the_kernels  # the plain path on the CPU never meets a kernel
    assert_frames_match(first_frame(fused, 2), want)
    assert_frames_ran_on_the_kernels(on_the_kernels, 1, 2, fused.frame.settings)
