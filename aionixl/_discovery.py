"""Finding engines by name: a registry in etcd, spoken over etcd v3's JSON gateway.

An engine opened with ``discovery=EtcdDiscovery(...)`` puts one key, ``prefix + name``,
holding an :class:`EngineRecord` (JSON), under an etcd lease that a task of the engine keeps
alive; the lease is revoked when the engine closes, and lapses ``ttl`` seconds after a crash,
which deletes the key. Peers resolve names (:meth:`EtcdDiscovery.lookup`,
``Engine.connect_to``) and follow joins and leaves (:meth:`EtcdDiscovery.watch`).

The client is httpx's ``AsyncClient`` (imported here, lazily: the ``etcd`` extra), which runs
on asyncio and trio alike through anyio; the gRPC etcd clients for Python are asyncio-only
or thread-based. Every request has a deadline (``request_timeout``); a watch stream that is
silent for ``watch_idle`` seconds is re-opened (the current keys listed again and compared
with what the watcher has seen, so nothing is missed across a reconnect or a compaction).
No threads.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from contextlib import aclosing, suppress
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

import anyio
import anyio.abc
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ._errors import DiscoveryError
from ._ratelimit import RateLimitedLog

if TYPE_CHECKING:
    import httpx

log = logging.getLogger("aionixl")

#: Events a watch holds for a caller that has not taken them (then the stream waits).
WATCH_BUFFER = 256

#: Retry delays of the keep-alive task after a failure: from this, doubling, up to ttl / 3.
BACKOFF_MIN = 0.25

EventKind = Literal["join", "leave"]


def _httpx() -> Any:
    try:
        import httpx
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError("aionixl.EtcdDiscovery needs httpx: pip install 'aionixl[etcd]'") from exc
    return httpx


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _prefix_end(prefix: bytes) -> bytes:
    """The smallest key above every key starting with ``prefix`` (etcd's range_end)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # every key


@dataclass(frozen=True)
class EngineRecord:
    """What a registered engine says about itself: where to connect, and what a peer may
    want to check before connecting (its regions, memory kind, features)."""

    name: str
    #: The handshake endpoint (``Engine.address``), e.g. ``tcp://10.0.0.5:5555``.
    address: str
    num_blocks: int
    #: Bytes per block, per region (its length is the region count).
    bytes_per_block: tuple[int, ...]
    #: ``"DRAM"`` or ``"VRAM"``.
    mem_type: str
    #: The protocol features the engine announces in its handshake.
    features: tuple[str, ...] = ()

    @property
    def region_count(self) -> int:
        return len(self.bytes_per_block)

    def to_json(self) -> bytes:
        return json.dumps({"name": self.name, "address": self.address, "num_blocks": self.num_blocks,
                           "bytes_per_block": list(self.bytes_per_block), "mem_type": self.mem_type,
                           "features": list(self.features)}, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, data: bytes) -> EngineRecord:
        """Decode a record; ``ValueError`` for anything that is not one."""
        try:
            d = json.loads(data)
            record = cls(str(d["name"]), str(d["address"]), int(d["num_blocks"]),
                         tuple(int(b) for b in d["bytes_per_block"]), str(d["mem_type"]),
                         tuple(str(f) for f in d.get("features", ())))
        except (ValueError, TypeError, KeyError, AttributeError) as exc:
            raise ValueError(f"not an aionixl engine record: {data[:200]!r}") from exc
        return record


@dataclass(frozen=True)
class DiscoveryEvent:
    """An engine joined (``record`` is what it registered) or left (``record`` is None)."""

    name: str
    kind: EventKind
    record: EngineRecord | None = None


@runtime_checkable
class Discovery(Protocol):
    """A registry engines register in and find each other through (``Engine(discovery=)``).

    :class:`EtcdDiscovery` is one; another registry implements these members and needs no
    change of the engine. The engine calls them in this order: :meth:`open` as it opens;
    :meth:`register` once it listens; :meth:`keep_alive` as one of its tasks until it
    closes; :meth:`lookup` for ``Engine.connect_to``; :meth:`close` as it closes. Users call
    :meth:`lookup`, :meth:`records` and :meth:`watch`. ``metrics()`` reports the three counters.
    """

    @property
    def registered(self) -> bool:
        """Whether the engine's registration is believed to be live now."""
        ...

    @property
    def registrations(self) -> int:
        """Registrations made (1 after a clean start; more after the registry lost one)."""
        ...

    @property
    def keepalive_failures(self) -> int:
        """Keep-alive or re-registration attempts that failed."""
        ...

    def open(self, owner: str, task_group: anyio.abc.TaskGroup) -> None:
        """Start, for the engine named ``owner``: background work (watches) goes into
        ``task_group``, which ends as the engine closes. ``RuntimeError`` when used already."""
        ...

    async def register(self, record: EngineRecord) -> None:
        """Register ``record`` (its ``address`` is the endpoint the engine bound; the
        registry registers the one peers should use). ``DiscoveryError`` when the name is
        taken by a live engine or the registry does not answer."""
        ...

    async def keep_alive(self) -> None:
        """Keep the registration alive until cancelled, registering again if the registry
        lost it; failures are retried (logged and counted), never raised."""
        ...

    async def lookup(self, name: str, timeout: float = 10.0) -> EngineRecord:
        """The record of the engine named ``name``, waiting up to ``timeout`` seconds for it
        to register; ``DiscoveryError`` when it did not."""
        ...

    async def records(self) -> dict[str, EngineRecord]:
        """Every engine registered now, by name."""
        ...

    def watch(self, *, existing: bool = True) -> AsyncIterator[DiscoveryEvent]:
        """Joins and leaves of engines as they happen (first a join for each one registered
        now, with ``existing``); it ends when the registry closes."""
        ...

    async def close(self, deadline: float) -> None:
        """Withdraw the registration and end every watch, by ``deadline`` (anyio's clock);
        never raises."""
        ...


class EtcdDiscovery:
    """Engines register and find each other by name in etcd (v3, through its JSON gateway).

    ``endpoints`` are etcd client URLs (``["http://127.0.0.1:2379"]``; requests go to the
    first that answers). Keys are ``prefix + name``. ``ttl`` (seconds, rounded up to whole
    seconds; etcd raises values under its minimum, 2 s by default) is how long a crashed
    engine's key outlives it. ``request_timeout`` bounds every request to etcd;
    ``watch_idle`` is how long a watch stream may stay silent before it is re-opened.
    ``advertise``: the host peers should connect to (``"10.0.0.5"``) or a whole endpoint
    (``"tcp://10.0.0.5:5555"``); registered in place of the bound host, which an engine
    listening on a wildcard (``tcp://0.0.0.0:5555``) must give (it is refused otherwise:
    peers could not connect to the wildcard).

    Pass it as ``Engine(..., discovery=...)``: one engine per instance. It can also be used
    on its own, for tools that only look names up or watch: ``async with EtcdDiscovery(...)``.
    """

    def __init__(self, endpoints: Sequence[str], *, prefix: str = "/aionixl/", ttl: float = 10.0,
                 request_timeout: float = 3.0, watch_idle: float = 30.0,
                 advertise: str | None = None) -> None:
        if isinstance(endpoints, str) or not endpoints or \
                not all(isinstance(e, str) and e.startswith(("http://", "https://")) for e in endpoints):
            raise ValueError("endpoints must be a non-empty list of etcd URLs such as 'http://127.0.0.1:2379'")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError("prefix must be a non-empty str")
        for value, what in ((ttl, "ttl"), (request_timeout, "request_timeout"), (watch_idle, "watch_idle")):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value <= 0:
                raise ValueError(f"{what} must be a positive number of seconds")
        if advertise is not None and (not isinstance(advertise, str) or not advertise.strip()
                                      or any(c.isspace() for c in advertise)):
            raise ValueError("advertise must be a host ('10.0.0.5') or an endpoint ('tcp://10.0.0.5:5555')")
        _httpx()  # the etcd extra is missing: say so now, not when the engine opens
        self._advertise = advertise
        self._endpoints = [e.rstrip("/") for e in endpoints]
        self._current = 0  # the endpoint that answered last
        self._prefix = prefix.encode()
        self._ttl = max(1, math.ceil(ttl))
        self._timeout = float(request_timeout)
        self._watch_idle = float(watch_idle)
        self._client: httpx.AsyncClient | None = None
        self._closed = False
        self._owner: str | None = None  # the engine that opened it, if any
        self._lease: int | None = None
        self._record: EngineRecord | None = None
        self._watch_scopes: set[anyio.CancelScope] = set()
        self._tg: anyio.abc.TaskGroup | None = None  # where watch tasks run
        self._own_tg: anyio.abc.TaskGroup | None = None  # used on its own: ours
        #: Leases granted and keys put (1 after a clean start; more after re-registrations).
        self.registrations = 0
        #: Failed keep-alive or re-registration attempts (etcd unreachable, the name taken).
        self.keepalive_failures = 0
        #: Watch streams re-opened after an error or a silence of ``watch_idle``.
        self.watch_reconnects = 0
        self._noisy = RateLimitedLog(log)

    def __repr__(self) -> str:
        return f"EtcdDiscovery({self._endpoints!r}, prefix={self._prefix.decode()!r}, ttl={self._ttl})"

    @property
    def endpoints(self) -> list[str]:
        return list(self._endpoints)

    @property
    def prefix(self) -> str:
        return self._prefix.decode()

    @property
    def ttl(self) -> int:
        return self._ttl

    @property
    def registered(self) -> bool:
        """True while this engine's key is believed to be in etcd (its lease alive)."""
        return self._lease is not None

    def advertised(self, bound: str) -> str:
        """The address to register for an engine bound at ``bound`` (``tcp://host:port``):
        ``advertise`` where given (a host keeps the bound port), else ``bound`` itself;
        ``DiscoveryError`` for a wildcard bound host with nothing to advertise."""
        scheme, _, rest = bound.rpartition("://")
        host, _, port = rest.rpartition(":")
        if self._advertise is not None:
            if "://" in self._advertise:
                return self._advertise
            return f"{scheme or 'tcp'}://{self._advertise}:{port}"
        if host in ("0.0.0.0", "*", "[::]", "::"):
            raise DiscoveryError(f"the engine listens on the wildcard {bound}, which peers cannot "
                                 "connect to: give EtcdDiscovery(..., advertise='host') the address they can")
        return bound

    # ---- opening and closing ----------------------------------------------------------------

    async def __aenter__(self) -> EtcdDiscovery:
        tg = anyio.create_task_group()
        await tg.__aenter__()
        try:
            self.open("", tg)
        except BaseException:
            await tg.__aexit__(None, None, None)
            raise
        self._own_tg = tg
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        tg, self._own_tg = self._own_tg, None
        try:
            await self.close(anyio.current_time() + self._timeout)
        finally:
            if tg is not None:
                tg.cancel_scope.cancel()
                await tg.__aexit__(None, None, None)

    def open(self, owner: str, task_group: anyio.abc.TaskGroup) -> None:
        """Start using it (for the engine ``owner``; "" on its own): requests from now on,
        watch tasks in ``task_group``."""
        if self._client is not None or self._closed:
            raise RuntimeError(f"{self!r} is in use already (one engine per EtcdDiscovery, opened once)")
        hx = _httpx()
        self._owner = owner or None
        self._tg = task_group
        self._client = hx.AsyncClient(timeout=hx.Timeout(self._timeout), trust_env=False)

    async def close(self, deadline: float) -> None:
        """Revoke the lease (its key goes at once), end every watch, close the client; each
        bounded by ``deadline`` (anyio's clock). Never raises for etcd's sake."""
        self._closed = True
        self._tg = None
        for scope in list(self._watch_scopes):
            scope.cancel()
        client, self._client = self._client, None
        if client is None:
            return
        # Half of what is left of the engine's close at most: the rest is for NIXL.
        now = anyio.current_time()
        deadline = now + min(self._timeout, max(0.0, deadline - now) / 2)
        with anyio.CancelScope(shield=True):
            if self._lease is not None:
                lease, self._lease = self._lease, None
                with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                    try:
                        await self._post("/v3/lease/revoke", {"ID": str(lease)}, client=client,
                                         deadline=deadline)
                    except DiscoveryError as exc:
                        log.warning("engine %r: could not revoke its etcd lease (its key lapses within "
                                    "%d s): %s", self._owner, self._ttl, exc)
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                await client.aclose()

    # ---- requests ------------------------------------------------------------------------------

    async def _post(self, path: str, body: Mapping[str, Any], *, client: httpx.AsyncClient | None = None,
                    deadline: float | None = None, ok_codes: tuple[int, ...] = ()) -> dict[str, Any]:
        """POST ``body`` to etcd, trying each endpoint in turn, all within ``deadline``
        (default: ``request_timeout`` from now). ``DiscoveryError`` for no answer in time or
        an error answer (except gRPC codes in ``ok_codes``: their body is returned)."""
        client = client if client is not None else self._client
        if client is None:
            raise DiscoveryError(f"{self!r} is closed" if self._closed else f"{self!r} is not open")
        hx = _httpx()
        if deadline is None:
            deadline = anyio.current_time() + self._timeout
        problems: list[str] = []
        with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
            for i in range(len(self._endpoints)):
                at = (self._current + i) % len(self._endpoints)
                url = self._endpoints[at] + path
                try:
                    response = await client.post(url, json=body)
                    reply = response.json()
                except (hx.HTTPError, OSError, ValueError) as exc:
                    problems.append(f"{url}: {type(exc).__name__}: {exc}")
                    continue
                self._current = at
                code = reply.get("code", 0) if isinstance(reply, dict) else None
                if not isinstance(reply, dict) or (response.status_code != 200 and code not in ok_codes):
                    raise DiscoveryError(f"etcd {url} answered {response.status_code}: "
                                         f"{reply.get('message') if isinstance(reply, dict) else reply!r}")
                return reply
        if not problems:
            problems.append(f"no answer within {self._timeout:g} s")
        raise DiscoveryError(f"etcd unreachable ({'; '.join(problems)})")

    def _key(self, name: str) -> bytes:
        return self._prefix + name.encode()

    # ---- the engine's registration ------------------------------------------------------------

    async def register(self, record: EngineRecord) -> None:
        """Grant a lease and put ``record`` under it, at its :meth:`advertised` address,
        unless a live engine holds the name (``DiscoveryError``; so does etcd not answering)."""
        await self._register(replace(record, address=self.advertised(record.address)))

    async def _register(self, record: EngineRecord) -> None:
        reply = await self._post("/v3/lease/grant", {"TTL": self._ttl})
        lease = int(reply["ID"])
        key = _b64(self._key(record.name))
        try:
            reply = await self._post("/v3/kv/txn", {
                "compare": [{"key": key, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                "success": [{"request_put": {"key": key, "value": _b64(record.to_json()),
                                             "lease": str(lease)}}],
                "failure": [{"request_range": {"key": key}}],
            })
            if not reply.get("succeeded", False):
                holder = "?"
                for r in reply.get("responses", ()):
                    for kv in r.get("response_range", {}).get("kvs", ()):
                        with suppress(ValueError, KeyError):
                            holder = EngineRecord.from_json(_unb64(kv["value"])).address
                raise DiscoveryError(
                    f"an engine named {record.name!r} is registered in etcd already (at {holder}); names "
                    f"must be unique (a crashed engine's name is free again {self._ttl} s after its last "
                    f"keep-alive, or after etcd came back if etcd restarted since)")
        except BaseException:
            with anyio.CancelScope(shield=True), suppress(DiscoveryError):
                await self._post("/v3/lease/revoke", {"ID": str(lease)})
            raise
        self._lease = lease
        self._record = record
        self.registrations += 1

    async def _keepalive_once(self) -> bool:
        """Refresh the lease; False when etcd no longer knows it (its key is gone)."""
        assert self._lease is not None
        # Within a third of the ttl at most, so that a hung request leaves time to retry.
        deadline = anyio.current_time() + min(self._timeout, max(self._ttl / 3, 0.5))
        reply = await self._post("/v3/lease/keepalive", {"ID": str(self._lease)}, deadline=deadline)
        result = reply.get("result", reply)
        return int(result.get("TTL", 0)) > 0

    async def keep_alive(self) -> None:
        """Keep the registration alive, forever (a task of the engine's): refresh the lease
        every ttl / 3; on failure retry with backoff, logged (rate-limited) and counted; when
        the lease is gone (etcd lost it, or it lapsed while etcd was out of reach) register
        again under a new one."""
        record = self._record
        assert record is not None
        interval = self._ttl / 3
        backoff = BACKOFF_MIN
        delay = interval
        while True:
            await anyio.sleep(delay)
            try:
                if self._lease is None:
                    await self._register(record)
                    log.info("engine %r registered in etcd again (lease %x)", record.name, self._lease)
                elif not await self._keepalive_once():
                    log.warning("engine %r: etcd no longer knows its lease; registering again", record.name)
                    self._lease = None
                    delay = 0.0
                    continue
            except DiscoveryError as exc:
                self.keepalive_failures += 1
                self._noisy.log(logging.WARNING, "discovery-keepalive",
                          "engine %r: etcd keep-alive failed (%d so far; still serving peers, retrying "
                          "in %.2f s): %s", record.name, self.keepalive_failures, backoff, exc)
                delay, backoff = backoff, min(backoff * 2, interval)
                continue
            delay, backoff = interval, BACKOFF_MIN

    # ---- looking up ------------------------------------------------------------------------------

    async def _range(self) -> tuple[dict[str, EngineRecord], int]:
        """Every record under the prefix, and the revision they were read at."""
        reply = await self._post("/v3/kv/range", {"key": _b64(self._prefix),
                                                   "range_end": _b64(_prefix_end(self._prefix))})
        found: dict[str, EngineRecord] = {}
        for kv in reply.get("kvs", ()):
            record = self._decode(kv)
            if record is not None:
                found[record.name] = record
        return found, int(reply.get("header", {}).get("revision", 0))

    def _decode(self, kv: Mapping[str, Any]) -> EngineRecord | None:
        try:
            return EngineRecord.from_json(_unb64(kv.get("value", "")))
        except ValueError as exc:
            log.warning("etcd key %r under %r holds no engine record: %s",
                        _unb64(kv.get("key", "")), self.prefix, exc)
            return None

    async def records(self) -> dict[str, EngineRecord]:
        """Every engine registered now, by name. ``DiscoveryError`` when etcd does not
        answer within ``request_timeout``."""
        return (await self._range())[0]

    async def lookup(self, name: str, timeout: float = 10.0) -> EngineRecord:
        """The record of the engine named ``name``, waiting up to ``timeout`` seconds for it
        to register; ``DiscoveryError`` when it did not (or etcd never answered)."""
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty str")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout >= 0:
            raise ValueError("timeout must be a number of seconds >= 0")
        deadline = anyio.current_time() + timeout
        key = _b64(self._key(name))
        pause = 0.02
        last: DiscoveryError | None = None
        while True:
            left = deadline - anyio.current_time()
            try:
                reply = await self._post("/v3/kv/range", {"key": key},
                                         deadline=anyio.current_time() + min(self._timeout, max(left, 0.1)))
            except DiscoveryError as exc:
                last = exc
            else:
                last = None
                for kv in reply.get("kvs", ()):
                    record = self._decode(kv)
                    if record is not None:
                        return record
            left = deadline - anyio.current_time()
            if left <= 0:
                if last is not None:
                    raise DiscoveryError(f"cannot look up engine {name!r}: {last}") from last
                raise DiscoveryError(f"no engine named {name!r} registered in etcd under {self.prefix!r} "
                                     f"within {timeout:g} s")
            await anyio.sleep(min(pause, left))
            pause = min(pause * 2, 0.5)

    # ---- watching -----------------------------------------------------------------------------

    def watch(self, *, existing: bool = True) -> Watch:
        """Joins and leaves of engines, as they happen: an async iterator of
        :class:`DiscoveryEvent`.

        With ``existing`` (the default) it first yields a join for every engine registered
        now. The etcd watch stream is read by a task of the engine's task group (or of this
        discovery's own, used on its own), and the iterator ends when the engine (or the
        discovery) closes, or when the caller leaves it: ``async with discovery.watch() as
        events:`` (or ``contextlib.aclosing``) stops that task at once; a caller that only
        breaks out stops it once the iterator is dropped. When the stream breaks (etcd
        restarted, a silence of ``watch_idle``) it is re-opened, and what changed meanwhile is
        reported against what this watcher has seen: nothing is missed, and a name whose
        record changed leaves before it joins again. ``RuntimeError`` before the engine opened."""
        if self._tg is None and not self._closed:
            raise RuntimeError(f"{self!r} is not open: watch from an open engine, or in "
                               "`async with EtcdDiscovery(...)`")
        send, receive = anyio.create_memory_object_stream[DiscoveryEvent](WATCH_BUFFER)
        scope = anyio.CancelScope()
        if self._tg is None:  # closed: an iterator that has ended
            send.close()
        else:
            self._watch_scopes.add(scope)
            self._tg.start_soon(self._produce, send, scope, existing)
        return Watch(receive, scope)

    async def _produce(self, send: MemoryObjectSendStream[DiscoveryEvent], scope: anyio.CancelScope,
                       existing: bool) -> None:
        """The task behind one :class:`Watch`: events into ``send`` until cancelled (the
        watch was left, or the engine closes) or the watcher went away."""
        try:
            with send, scope:
                async with aclosing(self._events(existing)) as events:
                    async for event in events:
                        await send.send(event)
        except anyio.BrokenResourceError:
            pass  # the caller left
        finally:
            self._watch_scopes.discard(scope)

    async def _events(self, existing: bool) -> AsyncGenerator[DiscoveryEvent, None]:
        seen: dict[str, EngineRecord] = {}
        first = True
        pause = BACKOFF_MIN
        while True:
            try:
                current, revision = await self._range()
            except DiscoveryError as exc:
                log.warning("etcd watch: listing %r failed (retrying in %.2f s): %s", self.prefix, pause, exc)
                await anyio.sleep(pause)
                pause = min(pause * 2, 5.0)
                continue
            pause = BACKOFF_MIN
            for name in [n for n in seen if n not in current or current[n] != seen[n]]:
                del seen[name]
                yield DiscoveryEvent(name, "leave")
            for name, record in current.items():
                if name not in seen:
                    seen[name] = record
                    if existing or not first:
                        yield DiscoveryEvent(name, "join", record)
            first = False
            async with aclosing(self._stream(revision + 1, seen)) as stream:
                async for event in stream:
                    yield event
            self.watch_reconnects += 1

    async def _stream(self, start: int,
                      seen: dict[str, EngineRecord]) -> AsyncGenerator[DiscoveryEvent, None]:
        """Events from one watch stream from revision ``start``, updating ``seen``; ends when
        the stream breaks, falls silent for ``watch_idle`` or etcd cancels it."""
        hx = _httpx()
        client = self._client
        if client is None:
            await anyio.sleep_forever()  # closing: the task is about to be cancelled
        assert client is not None
        url = self._endpoints[self._current] + "/v3/watch"
        body = {"create_request": {"key": _b64(self._prefix), "range_end": _b64(_prefix_end(self._prefix)),
                                   "start_revision": str(start)}}
        timeout = hx.Timeout(self._timeout, read=self._watch_idle)
        response: httpx.Response | None = None
        lines: Any = None
        try:
            request = client.build_request("POST", url, json=body, timeout=timeout)
            response = await client.send(request, stream=True)
            lines = response.aiter_lines()
            async for line in lines:
                if not line.strip():
                    continue
                try:
                    result = json.loads(line).get("result", {})
                except (ValueError, AttributeError):
                    log.warning("etcd watch: unreadable line %r", line[:200])
                    return
                if result.get("canceled") or result.get("compact_revision"):
                    return  # re-listed by the caller
                for ev in result.get("events", ()):
                    kv = ev.get("kv", {})
                    name = _unb64(kv.get("key", ""))[len(self._prefix):].decode(errors="replace")
                    if ev.get("type") == "DELETE":
                        if seen.pop(name, None) is not None:
                            yield DiscoveryEvent(name, "leave")
                        continue
                    record = self._decode(kv)
                    if record is None or seen.get(name) == record:
                        continue
                    if name in seen:
                        del seen[name]
                        yield DiscoveryEvent(name, "leave")
                    seen[name] = record
                    yield DiscoveryEvent(name, "join", record)
        except (hx.HTTPError, OSError) as exc:
            # A silence of watch_idle ends here too (a read timeout): re-listed, re-opened.
            log.debug("etcd watch stream ended (%s: %s); re-opening", type(exc).__name__, exc)
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(self._timeout):
                if lines is not None:
                    await lines.aclose()
                if response is not None:
                    await response.aclose()


class Watch:
    """The async iterator :meth:`EtcdDiscovery.watch` returns (also an async context
    manager; ``aclose()`` stops it)."""

    def __init__(self, receive: MemoryObjectReceiveStream[DiscoveryEvent], scope: anyio.CancelScope) -> None:
        self._receive = receive
        self._scope = scope

    def __aiter__(self) -> Watch:
        return self

    async def __anext__(self) -> DiscoveryEvent:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise StopAsyncIteration from None

    async def aclose(self) -> None:
        """Stop watching (idempotent)."""
        self._stop()
        await anyio.lowlevel.checkpoint()

    def _stop(self) -> None:
        self._receive.close()
        self._scope.cancel()

    async def __aenter__(self) -> Watch:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        # A caller that broke out and dropped the iterator: stop its task (both calls are
        # synchronous and only schedule the task's wake-up).
        with suppress(Exception):
            self._stop()
