"""What the server dropped on its own: with ``eviction = "server"`` the Valkey tier learns
the blocks a ``maxmemory-policy`` evicted or a TTL expired from keyspace notifications.

Keyspace notifications are per node: :class:`ServerDrops` subscribes on every primary (one
node for a standalone server) to ``__keyspace@0__:PREFIX/<digest>/*``, the namespace's keys
alone, and queues the keys whose event is ``evicted`` or ``expired``. The server must publish
them: :func:`enable_notifications` adds ``K``, ``e`` and ``x`` to ``notify-keyspace-events``
(keeping the flags already set) with ``CONFIG SET``, at start-up and again after each
reconnection (a restarted node forgets a ``CONFIG SET``).

Notifications are fire and forget: while a node is unreachable its drops are not heard. A
listener that loses its node reports it (``valkey_notifications_lost``), reconnects with a
growing pause, enables the notifications again, and then lists the namespace (a ``SCAN`` of
every primary) so that the tier drops whatever it still lists and the server no longer holds
(:meth:`ServerDrops.take`).

A cluster's primaries change: a failover promotes a replica at another address. With
``primaries`` (what the cluster says its primaries are now), a listener whose node is no
longer a primary ends, and every primary nobody listens to gets a listener of its own, which
lists the namespace once subscribed (``valkey_notifications_moved``).

Threads: one daemon thread per primary listens; :meth:`ServerDrops.take` runs on the
scheduler thread; they share only a ``deque`` (appends and pops are atomic). The listeners'
table is guarded by a lock.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import structlog

from kvhex.adapters.storage.valkey._client import safe_text
from kvhex.domain.keys import OffloadKey
from kvhex.errors import TierUnavailable

log = structlog.get_logger(__name__)

FLAGS = "Kex"
"""Keyspace channel (``K``), evicted (``e``) and expired (``x``) events."""
DROPS = frozenset((b"evicted", b"expired"))
WAIT_S = 0.2
"""How long a listener waits for a message before looking whether it should stop."""
MAX_PAUSE_S = 2.0
"""The longest pause between two reconnection attempts."""

Listed = frozenset[OffloadKey]
"""A listing of the namespace taken after a reconnection."""


def enable_notifications(client: Any, where: str, *, tier: str) -> None:
    """Make the node ``client`` talks to publish evicted and expired keyspace events.

    Raises:
        TierUnavailable: the node refuses ``CONFIG`` (renamed, or not in the ACL user's
            commands), at ``eviction``: the operator sets ``notify-keyspace-events`` to
            include ``Kex`` or lets kvhex's user run ``CONFIG``.
        Exception: the node failed otherwise (not reachable).
    """
    import valkey

    try:
        current = str(client.config_get("notify-keyspace-events").get("notify-keyspace-events"))
        if current == "None":
            current = ""
        have = set(current) | (set("ex") if "A" in current else set())
        missing = "".join(f for f in FLAGS if f not in have)
        if missing:
            client.config_set("notify-keyspace-events", current + missing)
    except valkey.ResponseError as exc:
        raise TierUnavailable(
            f'eviction = "server" needs keyspace notifications for evicted and expired keys, '
            f"and {where} refused CONFIG ({safe_text(exc)}): set notify-keyspace-events to "
            f'include "{FLAGS}" on every primary and allow the user CONFIG GET/SET, or use '
            'eviction = "kvhex"',
            tier=tier,
            option="eviction",
        ) from exc


Node = tuple[str, int]


class ServerDrops:
    """Listens on ``nodes`` for the namespace's keys the server evicted or expired.

    Args:
        nodes: (host, port) of every primary.
        kwargs: valkey-py client arguments (credentials, TLS, timeouts).
        prefix: the namespace's key prefix (``PREFIX/<digest>/``).
        key_of: the block key of a Valkey key, ``None`` for others (``config.json``).
        listing: lists the namespace now (run on a listener thread after a reconnection).
        primaries: the cluster's primaries now (asked on a listener thread while its node
            is lost); ``None`` for a standalone server, whose address does not move.
        tier: the tier's name, for errors and logs.

    Raises:
        TierUnavailable: a node refuses ``CONFIG`` (at ``eviction``).
        Exception: a node does not answer (the tier names it).
    """

    def __init__(
        self,
        nodes: Sequence[Node],
        kwargs: dict[str, Any],
        prefix: bytes,
        key_of: Callable[[bytes], OffloadKey | None],
        listing: Callable[[], set[OffloadKey]],
        *,
        primaries: Callable[[], list[Node]] | None = None,
        tier: str,
    ) -> None:
        escaped = b"".join(b"\\" + bytes([c]) if c in b"*?[]\\" else bytes([c]) for c in prefix)
        self._pattern = b"__keyspace@0__:" + escaped + b"*"
        self._channel = len(b"__keyspace@0__:")
        self._kwargs = kwargs
        self._key_of = key_of
        self._listing = listing
        self._primaries = primaries
        self._tier = tier
        self._queue: deque[OffloadKey | Listed] = deque()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        # each node's client, kept while its pubsub lives: a client closed or collected
        # disconnects its pool, the pubsub's connection too
        self._clients: dict[Node, Any] = {}
        self._threads: dict[Node, threading.Thread] = {}
        self.gaps = 0
        """Times a listener lost its node (its drops meanwhile found by a listing)."""
        subscribed = []
        try:
            for host, port in nodes:
                subscribed.append((host, port, self._subscribe(host, port)))
        except BaseException:
            for _, _, pubsub in subscribed:
                pubsub.close()
            self._close_clients()
            raise
        for host, port, pubsub in subscribed:
            self._launch(host, port, pubsub)

    @property
    def nodes(self) -> list[Node]:
        """The nodes listened to now."""
        with self._lock:
            return sorted(self._threads)

    @property
    def waiting(self) -> bool:
        """(Any thread.) Whether drops or listings wait for :meth:`take`."""
        return bool(self._queue)

    def take(self) -> tuple[list[OffloadKey], list[Listed]]:
        """(Scheduler thread.) The keys dropped since the last call, and the listings taken
        after reconnections since (the tier drops what they lack)."""
        keys: list[OffloadKey] = []
        listings: list[Listed] = []
        queue = self._queue
        while queue:
            item = queue.popleft()
            if isinstance(item, frozenset):
                listings.append(item)
            else:
                keys.append(item)
        return keys, listings

    def close(self) -> None:
        """Stop the listeners (each within :data:`WAIT_S`); idempotent."""
        self._stop.set()
        with self._lock:
            threads = list(self._threads.values())
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2 * WAIT_S + 1)
        self._close_clients()

    def _close_clients(self) -> None:
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()

    # -- listener threads ----------------------------------------------------------------
    def _launch(self, host: str, port: int, pubsub: Any) -> None:
        """A listener thread for ``host:port`` (``pubsub`` ``None``: it subscribes first)."""
        thread = threading.Thread(
            target=self._listen,
            args=(host, port, pubsub),
            name=f"kvhex-{self._tier}-drops-{port}",
            daemon=True,
        )
        with self._lock:
            if (host, port) in self._threads or self._stop.is_set():
                return
            self._threads[host, port] = thread
        thread.start()

    def _subscribe(self, host: str, port: int) -> Any:
        """A pubsub on ``host:port`` whose subscription is confirmed, notifications on."""
        import valkey

        lib: Any = valkey
        with self._lock:
            old = self._clients.pop((host, port), None)
        if old is not None:
            old.close()
        client = lib.Valkey(host=host, port=port, **self._kwargs)
        try:
            enable_notifications(client, f"{host}:{port}", tier=self._tier)
            pubsub = client.pubsub()
            pubsub.psubscribe(self._pattern)
            # the confirmation: once read, nothing published later is missed
            for _ in range(50):
                if pubsub.get_message(timeout=WAIT_S) is not None:
                    break
            else:
                raise TimeoutError(f"{host}:{port} did not confirm the subscription")
        except BaseException:
            client.close()
            raise
        with self._lock:
            self._clients[host, port] = client
        return pubsub

    def _listen(self, host: str, port: int, pubsub: Any) -> None:
        stop, queue, key_of, cut = self._stop, self._queue, self._key_of, self._channel
        if pubsub is None:  # a primary that a failover made: subscribe, then list
            pubsub = self._resubscribe(host, port)
        while pubsub is not None and not stop.is_set():
            try:
                message = pubsub.get_message(timeout=WAIT_S)
            except Exception as exc:
                pubsub.close()
                pubsub = self._reconnect(host, port, exc)
                continue
            if message is None:
                continue
            if message["type"] == "psubscribe":  # valkey-py subscribed again on its own
                pubsub.close()
                pubsub = self._reconnect(host, port, None)
                continue
            if message["type"] == "pmessage" and message["data"] in DROPS:
                key = key_of(message["channel"][cut:])
                if key is not None:
                    queue.append(key)
        if pubsub is not None:
            pubsub.close()
        self._retire(host, port)

    def _reconnect(self, host: str, port: int, exc: BaseException | None) -> Any:
        """After a lost connection: :meth:`_resubscribe`, reported and counted."""
        self.gaps += 1
        cause = "reconnected" if exc is None else f"{type(exc).__name__}: {safe_text(exc)}"
        node = f"{host}:{port}"
        log.warning("valkey_notifications_lost", tier=self._tier, node=node, error=cause)
        return self._resubscribe(host, port)

    def _resubscribe(self, host: str, port: int) -> Any:
        """Subscribe on the node again (pausing longer after each failure) and queue a
        listing of the namespace; ``None`` once stopped, or once the cluster says the node
        is no longer a primary (then every primary nobody listens to gets a listener)."""
        pause = WAIT_S
        while not self._stop.wait(pause):
            if self._moved(host, port):
                return None
            try:
                pubsub = self._subscribe(host, port)
                listed = frozenset(self._listing())
            except Exception as again:
                pause = min(2 * pause, MAX_PAUSE_S)
                log.debug("valkey_reconnect_failed", tier=self._tier, error=safe_text(again))
                continue
            self._queue.append(listed)
            log.info("valkey_notifications_resumed", tier=self._tier, node=f"{host}:{port}")
            return pubsub
        return None

    def _moved(self, host: str, port: int) -> bool:
        """Whether the cluster says ``host:port`` is no longer a primary and names one
        nobody listens to (a promoted replica); if so, listeners for those are launched.
        A node marked failed before its replica is promoted is tried again."""
        if self._primaries is None:
            return False
        try:
            now = self._primaries()
        except Exception as exc:  # no node answers: keep trying this one
            log.debug("valkey_topology_failed", tier=self._tier, error=safe_text(exc))
            return False
        if not now or (host, port) in now:
            return False
        with self._lock:
            new = [node for node in now if node not in self._threads]
        if not new:  # marked failed, its replica not promoted yet (or none): keep trying
            return False
        log.warning(
            "valkey_notifications_moved",
            tier=self._tier,
            node=f"{host}:{port}",
            primaries=[f"{h}:{p}" for h, p in now],
        )
        for new_host, new_port in new:
            self._launch(new_host, new_port, None)
        return True

    def _retire(self, host: str, port: int) -> None:
        with self._lock:
            if self._threads.get((host, port)) is threading.current_thread():
                del self._threads[host, port]
            client = self._clients.pop((host, port), None)
        if client is not None:
            client.close()
