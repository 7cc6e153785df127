"""The peer module's sans-I/O parts: packed notifications and the tags a receiver keeps."""

from __future__ import annotations

from aionixl._wire import (
    MULTI,
    PROBE,
    TAGGED,
    SeenTags,
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


def test_a_malformed_tagged_notification_is_dropped_and_reserved_ones_filtered() -> None:
    assert unpack_tagged(TAGGED + b"\xc1") is None
    assert unpack_tagged(TAGGED) is None
    assert unpack_tagged(pack_notifications([b"a"]).replace(MULTI, TAGGED)) is None  # no tag
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
