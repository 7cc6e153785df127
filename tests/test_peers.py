"""The peer module's sans-I/O parts: packed notifications and the tags a receiver keeps."""

from __future__ import annotations

import pytest

from aionixl._wire import (
    MAX_PACKED_MESSAGES,
    MULTI,
    PROBE,
    TAGGED,
    SeenTags,
    WireError,
    pack_notifications,
    pack_tagged,
    unpack_notifications,
    unpack_tagged,
)


def test_tagged_notifications_come_back_with_their_tag_in_order() -> None:
    messages = [b"a", b"", b"\x00x" * 40, bytes(range(256))]
    packed = pack_tagged(2**62 + 5, messages)
    assert packed.startswith(TAGGED) and not packed.startswith(MULTI)
    assert unpack_tagged(packed) == (2**62 + 5, messages)


@pytest.mark.parametrize("message", [
    TAGGED + b"\xc1", TAGGED, pack_notifications([b"a"]).replace(MULTI, TAGGED),  # no tag
    TAGGED + b"\x92\x07\x91" * 2 + b"\x91" * 100_000 + b"\xc0",  # nested past the recursion limit
    TAGGED + b"\x93\x07\x90" + b"\x91" * 100_000 + b"\xc0",  # a third element, nested
], ids=["bad-opcode", "empty", "no-tag", "nested", "nested-extra"])
def test_a_malformed_tagged_notification_raises_wire_error(message: bytes) -> None:
    with pytest.raises(WireError, match="tagged notification"):
        unpack_tagged(message)


def test_a_packed_notification_announcing_too_many_messages_is_refused_before_decoding() -> None:
    """The array header is read first: no message of the body is decoded (here it is not
    even there); a tagged one's body is only skipped over to find the tag."""
    for header in (b"\xdd\x00\x01\x00\x01", b"\xdd\xff\xff\xff\xff"):
        with pytest.raises(WireError, match=f"at most {MAX_PACKED_MESSAGES}"):
            unpack_notifications(MULTI + header)
    empty = b"\xc4\x00"  # bin 8 of no bytes
    with pytest.raises(WireError, match=f"at most {MAX_PACKED_MESSAGES}"):
        unpack_tagged(TAGGED + b"\x92\x07\xdd\x00\x01\x00\x01" + empty * (MAX_PACKED_MESSAGES + 1))
    assert len(unpack_notifications(pack_notifications([b"x"] * MAX_PACKED_MESSAGES))) == MAX_PACKED_MESSAGES


def test_reserved_messages_inside_packed_ones_are_filtered() -> None:
    # A packed message may not smuggle in the engine's own notifications.
    assert unpack_tagged(pack_tagged(7, [b"a", PROBE, b"b"])) == (7, [b"a", b"b"])
    assert unpack_notifications(pack_notifications([PROBE, b"c"])) == [b"c"]


def test_seen_tags_say_first_once_per_sender_and_forget_the_oldest_beyond_their_bound() -> None:
    seen = SeenTags(limit=3)
    assert seen.first("p", 1) and not seen.first("p", 1)
    assert seen.first("q", 1)  # another sender's tag is its own
    assert seen.first("p", 2) and not seen.first("p", 2)
    assert seen.first("p", 3)  # a fourth: ("p", 1) is forgotten
    assert not seen.first("q", 1) and not seen.first("p", 3)
    assert seen.first("p", 1)
