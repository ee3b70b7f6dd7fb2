"""The talker as a real process (real gRPC, real rings, tiny model): codes equal the
eager generation API, max frames exact, cancel, queueing, backpressure per ring, a dead
consumer dropped by heartbeat, Submit's errors, a session's Append and Clear, and a clean
drain on SIGTERM that an open admission watch does not hold."""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from pathlib import Path

import grpc
import numpy as np
import pytest

from models.csm.loader import load_talker
from models.family import PromptSegment
from models.tiny.talker import build_tokenizer, ensure_tiny_checkpoint
from services.talker.generate import GenerationRequest, Sampling, generate
from services.transport import TransportSection
from services.transport.layout import FinishReason
from tests.conftest import StageGroup
from tests.talker_client import RingReader, stats, submit_request, wait_for
from voxring.v1 import talker_pb2, talker_pb2_grpc

MAX_LEN = 256
CONFIG = """\
server: {{listen: 'unix:{dir}/talker.sock', drain_timeout: 10, grace: 1}}
engine: {{k_max: 4, buckets: [1, 2, 4], max_num_seqs: 4, max_len: {max_len}, max_waiting: 6,
          max_pending_frames: 8, stall_timeout: 30, admission_by_slack: false}}
transport: {{liveness_timeout: {liveness}, heartbeat_interval: 0.05, capacity_bytes: 4096}}
"""
LIVENESS_S = TransportSection().liveness_timeout  # the default: a loaded CPU trips sub-second ones


@pytest.fixture(scope="module")
def cache_dir(model_cache):
    ensure_tiny_checkpoint(root=model_cache / "models")  # made once, before any timed start
    return model_cache


@pytest.fixture
def talker(start_stage, sock_dir, cache_dir):
    """A talker started for this test alone: for the tests whose admissions depend on a talker
    that has not measured a step yet, that stop it, or that let a consumer die."""
    svc = start_stage("talker", CONFIG.format(dir=sock_dir, max_len=MAX_LEN, liveness=LIVENESS_S))
    channel = grpc.insecure_channel(svc.address)
    readers: list[RingReader] = []
    yield svc, talker_pb2_grpc.TalkerStub(channel), readers
    for reader in readers:
        reader.close()
    channel.close()


@pytest.fixture(scope="module")
def module_talker(cache_dir):
    """One talker for the module's tests that leave it as they found it and submit only while a
    slot is free (so no admission estimate decides): each ends, cancels or drains every request it
    submits, under a consumer id of its own (a talker start of ~3 s saved per test)."""
    folder = Path(tempfile.mkdtemp(prefix="vx-", dir="/tmp"))  # unix socket paths are bounded
    os.chmod(folder, 0o700)
    group = StageGroup(folder)
    try:
        svc = group.start("talker", CONFIG.format(dir=folder, max_len=MAX_LEN, liveness=LIVENESS_S))
        channel = grpc.insecure_channel(svc.address)
        yield svc, talker_pb2_grpc.TalkerStub(channel)
        channel.close()
    finally:
        group.close(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def shared_talker(module_talker):
    """The module's talker, as a test of its own would find it: alive, idle (no request running,
    waiting or paused, every slot free); the test's readers are closed after it."""
    svc, stub = module_talker
    assert svc.alive()
    wait_for(lambda: stats(stub).free_slots == 4, what="the last test's slots freed")
    idle = stats(stub)
    assert (idle.running, idle.waiting, idle.paused_rows) == (0, 0, 0), idle
    readers: list[RingReader] = []
    yield svc, stub, readers
    for reader in readers:
        reader.close()


def ids(text: str) -> list[int]:
    return build_tokenizer().encode(text).ids


def check_model_info(stub) -> None:
    info = stub.ModelInfo(talker_pb2.ModelInfoRequest(), timeout=10)
    assert info.model_name == "voxring-tiny" and info.num_codebooks == 8 and info.codebook_size == 64
    assert info.max_len == MAX_LEN and info.sample_rate == 24000 and info.frame_rate == 12.5
    assert b"<|begin_of_text|>" in info.tokenizer_json
    assert info.prompt_format == "<|begin_of_text|>[{speaker}]{text}<|end_of_text|>"


def test_codes_equal_the_eager_generation_api(shared_talker, cache_dir):
    _, stub, readers = shared_talker
    reader = RingReader(stub, "c2w-a")
    readers.append(reader)
    prompt = ids("[0]The service and the eager API agree.")
    stub.Submit(submit_request("c2w-a", 1, prompt, max_frames=20), timeout=10)
    stub.Submit(submit_request("c2w-a", 2, prompt, max_frames=20, temperature=0.9, top_k=20, seed=99),
                timeout=10)
    reader.wait([1, 2])
    model = load_talker(ensure_tiny_checkpoint(root=cache_dir / "models"))
    for handle, sampling in ((1, Sampling()), (2, Sampling(temperature=0.9, top_k=20, seed=99))):
        codes, finish, _ = reader.result(handle)
        expected = generate(model, [GenerationRequest([PromptSegment(prompt)], 20, sampling=sampling)],
                            cache_len=MAX_LEN)[0]
        # Requests 1 and 2 ran in one batch (bucket 2) and each alone in the eager API:
        # equal codes show batch-row independence too (the sampler is positional).
        assert finish == FinishReason.LENGTH and len(codes) == 20
        np.testing.assert_array_equal(codes, expected.codes.numpy())


def test_more_requests_than_slots_queue_and_complete(talker):
    _, stub, readers = talker
    reader = RingReader(stub, "c2w-q")
    readers.append(reader)
    answers = [stub.Submit(submit_request("c2w-q", h, ids(f"[1]Request {h}."), max_frames=60 + h),
                           timeout=10) for h in range(6)]
    assert {a.admission for a in answers} == {talker_pb2.SubmitResponse.ADMISSION_ADMITTED,
                                              talker_pb2.SubmitResponse.ADMISSION_QUEUED}
    reader.wait(range(6))
    for h in range(6):
        codes, finish, _ = reader.result(h)
        assert finish == FinishReason.LENGTH and len(codes) == 60 + h  # max frames exactly
    wait_for(lambda: stats(stub).free_slots == 4, what="all slots free")


def test_cancel_frees_the_slot_and_writes_cancelled(shared_talker):
    _, stub, readers = shared_talker
    reader = RingReader(stub, "c2w-c")
    readers.append(reader)
    stub.Submit(submit_request("c2w-c", 7, ids("[0]Cancel me."), max_frames=200), timeout=10)
    wait_for(lambda: reader.records.get(7), what="first record")
    assert stub.Cancel(talker_pb2.CancelRequest(consumer_id="c2w-c", handle=7), timeout=10).found
    reader.wait([7])
    _, finish, records = reader.result(7)
    assert records[-1].cancelled and finish == FinishReason.CANCELLED
    assert not stub.Cancel(talker_pb2.CancelRequest(consumer_id="c2w-c", handle=7), timeout=10).found
    wait_for(lambda: stats(stub).free_slots == 4, what="slot freed")


def test_full_ring_pauses_only_its_rows(shared_talker):
    _, stub, readers = shared_talker
    slow, fast = RingReader(stub, "c2w-slow"), RingReader(stub, "c2w-fast")
    readers += [slow, fast]
    slow.reading.clear()  # alive (heartbeats) but not reading: its small ring fills up
    stub.Submit(submit_request("c2w-slow", 1, ids("[0]Slow."), max_frames=240), timeout=10)
    wait_for(lambda: stats(stub).paused_rows == 1, what="the slow row paused")
    stub.Submit(submit_request("c2w-fast", 2, ids("[1]Fast."), max_frames=40), timeout=10)
    fast.wait([2], timeout=30)
    assert len(fast.result(2)[0]) == 40
    assert stats(stub).paused_rows == 1  # still paused while the fast one completed
    slow.reading.set()
    wait_for(lambda: stats(stub).paused_rows == 0, what="the slow row resumed")
    stub.Cancel(talker_pb2.CancelRequest(consumer_id="c2w-slow", handle=1), timeout=10)
    slow.wait([1])


def test_dead_consumer_is_detected_and_its_rows_dropped(talker):
    _, stub, readers = talker
    reader = RingReader(stub, "c2w-dead")
    readers.append(reader)
    stub.Submit(submit_request("c2w-dead", 3, ids("[0]Orphan."), max_frames=240), timeout=10)
    wait_for(lambda: stats(stub).running == 1, what="running")
    reader.die()
    # a bound, not an expectation: how soon is the benchmarks' business
    wait_for(lambda: stats(stub).running == 0 and stats(stub).free_slots == 4, timeout=10 * LIVENESS_S + 20,
             what="rows of the dead consumer dropped")
    with pytest.raises(grpc.RpcError) as info:  # its ring is gone until it attaches again
        stub.Submit(submit_request("c2w-dead", 4, ids("[0]x"), max_frames=2), timeout=10)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


def test_model_info_and_submit_errors(talker):
    """One talker (a start saved) for what reads or refuses and changes nothing."""
    _, stub, readers = talker
    check_model_info(stub)
    reader = RingReader(stub, "c2w-e")
    readers.append(reader)
    cases = [
        (submit_request("c2w-e", 1, ids("[0]Too long."), max_frames=MAX_LEN),
         grpc.StatusCode.INVALID_ARGUMENT, "max_frames"),
        (submit_request("nobody", 1, ids("[0]x"), max_frames=2), grpc.StatusCode.FAILED_PRECONDITION,
         "consumer_id"),
        (submit_request("c2w-e", 1, [9999], max_frames=2), grpc.StatusCode.INVALID_ARGUMENT,
         "segments[0].text_token_ids"),
        (submit_request("c2w-e", 1, ids("[0]x"), max_frames=2, temperature=-1.0),
         grpc.StatusCode.INVALID_ARGUMENT, "sampling.temperature"),
    ]
    for request, code, field in cases:
        with pytest.raises(grpc.RpcError) as info:
            stub.Submit(request, timeout=10)
        assert info.value.code() == code and info.value.details().startswith(field), info.value.details()
    reader.reading.clear()  # rows stay running (paused on the full ring)
    for h in range(10, 14):
        stub.Submit(submit_request("c2w-e", h, ids("[0]Fill."), max_frames=200), timeout=10)
    wait_for(lambda: stats(stub).running == 4, what="four running")
    for h in range(14, 20):  # max_waiting is 6
        stub.Submit(submit_request("c2w-e", h, ids("[0]Wait."), max_frames=200), timeout=10)
    with pytest.raises(grpc.RpcError) as info:
        stub.Submit(submit_request("c2w-e", 20, ids("[0]One too many."), max_frames=200), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as info:  # a handle in flight twice
        stub.Submit(submit_request("c2w-e", 19, ids("[0]Same handle."), max_frames=2), timeout=10)
    assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    for h in range(10, 20):
        stub.Cancel(talker_pb2.CancelRequest(consumer_id="c2w-e", handle=h), timeout=10)
    reader.reading.set()
    reader.wait(range(10, 20))


def test_sigterm_drains_running_requests_then_unlinks_rings(talker):
    svc, stub, readers = talker
    reader = RingReader(stub, "c2w-d")
    readers.append(reader)
    watch = stub.WatchAdmission(talker_pb2.WatchAdmissionRequest(), timeout=60)
    assert next(watch).refusal == ""  # the verdict at once: admitting
    stub.Submit(submit_request("c2w-d", 1, ids("[0]Finish during the drain."), max_frames=30), timeout=10)
    wait_for(lambda: reader.records.get(1), what="first record")
    svc.proc.send_signal(signal.SIGTERM)
    reader.wait([1], timeout=30)
    assert reader.result(1)[1] == FinishReason.LENGTH and len(reader.result(1)[0]) == 30
    assert svc.proc.wait(timeout=20) == 0
    with pytest.raises(grpc.RpcError):  # the watch ended with the talker
        for _ in watch:
            pass
    assert "drain timeout" not in svc.log_file.read_text()  # and did not hold its drain
    ring = reader.endpoint.ring_name.lstrip("/")
    assert not os.path.exists(f"/dev/shm/{ring}")


def test_a_session_over_grpc_appends_clears_and_ends(shared_talker):
    """Submit(session) -> SEGMENT_END and the slot kept; Append speaks the next segment in the same
    request (seq and frames go on); Clear ends a running segment CANCELLED; a last segment ends
    LAST. Append's errors: NOT_FOUND, FAILED_PRECONDITION, INVALID_ARGUMENT naming the field."""
    _, stub, readers = shared_talker
    reader = RingReader(stub, "c2w-s")
    readers.append(reader)
    session = submit_request("c2w-s", 31, ids("[0]First sentence."), max_frames=6)
    session.session = True
    stub.Submit(session, timeout=10)

    def ends():
        return [r for r, _ in reader.records.get(31, []) if r.segment_end or r.last or r.cancelled]

    wait_for(lambda: len(ends()) == 1, what="the first segment's end")
    assert ends()[0].segment_end and not ends()[0].last and stats(stub).free_slots == 4
    append = talker_pb2.AppendRequest(consumer_id="c2w-s", handle=31,
                                      text_token_ids=ids("[0]A long second one."), max_frames=200)
    first = len(reader.records[31])  # segment 1's records, its end included
    assert stub.Append(append, timeout=10).queued == 0
    wait_for(lambda: len(reader.records.get(31, [])) > first, what="the second segment's frames")
    cleared = stub.Clear(talker_pb2.ClearRequest(consumer_id="c2w-s", handle=31), timeout=10)
    assert cleared.found and cleared.dropped == 0
    wait_for(lambda: len(ends()) == 2, what="the cleared segment's end")
    assert ends()[1].segment_end and ends()[1].finish_reason == FinishReason.CANCELLED
    last = talker_pb2.AppendRequest(consumer_id="c2w-s", handle=31, text_token_ids=ids("[0]Bye."),
                                    max_frames=4, last=True)
    stub.Append(last, timeout=10)
    reader.wait([31])
    codes, finish, records = reader.result(31)  # seq and first_frame continue across the segments
    assert records[-1].last and finish in (FinishReason.LENGTH, FinishReason.STOP) and len(codes) >= 6
    wait_for(lambda: stats(stub).free_slots == 4, what="the session's slot freed")
    with pytest.raises(grpc.RpcError) as gone:
        stub.Append(last, timeout=10)
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    stub.Submit(submit_request("c2w-s", 32, ids("[0]Not a session."), max_frames=200), timeout=10)
    with pytest.raises(grpc.RpcError) as plain:
        stub.Append(talker_pb2.AppendRequest(consumer_id="c2w-s", handle=32, text_token_ids=ids("[0]x"),
                                             max_frames=4), timeout=10)
    assert plain.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    no_text = talker_pb2.AppendRequest(consumer_id="c2w-s", handle=32, max_frames=4)
    no_frames = talker_pb2.AppendRequest(consumer_id="c2w-s", handle=32, text_token_ids=[1])
    for bad, field in ((no_text, "text_token_ids"), (no_frames, "max_frames")):
        with pytest.raises(grpc.RpcError) as invalid:
            stub.Append(bad, timeout=10)
        assert invalid.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in invalid.value.details()
    stub.Cancel(talker_pb2.CancelRequest(consumer_id="c2w-s", handle=32), timeout=10)
