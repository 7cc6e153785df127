"""Region validation and block-id handling, without NIXL."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from aionixl._regions import (
    block_descriptors,
    block_ids,
    describe_regions,
    descriptor_indices,
    plain_ids,
    plain_int,
    region_offsets,
    registration_spans,
)


def test_views_of_one_tensor_describe_their_own_blocks() -> None:
    cache = torch.zeros(2, 5, 4, 8, dtype=torch.float16)
    k, v = describe_regions([cache[0], cache[1]])
    assert (k.num_blocks, k.block_bytes, k.stride) == (5, 64, 64)
    assert v.base == k.base + 5 * 64
    assert k.mem_type == "DRAM"


def test_descriptors_are_region_major_and_point_at_each_block() -> None:
    a = np.zeros((3, 16), np.uint8)
    b = np.zeros((6, 32), np.uint8)[::2]  # stride 64, block 32
    regions = describe_regions([a, b])
    d = block_descriptors(regions)
    assert d.shape == (6, 3)
    assert list(d[:3, 0]) == [a[i].ctypes.data for i in range(3)]
    assert list(d[3:, 0]) == [b[i].ctypes.data for i in range(3)]
    assert list(d[:, 1]) == [16, 16, 16, 32, 32, 32]
    idx = descriptor_indices(region_offsets(2, 3), np.array([2, 0], np.int32))
    assert list(idx) == [2, 0, 5, 3]


def test_registration_spans_merge_views_of_one_allocation() -> None:
    cache = np.zeros((2, 4, 100), np.uint8)
    spans = registration_spans(describe_regions([cache[0], cache[1]]))
    assert spans.tolist() == [[cache.ctypes.data, cache.nbytes, 0]]
    other = np.zeros((4, 100), np.uint8)
    spans = registration_spans(describe_regions([cache[0], other]))
    assert len(spans) == 2


BAD_REGIONS: list[tuple[str, Any, str]] = [
    ("empty list", [], "empty"),
    ("single tensor", torch.zeros(2, 2), "sequence"),
    ("not a tensor", [[1, 2, 3]], "expected a torch.Tensor"),
    ("0-d", [np.zeros(())], "block dimension"),
    ("no blocks", [np.zeros((0, 4))], "no blocks"),
    ("empty blocks", [np.zeros((4, 0))], "empty"),
    ("non-contiguous block", [np.zeros((4, 8, 8))[:, :, 0]], "not contiguous"),
    ("transposed tensor", [torch.zeros(8, 4).t()], "not contiguous"),
    ("overlapping blocks", [np.lib.stride_tricks.as_strided(np.zeros(64, np.uint8), (4, 16), (8, 1))],
     "overlap"),
    ("backwards", [np.zeros((4, 16), np.uint8)[::-1]], "overlap"),
    ("read-only", [np.frombuffer(bytes(64), np.uint8).reshape(4, 16)], "read-only"),
    ("object dtype", [np.empty((2, 2), dtype=object)], "object"),
    ("block counts differ", [np.zeros((4, 8)), np.zeros((5, 8))], "same number of blocks"),
    ("meta device", [torch.zeros(4, 4, device="meta")], "not supported"),
]


@pytest.mark.parametrize(("case", "caches", "match"), BAD_REGIONS, ids=[c for c, _, _ in BAD_REGIONS])
def test_bad_regions_are_refused(case: str, caches: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        describe_regions(caches)


def test_block_ids_accept_ints_and_integer_arrays() -> None:
    assert block_ids([3, 1], 4, "x").tolist() == [3, 1]
    assert block_ids(np.array([0, 3], np.uint8), 4, "x").dtype == np.int32
    assert block_ids((np.int64(2),), 4, "x").tolist() == [2]
    assert block_ids(range(3, -1, -2), 4, "x").tolist() == [3, 1]


@pytest.mark.parametrize("value", [[4], [-1], [], [1.0], [True], "12", np.array([[1]]),
                                   np.array([0.5]), 3, None, [None], [2**70], [-2**70],
                                   np.array([2**64 - 1], np.uint64), range(2**70), range(0),
                                   range(-70, 0), range(3, -70, -1)])
def test_block_ids_refuse_bad_input(value: Any) -> None:
    with pytest.raises(ValueError):
        block_ids(value, 4, "x")


@pytest.mark.parametrize(("value", "message"), [
    ([3, 2**70], "has block id 1180591620717411303424, but there are only 8 blocks"),
    ((2**63,), "has block id 9223372036854775808, but there are only 8 blocks"),
    ([np.uint64(2**63), 1], "has block id 9223372036854775808, but there are only 8 blocks"),
    ([1, -(2**64)], "has a negative block id (-18446744073709551616)"),
])
def test_block_ids_beyond_int64_are_named(value: Any, message: str) -> None:
    with pytest.raises(ValueError) as info:
        block_ids(value, 8, "local_blocks")
    assert str(info.value) == "local_blocks " + message


def test_plain_ids_turn_tuples_ranges_and_short_integer_arrays_into_lists() -> None:
    for value in ((3, 1), range(2, 5), np.array([7, 0], np.uint16), np.array([5], np.int64)):
        plain = plain_ids(value)
        assert type(plain) is list and plain == list(value)
        assert all(type(v) is int for v in plain)
    # Left as they are, for block_ids to accept or explain: lists, long or non-integer
    # arrays, long ranges, other objects.
    left = [[1, 2], np.arange(65), np.array([1.0]), np.array([True]), np.zeros((1, 1), np.int32),
            range(65), "12", 3]
    for value in left:
        assert plain_ids(value) is value


def test_plain_int_turns_numpy_integers_into_ints_only() -> None:
    for value in (np.int64(5), np.uint16(7), np.int8(-1)):
        assert type(plain_int(value)) is int and plain_int(value) == value
    for other in (np.True_, np.float32(1.0), 3, True, "3"):
        assert plain_int(other) is other
