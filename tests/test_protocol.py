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
    proto.check_compatible(REGIONS, {}, other, {})  # other block sizes: parts of blocks move
    with pytest.raises(proto.Incompatible) as info:
        proto.check_compatible(REGIONS, {}, other, {}, equal_geometry=True)
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


def test_sealed_frames_verify_and_tampering_is_caught() -> None:
    payload = proto.encode(hello())
    frames = proto.seal(payload, SECRET)
    assert len(frames) == 2 and proto.unseal(frames, SECRET) == payload
    assert proto.seal(payload, None) == [payload] and proto.unseal([payload], None) == payload
    forged = ([payload], proto.seal(payload, b"another-secret-of-16"),
              [payload + b"x", frames[1]], [payload, frames[1], b""], [])
    for bad in forged:
        with pytest.raises(proto.ProtocolError):
            proto.unseal(bad, SECRET)
    with pytest.raises(proto.ProtocolError) as info:
        proto.unseal([payload], SECRET)
    assert info.value.code == "unauthorized"
    # A listener without a secret refuses signed hellos; a client still reads signed replies.
    with pytest.raises(proto.ProtocolError, match="no handshake_secret"):
        proto.unseal(frames, None)
    assert proto.unseal(frames, None, tag_optional=True) == payload


def test_the_tag_covers_the_bytes_sent_so_newer_fields_do_not_break_it() -> None:
    fields = {"type": "hello", **msgspec.structs.asdict(hello()), "added_in_a_later_version": 7}
    payload = msgspec.msgpack.encode(fields)
    assert proto.decode_hello(proto.unseal(proto.seal(payload, SECRET), SECRET), LIMIT) == hello()


def test_replay_guard_refuses_stale_future_and_repeated_hellos() -> None:
    guard = proto.ReplayGuard(window=60)
    fresh = hello(nonce=b"n" * 16, sent_at=1000.0)
    guard.check(fresh, now=1010.0)
    for bad, now in ((fresh, 1011.0), (hello(nonce=b"m" * 16, sent_at=900.0), 1011.0),
                     (hello(nonce=b"f" * 16, sent_at=2000.0), 1011.0),
                     (hello(nonce=b"s", sent_at=1000.0), 1011.0),
                     (hello(nonce=b"i" * 16, sent_at=float("inf")), 1011.0)):
        with pytest.raises(proto.ProtocolError) as info:
            guard.check(bad, now=now)
        assert info.value.code == "unauthorized"
    # Nonces are forgotten after two windows; by then a replay is refused as stale.
    guard.check(hello(nonce=b"o" * 16, sent_at=1500.0), now=1500.0)
    with pytest.raises(proto.ProtocolError, match="stale"):
        guard.check(fresh, now=1500.0)


def test_old_messages_without_freshness_fields_still_decode() -> None:
    fields = {"type": "hello", **msgspec.structs.asdict(hello())}
    del fields["nonce"], fields["sent_at"]
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


def test_features_and_host_round_trip_and_older_messages_decode_without_them() -> None:
    message = hello(features=["multi-notify"], host={"boot": "b1", "tls": "tcp"})
    decoded = proto.decode_hello(proto.encode(message), LIMIT)
    assert decoded.features == ["multi-notify"] and decoded.host == {"boot": "b1", "tls": "tcp"}
    # An engine that predates the fields sends neither: they decode as "none".
    older = msgspec.msgpack.decode(proto.encode(hello()))
    del older["features"], older["host"]
    plain = proto.decode_hello(msgspec.msgpack.encode(older), LIMIT)
    assert plain.features == [] and plain.host == {}


def test_host_facts_from_a_peer_are_bounded() -> None:
    host = {f"k{i}" * 100: "v" * 1000 for i in range(40)}
    clipped = proto.clip_host(host)
    assert len(clipped) == 16
    assert all(len(k) <= 230 and len(v) <= 230 for k, v in clipped.items())
