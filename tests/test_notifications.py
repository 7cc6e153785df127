"""The mailbox that matches notifications with waiters, without NIXL."""

from __future__ import annotations

from aionixl._notifications import Mailbox, Notification


def test_oldest_matching_waiter_gets_it() -> None:
    box = Mailbox(10, 1 << 20)
    first, second = box.add_waiter(b"m", None), box.add_waiter(b"m", None)
    box.deliver(Notification("p", b"m"))
    assert first.event.is_set() and first.result == Notification("p", b"m")
    assert not second.event.is_set() and box.waiting == 1


def test_peer_filter() -> None:
    box = Mailbox(10, 1 << 20)
    only_q = box.add_waiter(b"m", "q")
    box.deliver(Notification("p", b"m"))
    assert not only_q.event.is_set() and box.kept == 1
    assert box.take(b"m", "q") is None
    assert box.take(b"m", None) == Notification("p", b"m")
    assert box.kept == 0


def test_bound_drops_oldest_and_counts() -> None:
    box = Mailbox(2, 1 << 20)
    for i in range(4):
        box.deliver(Notification("p", b"%d" % i))
    assert box.kept == 2 and box.dropped == 2
    assert box.take(b"0", None) is None and box.take(b"1", None) is None
    assert box.take(b"3", None) is not None and box.take(b"2", None) is not None


def test_redelivered_goes_to_the_next_waiter_or_to_the_front() -> None:
    box = Mailbox(2, 1 << 20)
    note = Notification("p", b"m")
    box.redeliver(note)
    box.deliver(Notification("p", b"other"))
    box.deliver(Notification("p", b"third"))  # full: the redelivered one is the oldest
    assert box.take(b"m", None) is None
    waiter = box.add_waiter(b"x", None)
    box.redeliver(Notification("p", b"x"))
    assert waiter.result == Notification("p", b"x")


def test_removed_waiter_gets_nothing() -> None:
    box = Mailbox(4, 1 << 20)
    waiter = box.add_waiter(b"m", None)
    box.remove_waiter(waiter)
    box.deliver(Notification("p", b"m"))
    assert waiter.result is None and box.kept == 1
