"""The ring's bytes and names: record header offsets, finish reasons equal to the
proto's, names and their sanitising, the architecture guard, the transport section."""

from __future__ import annotations

import platform
import secrets

import numpy as np
import pytest

from services.common.config import ConfigError, parse_section
from services.transport import TransportSection
from services.transport.layout import (
    RECORD,
    RECORD_HEADER_BYTES,
    SHM_PREFIX_ENV,
    FinishReason,
    RecordTooLarge,
    as_codes,
    record_bytes,
    ring_names,
    sanitize_consumer_id,
    shm_file_prefixes,
    wake_name_for,
)
from services.transport.shm_consumer import RingConsumer
from services.transport.shm_producer import RingProducer
from voxring.v1 import common_pb2


def test_finish_reasons_equal_the_proto_enum():
    proto = {name.removeprefix("FINISH_REASON_"): value
             for name, value in common_pb2.FinishReason.items()}
    assert proto == {member.name: member.value for member in FinishReason}


def test_record_header_offsets_are_as_documented():
    raw = RECORD.pack(0x11223344, 1, 3, 6, 0x0A0B, 0x0C0D0E0F, 0x0102030405060708, 0x21222324, 0x31323334)
    assert RECORD_HEADER_BYTES == len(raw) == 32
    assert raw[0:4] == bytes.fromhex("44332211")           # length
    assert raw[4:6] == b"\x01\x00"                          # record type
    assert raw[6:8] == b"\x03\x00"                          # flags
    assert raw[8:10] == b"\x06\x00"                         # finish reason
    assert raw[10:12] == b"\x0b\x0a"                        # codebooks
    assert raw[12:16] == bytes.fromhex("0f0e0d0c")         # frames
    assert raw[16:24] == bytes.fromhex("0807060504030201")  # handle
    assert raw[24:28] == bytes.fromhex("24232221")         # seq
    assert raw[28:32] == bytes.fromhex("34333231")         # first frame


@pytest.mark.parametrize(("payload", "size"), [(0, 32), (2, 48), (16, 48), (17, 64), (65536, 65568)])
def test_records_occupy_16_byte_multiples(payload, size):
    assert record_bytes(payload) == size


def test_names_carry_token_consumer_and_generation(monkeypatch):
    monkeypatch.delenv(SHM_PREFIX_ENV)  # production: the default prefix (tests set their own)
    ring, wake = ring_names(0xDEADBEEF, "c2w/0 ü", 3)
    assert ring == "/voxring-ring-00000000deadbeef-c2w_0__-g3"
    assert wake == "/voxring-wake-00000000deadbeef-c2w_0__-g3"
    assert wake_name_for(ring) == wake
    assert len(sanitize_consumer_id("x" * 500)) == 64
    with pytest.raises(ValueError):
        sanitize_consumer_id("")
    with pytest.raises(ValueError):
        ring_names(1 << 64, "c", 0)


def test_a_name_prefix_from_the_environment_names_every_entry(monkeypatch):
    monkeypatch.setenv(SHM_PREFIX_ENV, "stack_b.2")
    ring, wake = ring_names(0xDEADBEEF, "c2w-0", 3)
    assert ring == "/stack_b.2-ring-00000000deadbeef-c2w_0-g3"
    assert wake == "/stack_b.2-wake-00000000deadbeef-c2w_0-g3"
    assert wake_name_for(ring) == wake
    assert shm_file_prefixes() == ("stack_b.2-ring-", "sem.stack_b.2-wake-")
    # a prefix with "-" could begin another's names ("a" and "a-ring-b"); none of these is usable
    for bad in ("", "a-b", "a/b", "x" * 33, "ü"):
        monkeypatch.setenv(SHM_PREFIX_ENV, bad)
        with pytest.raises(ValueError, match=SHM_PREFIX_ENV):
            ring_names(1, "c", 0)
    with pytest.raises(ValueError, match="not a voxring ring name"):
        wake_name_for("/some-other-name")


def test_codes_are_checked_and_converted():
    assert as_codes(None).shape == (0, 0)
    same = np.zeros((3, 4), dtype=np.int16)
    assert as_codes(same) is same  # no copy on the hot path
    converted = as_codes(np.arange(12, dtype=np.int64).reshape(3, 4).T)
    assert converted.dtype == np.dtype("<i2") and converted.flags.c_contiguous
    assert converted.tolist() == np.arange(12).reshape(3, 4).T.tolist()
    with pytest.raises(ValueError, match="int16"):
        as_codes(np.array([[40000]]))
    with pytest.raises(ValueError, match="integers"):
        as_codes(np.zeros((2, 2), dtype=np.float32))
    with pytest.raises(ValueError, match="num_frames, num_codebooks"):
        as_codes(np.zeros(4, dtype=np.int16))


def test_record_too_large_is_a_value_error_naming_both_sizes():
    exc = RecordTooLarge(70000, 65536)
    assert isinstance(exc, ValueError)
    assert "70000" in str(exc) and "65536" in str(exc)


def test_other_architectures_are_refused(monkeypatch):
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    with pytest.raises(RuntimeError, match="x86-64"):
        RingProducer.create(secrets.randbits(64), "c", 0, 4096)
    with pytest.raises(RuntimeError, match="aarch64"):
        RingConsumer.attach("/voxring-ring-0000000000000000-c-g0")


def test_transport_section_defaults_and_validation():
    section = TransportSection()
    assert (section.kind, section.capacity_bytes, section.spin_us) == ("shm", 4 << 20, 50)
    assert parse_section(TransportSection, {"kind": "grpc", "liveness_timeout": 0.3,
                                            "heartbeat_interval": 0.05}, "transport").kind == "grpc"
    bad = [({"kind": "tcp"}, "transport.kind"),
           ({"capacity_bytes": 4097}, "transport.capacity_bytes"),
           ({"capacity_bytes": 1024}, "transport.capacity_bytes"),
           ({"spin_us": -1}, "transport.spin_us"),
           ({"heartbeat_interval": 0.5}, "transport.heartbeat_interval"),
           ({"liveness_timeout": 0.1}, "transport.liveness_timeout")]
    for data, key in bad:
        with pytest.raises(ConfigError, match=key):
            parse_section(TransportSection, data, "transport")
