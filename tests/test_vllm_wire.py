"""aionixl.vllm's wire decoding without sockets or vLLM: replies shaped as vLLM 0.32.0 sends them."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from aionixl import _protocol as proto
from aionixl import _vllm_wire as wire
from aionixl._regions import Region

PAGE = 32768


def metadata(**changes: Any) -> dict[str, Any]:
    md: dict[str, Any] = {
        "engine_id": "p0", "agent_metadata": b"nixlSerDes|Agent...", "kv_caches_base_addr": [4096, 1 << 30],
        "device_id": 0, "num_blocks": 8, "block_lens": [PAGE, PAGE], "block_strides": [PAGE, PAGE],
        "kv_cache_layout": "LBHNC", "block_size": 32, "ssm_sizes": [0, 0], "attn_backend_name": "CPU_ATTN",
        "physical_blocks_per_logical_kv_block": 1, "region_num_blocks": [8, 8],
        "region_group_ids": [0, 0], "region_names": ["l0", "l1"], "region_mem_types": ["DRAM", "DRAM"],
        "dcp_size": 1, "pcp_size": 1, "ple_block_len": None, "region_members": [],
        "packed_member_layouts": {},
    }
    md.update(changes)
    return md


def reply(md: dict[str, Any], clock: Any = 12.5) -> list[bytes]:
    payload = {"compatibility_hash": "ab" * 32, "agent_metadata_bytes": msgspec.msgpack.encode(md)}
    return [msgspec.msgpack.encode(payload), msgspec.msgpack.encode(clock)]


def ours(n: int = 2, block_bytes: int = PAGE) -> list[Region]:
    return [Region(1 << 20, block_bytes, block_bytes, 4, "DRAM", 0) for _ in range(n)]


def test_request_is_the_get_meta_frame() -> None:
    assert msgspec.msgpack.decode(wire.encode_request(1, 3)) == [b"get_meta_msg", 1, 3]
    with pytest.raises(ValueError):
        wire.encode_request(-1, 0)


def test_reply_decodes_and_maps_to_regions() -> None:
    got = wire.decode_reply(reply(metadata()), 1 << 20)
    assert got.compatibility_hash == "ab" * 32 and got.remote_clock == 12.5
    regions = wire.regions(got.metadata, "VRAM")
    assert [(r.base, r.stride, r.block_bytes, r.num_blocks, r.mem_type) for r in regions] == [
        (4096, PAGE, PAGE, 8, "DRAM"), (1 << 30, PAGE, PAGE, 8, "DRAM")]
    wire.check_geometry(ours(), regions)


def test_older_metadata_without_per_region_fields_uses_defaults() -> None:
    md = metadata(block_strides=None, region_num_blocks=None, region_mem_types=None)
    del md["packed_member_layouts"]
    regions = wire.regions(wire.decode_reply(reply(md)[:1], 1 << 20).metadata, "VRAM")
    assert all(r.stride == PAGE and r.num_blocks == 8 and r.mem_type == "VRAM" for r in regions)


@pytest.mark.parametrize(("frames", "why"), [
    ([b"\x01"], "not a vLLM"),
    ([msgspec.msgpack.encode({"compatibility_hash": "x"})], "not a vLLM"),
    ([b"a", b"b", b"c"], "reply frames"),
])
def test_bad_replies_are_wire_errors(frames: list[bytes], why: str) -> None:
    with pytest.raises(wire.VllmWireError, match=why):
        wire.decode_reply(frames, 1 << 20)


def test_oversized_reply_is_refused() -> None:
    with pytest.raises(wire.VllmWireError, match="larger"):
        wire.decode_reply(reply(metadata()), 100)


@pytest.mark.parametrize(("changes", "field"), [
    ({"ssm_sizes": [4, 8]}, "ssm_sizes"),
    ({"physical_blocks_per_logical_kv_block": 2}, "physical_blocks_per_logical_kv_block"),
    ({"region_num_blocks": [8, 4]}, "region_num_blocks"),
    ({"region_mem_types": ["DRAM", "FILE"]}, "region_mem_types[1]"),
])
def test_layouts_without_one_id_per_block_are_incompatible(changes: dict[str, Any], field: str) -> None:
    md = wire.decode_reply(reply(metadata(**changes)), 1 << 20).metadata
    with pytest.raises(proto.Incompatible) as info:
        wire.regions(md, "DRAM")
    assert info.value.field == field


@pytest.mark.parametrize("changes", [
    {"block_lens": [PAGE]}, {"kv_caches_base_addr": []}, {"block_strides": [PAGE, 16]},
])
def test_self_contradicting_metadata_is_a_wire_error(changes: dict[str, Any]) -> None:
    md = wire.decode_reply(reply(metadata(**changes)), 1 << 20).metadata
    with pytest.raises(wire.VllmWireError):
        wire.regions(md, "DRAM")


def test_geometry_mismatch_names_the_field() -> None:
    regions = wire.regions(wire.decode_reply(reply(metadata()), 1 << 20).metadata, "DRAM")
    with pytest.raises(proto.Incompatible) as info:
        wire.check_geometry(ours(3), regions)
    assert info.value.field == "region_count"
    other_sizes = [ours()[0], ours(1, PAGE // 2)[0]]
    wire.check_geometry(other_sizes, regions)  # another TP or block size: parts of blocks move
    with pytest.raises(proto.Incompatible) as info:
        wire.check_geometry(other_sizes, regions, equal_geometry=True)
    assert info.value.field == "bytes_per_block[1]"


def test_notifications_round_trip_as_vllm_reads_them() -> None:
    msg = wire.read_notification("cmpl-7:a", 2)
    assert msg == b"cmpl-7:a:2" and wire.parse_notification(msg) == ("cmpl-7:a", 2)
    hb = wire.heartbeat_message(["r1", "r2"])
    assert hb == b"HB:r1,r2" and wire.parse_notification(hb) == ["r1", "r2"]
    for bad in (lambda: wire.read_notification("", 1), lambda: wire.read_notification("r", 0),
                lambda: wire.read_notification("HB:x", 1), lambda: wire.heartbeat_message([]),
                lambda: wire.heartbeat_message(["a,b"]), lambda: wire.heartbeat_message(5),  # type: ignore[arg-type]
                lambda: wire.heartbeat_message("r1")):
        with pytest.raises(ValueError):
            bad()


def test_a_metadata_request_decodes_to_its_rank_and_anything_else_is_a_wire_error() -> None:
    assert wire.decode_request([wire.encode_request(2, 5)]) == (2, 5)
    bad = [[], [b"x", b"y"], [b"\xc1"], [msgspec.msgpack.encode([b"get_meta_msg", 0])],
           [msgspec.msgpack.encode([b"get_meta_msg", 0, -2])], [msgspec.msgpack.encode([b"nope", 0, 0])],
           [b"\x93" + b"\xc4\x0cget_meta_msg" + b"\x00" * 2000]]
    for frames in bad:
        with pytest.raises(wire.VllmWireError):
            wire.decode_request(frames)


def test_served_metadata_reads_back_as_the_same_regions() -> None:
    theirs = [proto.RegionInfo(4096 + i * (1 << 20), PAGE * 2, PAGE, 8, "DRAM", 0) for i in range(3)]
    md = wire.serving_metadata("p7", b"agent", theirs, block_size=32, kv_cache_layout="LBHNC",
                               attn_backend_name="FLASH_ATTN")
    got = wire.decode_reply(wire.encode_reply(wire.encode_payload("h" * 64, md), 3.5), 1 << 20)
    assert got.compatibility_hash == "h" * 64 and got.remote_clock == 3.5 and got.metadata == md
    assert wire.regions(got.metadata, "VRAM") == theirs
    assert got.metadata.region_names is None  # a decode compares names only when told them
    payload = msgspec.msgpack.decode(wire.encode_payload("h", md))
    decoded = msgspec.msgpack.decode(payload["agent_metadata_bytes"])
    for field in ("block_strides", "kv_cache_layout", "block_size", "ssm_sizes", "attn_backend_name",
                  "physical_blocks_per_logical_kv_block"):  # fields vLLM's decoder requires
        assert field in decoded


def test_a_refusal_reads_as_vllm_refused() -> None:
    with pytest.raises(wire.VllmRefused, match="serves tp_rank 0 only"):
        wire.decode_reply(wire.encode_refusal("serves tp_rank 0 only"), 1 << 20)
