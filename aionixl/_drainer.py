"""The notification drainer: reads NIXL notifications, hands them out, probes peers.

It is also what keeps NIXL progressing while nothing else calls into it (with NIXL's
progress thread off, a target makes progress only when it polls), so its cadence is the
engine's idle cost: every loop turn while transfers are in flight or notifications
arrive, backing off while nothing happens, asleep with no peers and no waiters.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator

import anyio
import anyio.lowlevel

from ._config import Tuning
from ._errors import AionixlError
from ._inflight import InFlightTable
from ._leases import LeaseTable
from ._lifecycle import LocalSide
from ._notifications import Mailbox, Notification
from ._peers import PeerTable
from ._push import Pusher
from ._ratelimit import RateLimitedLog, Refusals
from ._vllm_serve import VllmServer
from ._wire import MULTI, RESERVED, TAGGED, SeenTags, WireError, kind_of, unpack_notifications, unpack_tagged

#: Notifications delivered (and messages handled) between two loop turns: a flood, or one
#: packed notification of thousands, never holds the loop for long.
SLICE = 512


class NotificationDrainer:
    """One task per engine; :meth:`wake` ends its current back-off sleep."""

    def __init__(self, local: LocalSide, tuning: Tuning, deliver: Callable[[Notification], None],
                 mailbox: Mailbox, leases: LeaseTable, peers: PeerTable, table: InFlightTable,
                 push: Pusher, vllm: VllmServer, noisy: RateLimitedLog, refusals: Refusals) -> None:
        self._local = local
        self._tuning = tuning
        self._deliver = deliver  # to a lease (read-dones, heartbeats) or the mailbox
        self._mailbox = mailbox
        self._leases = leases
        self._peers = peers
        self._table = table
        self._push = push
        self._vllm = vllm  # while it serves, vLLM decoders we never admitted may read from us
        self._noisy = noisy
        self._refusals = refusals
        self._wakeup = anyio.Event()
        self._seen_tags = SeenTags()

    def wake(self) -> None:
        self._wakeup.set()

    def poll_once(self) -> list[Notification]:
        """One NIXL progress call: the engine's own messages are handled here (push reads,
        probes, goodbyes; packed ones unpacked, repeated tags dropped); returns the
        notifications meant for callers, in arrival order."""
        notes: list[Notification] = []
        for peer_name, message, relayed in self._arrived():
            self.sort(peer_name, message, notes, relayed=relayed)
        return notes

    def _arrived(self) -> Iterator[tuple[str, bytes, bool]]:
        """(sender, message, relayed) of what arrived at the engine's agent, then at the
        agent that serves vLLM decoders from this process (relayed: only their own
        notifications are taken from it)."""
        agent = self._local.agent
        assert agent is not None
        try:
            notifs = agent.get_notifs()
        except AionixlError as exc:
            self._noisy.log(logging.WARNING, "notifs", "reading notifications failed: %s", exc)
            notifs = {}
        for peer_name, messages in notifs.items():
            for message in messages:
                yield peer_name, message, False
        for peer_name, messages in self._vllm.poll().items():
            for message in messages:
                yield peer_name, message, True

    def sort(self, peer_name: str, message: bytes, notes: list[Notification], *,
             relayed: bool = False) -> None:
        """Handle one incoming message that is the engine's own; append those meant for
        callers to ``notes``. ``relayed``: it reached an agent that serves vLLM decoders
        (here or in a serving process), whose reserved messages are refused: those
        decoders pick their agent names themselves, and one could pass for an admitted
        peer and push, cancel or say goodbye in its name. Nothing a peer sends raises out
        of here: what cannot be handled is refused and counted."""
        if not message.startswith(RESERVED):
            notes.append(Notification(peer_name, message))
            return
        if relayed:
            self._refusals.refuse("relayed", peer_name, "a reserved message at the vLLM serving agent")
            return
        try:
            if message.startswith(MULTI):
                notes += [Notification(peer_name, m) for m in unpack_notifications(message)]
            elif message.startswith(TAGGED):
                tag, messages = unpack_tagged(message)
                if self._seen_tags.first(peer_name, tag):  # a tag seen before: delivered already
                    notes += [Notification(peer_name, m) for m in messages]
            elif not self._push.heard(peer_name, message):  # a push-read message handled
                self._peers.heard(peer_name, message)  # a probe or a goodbye
        except WireError as exc:
            self._refusals.refuse(kind_of(message), peer_name, str(exc))
        except Exception as exc:  # never the end of the drainer, whatever a peer sent
            self._refusals.refuse(kind_of(message), peer_name, f"{type(exc).__name__}: {exc}")

    async def _drain(self) -> bool:
        """One NIXL progress call, as :meth:`poll_once`, delivering as it goes with a loop
        turn every ``SLICE`` messages; whether any was delivered."""
        delivered = False
        budget = SLICE
        notes: list[Notification] = []
        for peer_name, message, relayed in self._arrived():
            self.sort(peer_name, message, notes, relayed=relayed)
            budget -= 1
            for note in notes:  # a packed notification may hold thousands
                self._deliver(note)
                budget -= 1
                if budget <= 0:
                    await anyio.lowlevel.checkpoint()
                    budget = SLICE
            delivered = delivered or bool(notes)
            notes.clear()
            if budget <= 0:
                await anyio.lowlevel.checkpoint()
                budget = SLICE
        return delivered

    async def run(self) -> None:
        """Cadence: every loop turn while transfers are in flight or notifications arrive,
        then backing off (doubling) to ``notification_poll_interval`` while someone waits
        (a ``wait_notification`` caller or a live lease),
        or to ``idle_poll_interval`` when nobody does; with no peers, no waiters and no vLLM
        side channel served it sleeps until woken. Any activity (a transfer, a handshake, a
        new waiter) resets it.
        """
        mailbox, leases = self._mailbox, self._leases
        peers, table, push = self._peers, self._table, self._push
        vllm = self._vllm
        busy_cap = self._tuning.notification_poll_interval
        idle_cap = self._tuning.idle_poll_interval
        probe_every = self._tuning.peer_probe_interval
        next_probe = anyio.current_time() + probe_every
        interval = 0.0
        while True:
            delivered = await self._drain()
            waiting = mailbox.waiting or leases.waiting
            if peers and anyio.current_time() >= next_probe:
                peers.probe()
                next_probe = anyio.current_time() + probe_every
            if delivered or table.records or push.active:
                interval = 0.0
            elif not peers and not waiting and not vllm.serving:
                interval = math.inf  # nobody to hear from: sleep until something happens
            else:
                cap = busy_cap if waiting else idle_cap
                interval = min(cap, max(interval * 2.0, 20e-6))
            if interval == 0.0:
                await anyio.sleep(0)
                continue
            wakeup = self._wakeup = anyio.Event()
            with anyio.move_on_after(interval):
                await wakeup.wait()
            if wakeup.is_set():
                interval = 0.0
