"""The notification drainer: reads NIXL notifications, hands them out, probes peers.

It is also what keeps NIXL progressing while nothing else calls into it (with NIXL's
progress thread off, a target makes progress only when it polls), so its cadence is the
engine's idle cost: every loop turn while transfers are in flight or notifications
arrive, backing off while nothing happens, asleep with no peers and no waiters.
"""

from __future__ import annotations

import logging
import math

import anyio

from ._config import EngineConfig
from ._errors import AionixlError
from ._notifications import Mailbox, Notification
from ._peers import MULTI, RESERVED, TAGGED, PeerTable, SeenTags, unpack_notifications, unpack_tagged
from ._ratelimit import RateLimitedLog
from ._transfers import Transfers


class NotificationDrainer:
    """One task per engine; :meth:`wake` ends its current back-off sleep."""

    def __init__(self, config: EngineConfig, mailbox: Mailbox, peers: PeerTable,
                 transfers: Transfers, noisy: RateLimitedLog) -> None:
        self._config = config
        self._mailbox = mailbox
        self._peers = peers
        self._transfers = transfers
        self._noisy = noisy
        self._wakeup = anyio.Event()
        self._seen_tags = SeenTags()

    def wake(self) -> None:
        self._wakeup.set()

    async def run(self) -> None:
        """Cadence: every loop turn while transfers are in flight or notifications arrive,
        then backing off (doubling) to ``notification_poll_interval`` while someone waits,
        or to ``idle_poll_interval`` when nobody does; with no peers and no waiters it
        sleeps until woken. Any activity (a transfer, a handshake, a new waiter) resets it.
        """
        agent = self._peers.agent
        assert agent is not None
        mailbox, peers, transfers = self._mailbox, self._peers, self._transfers
        busy_cap = self._config.notification_poll_interval
        idle_cap = self._config.idle_poll_interval
        probe_every = self._config.peer_probe_interval
        next_probe = anyio.current_time() + probe_every
        push = peers.push
        interval = 0.0
        while True:
            try:
                notifs = agent.get_notifs()
            except AionixlError as exc:
                self._noisy.log(logging.WARNING, "notifs", "reading notifications failed: %s", exc)
                notifs = {}
            delivered = False
            for peer_name, messages in notifs.items():
                for message in messages:
                    if not message.startswith(RESERVED):
                        unpacked = [message]
                    elif message.startswith(MULTI):
                        unpacked = unpack_notifications(message)
                    elif message.startswith(TAGGED):
                        tagged = unpack_tagged(message)  # a tag seen before: delivered already
                        unpacked = tagged[1] if tagged is not None \
                            and self._seen_tags.first(peer_name, tagged[0]) else []
                    else:
                        peers.heard(peer_name, message)
                        continue
                    for one in unpacked:
                        mailbox.deliver(Notification(peer_name, one))
                        delivered = True
            if peers and anyio.current_time() >= next_probe:
                peers.probe()
                next_probe = anyio.current_time() + probe_every
            if delivered or transfers.inflight or (push is not None and push.active):
                interval = 0.0
            elif not peers and not mailbox.waiting:
                interval = math.inf  # nobody to hear from: sleep until something happens
            else:
                cap = busy_cap if mailbox.waiting else idle_cap
                interval = min(cap, max(interval * 2.0, 20e-6))
            if interval == 0.0:
                await anyio.sleep(0)
                continue
            wakeup = self._wakeup = anyio.Event()
            with anyio.move_on_after(interval):
                await wakeup.wait()
            if wakeup.is_set():
                interval = 0.0
