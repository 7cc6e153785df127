"""The handshake wire format, sans I/O: round trips, strict decoding, compatibility."""

from __future__ import annotations

import contextlib

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aionixl import _protocol as proto
from aionixl._regions import Region

REGIONS = [Region(0x1000, 64, 64, 4, "DRAM", 0), Region(0x2000, 128, 96, 4, "DRAM", 0)]
LIMIT = 1 << 20


def hello(**over: object) -> proto.Hello:
    fields: dict[str, object] = {
        "version": proto.PROTOCOL_VERSION, "name": "a", "agent_metadata": b"md",
        "regions": [proto.RegionInfo.of(r) for r in REGIONS], "compat": {"model": "m"},
        "compat_hash": proto.compat_hash(REGIONS, {"model": "m"}),
    }
    fields.update(over)
    return proto.Hello(**fields)  # type: ignore[arg-type]


def test_round_trip() -> None:
    message = hello()
    assert proto.decode_hello(proto.encode(message), LIMIT) == message
    reject = proto.Reject(proto.PROTOCOL_VERSION, "incompatible", "why", "region_count")
    assert proto.decode_reply(proto.encode(reject), LIMIT) == reject


def test_wrong_version_is_named() -> None:
    with pytest.raises(proto.ProtocolError) as info:
        proto.decode_hello(proto.encode(hello(version=99)), LIMIT)
    assert info.value.code == "version" and "v99" in str(info.value)


def test_a_future_message_with_a_different_shape_still_reports_its_version() -> None:
    data = msgspec.msgpack.encode({"type": "hello", "version": 2, "something": "new"})
    with pytest.raises(proto.ProtocolError) as info:
        proto.decode_hello(data, LIMIT)
    assert info.value.code == "version"


def test_oversized_messages_are_refused_before_decoding() -> None:
    data = proto.encode(hello(agent_metadata=b"x" * 2000))
    with pytest.raises(proto.ProtocolError, match="limit"):
        proto.decode_hello(data, 1000)


@pytest.mark.parametrize("regions", [[], [proto.RegionInfo(0, 8, 16, 4, "DRAM", 0)],
                                     [proto.RegionInfo(0, 8, 8, 0, "DRAM", 0)]])
def test_impossible_geometry_is_refused(regions: list[proto.RegionInfo]) -> None:
    with pytest.raises(proto.ProtocolError):
        proto.decode_hello(proto.encode(hello(regions=regions)), LIMIT)


def test_wrong_message_kind_is_refused() -> None:
    with pytest.raises(proto.ProtocolError):
        proto.decode_reply(proto.encode(hello()), LIMIT)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_only_ever_raise_protocol_error(data: bytes) -> None:
    for decode in (proto.decode_hello, proto.decode_reply):
        with contextlib.suppress(proto.ProtocolError):
            decode(data, LIMIT)


def test_compatibility_names_the_first_difference() -> None:
    theirs = [proto.RegionInfo.of(r) for r in REGIONS]
    proto.check_compatible(REGIONS, {}, theirs, {})
    with pytest.raises(proto.Incompatible) as info:
        proto.check_compatible(REGIONS[:1], {}, theirs, {})
    assert info.value.field == "region_count"
    other = [theirs[0], proto.RegionInfo(0x9000, 200, 100, 9, "VRAM", 1)]
    with pytest.raises(proto.Incompatible) as info:
        proto.check_compatible(REGIONS, {}, other, {})
    assert info.value.field == "bytes_per_block[1]"
    with pytest.raises(proto.Incompatible) as info:
        proto.check_compatible(REGIONS, {"dtype": "bf16"}, theirs, {})
    assert info.value.field == "compat[dtype]"


def test_hash_ignores_addresses_and_block_counts_but_not_sizes_or_compat() -> None:
    base = proto.compat_hash(REGIONS, {"m": "1"})
    moved = [Region(0x9999, 64, 64, 100, "VRAM", 3), Region(0x1, 96, 96, 100, "VRAM", 3)]
    assert proto.compat_hash(moved, {"m": "1"}) == base
    assert proto.compat_hash(REGIONS, {"m": "2"}) != base
    assert proto.compat_hash(REGIONS[:1], {"m": "1"}) != base


SECRET = b"sixteen-bytes-or-more"


def test_signed_messages_verify_and_tampering_is_caught() -> None:
    signed = proto.sign(hello(), SECRET)
    assert len(signed.auth) == 32
    decoded = proto.decode_hello(proto.encode(signed), LIMIT)
    proto.check_auth(decoded, SECRET)
    proto.check_auth(decoded, None)  # an engine without a secret ignores the tag
    for forged in (hello(), proto.sign(hello(), b"another-secret-of-16"),
                   msgspec.structs.replace(signed, name="b"),
                   msgspec.structs.replace(signed, agent_metadata=b"other")):
        with pytest.raises(proto.ProtocolError) as info:
            proto.check_auth(forged, SECRET)
        assert info.value.code == "unauthorized"
    assert proto.sign(hello(), None) == hello()


def test_old_messages_without_auth_still_decode() -> None:
    fields = {"type": "hello", **msgspec.structs.asdict(hello())}
    del fields["auth"]
    assert proto.decode_hello(msgspec.msgpack.encode(fields), LIMIT) == hello()


def test_deep_nesting_is_a_bad_request_not_a_recursion_error() -> None:
    data = b"\x91" * 100_000 + b"\x00"  # 100k nested one-element arrays
    with pytest.raises(proto.ProtocolError) as info:
        proto.decode_hello(data, 1 << 20)
    assert info.value.code == "bad-request"


def test_peer_text_in_errors_is_clipped() -> None:
    with pytest.raises(proto.Incompatible) as info:
        proto.check_compatible(REGIONS, {"k": "x" * 50_000}, [proto.RegionInfo.of(r) for r in REGIONS],
                               {"k": "y"})
    assert len(str(info.value)) < 400 and "chars)" in str(info.value)
