"""Matching incoming notifications with the tasks waiting for them. No I/O here.

A notification goes to the oldest waiter whose message (and peer, if it named one)
matches; with no such waiter it is kept. At most ``limit`` are kept, holding at most
``byte_limit`` bytes of messages (or one message, however large): past that the oldest
kept notifications are dropped, counted in ``dropped`` and reported to ``on_drop`` (the
engine logs it, rate-limited in time), so a peer that notifies nobody-in-particular cannot
grow memory without bound, and a flood costs O(1) per message.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import NamedTuple

import anyio


class Notification(NamedTuple):
    """A message a peer sent us: with a transfer (after its data landed) or on its own."""

    peer: str
    message: bytes


class Waiter:
    __slots__ = ("message", "peer", "event", "result")

    def __init__(self, message: bytes, peer: str | None) -> None:
        self.message = message
        self.peer = peer
        self.event = anyio.Event()
        self.result: Notification | None = None


class Mailbox:
    def __init__(self, limit: int, byte_limit: int, on_drop: Callable[[int], object] = lambda dropped: None
                 ) -> None:
        self._limit = limit
        self._byte_limit = byte_limit
        self._on_drop = on_drop  # told the count so far, on every drop
        self._kept_bytes = 0
        self._seq = itertools.count()
        self._kept: OrderedDict[int, Notification] = OrderedDict()
        self._kept_by_message: dict[bytes, deque[int]] = {}
        self._waiters: dict[bytes, list[Waiter]] = {}
        self.dropped = 0
        self.delivered = 0  # handed to a wait_notification caller

    @property
    def waiting(self) -> int:
        return sum(len(w) for w in self._waiters.values())

    @property
    def kept(self) -> int:
        return len(self._kept)

    def deliver(self, note: Notification) -> None:
        """Hand ``note`` to a waiter, or keep it."""
        if self._give_to_waiter(note):
            return
        self._keep(note, oldest=False)

    def redeliver(self, note: Notification) -> None:
        """A waiter got ``note`` but was cancelled before it could take it: pass it on."""
        self.delivered -= 1  # that waiter never returned it
        if not self._give_to_waiter(note):
            self._keep(note, oldest=True)

    def take(self, message: bytes, peer: str | None) -> Notification | None:
        """A kept notification that matches, removed; or None."""
        seqs = self._kept_by_message.get(message)
        if not seqs:
            return None
        for seq in seqs:
            note = self._kept[seq]
            if peer is None or note.peer == peer:
                self.delivered += 1
                seqs.remove(seq)
                if not seqs:
                    del self._kept_by_message[message]
                del self._kept[seq]
                self._kept_bytes -= len(note.message)
                return note
        return None

    def add_waiter(self, message: bytes, peer: str | None) -> Waiter:
        waiter = Waiter(message, peer)
        self._waiters.setdefault(message, []).append(waiter)
        return waiter

    def remove_waiter(self, waiter: Waiter) -> None:
        waiters = self._waiters.get(waiter.message)
        if waiters and waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self._waiters[waiter.message]

    def all_waiters(self) -> list[Waiter]:
        return [w for ws in self._waiters.values() for w in ws]

    def _give_to_waiter(self, note: Notification) -> bool:
        waiters = self._waiters.get(note.message)
        if not waiters:
            return False
        for i, waiter in enumerate(waiters):
            if waiter.peer is None or waiter.peer == note.peer:
                del waiters[i]
                if not waiters:
                    del self._waiters[note.message]
                waiter.result = note
                self.delivered += 1
                waiter.event.set()
                return True
        return False

    def _keep(self, note: Notification, *, oldest: bool) -> None:
        size = len(note.message)
        while self._kept and (len(self._kept) >= self._limit or self._kept_bytes + size > self._byte_limit):
            gone_seq, gone = self._kept.popitem(last=False)
            gone_seqs = self._kept_by_message[gone.message]
            gone_seqs.remove(gone_seq)
            if not gone_seqs:
                del self._kept_by_message[gone.message]
            self._kept_bytes -= len(gone.message)
            self.dropped += 1
            self._on_drop(self.dropped)
        seq = next(self._seq)
        self._kept[seq] = note
        self._kept_bytes += size
        seqs = self._kept_by_message.setdefault(note.message, deque())
        if oldest:
            self._kept.move_to_end(seq, last=False)
            seqs.appendleft(seq)
        else:
            seqs.append(seq)
