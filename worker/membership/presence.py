"""The presence thread: one subscription that lives exactly as long as the worker's process.

A worker keeps a subscription to its own sharded Pub/Sub channel (`Keys.presence`) on the
server that owns the job's slot. Nothing is ever published on it: what counts is that the
subscription exists. When the process dies (SIGKILL, the OOM killer, a segfault) the
kernel closes its sockets and Redis drops the subscription at once, so the leader, which
counts the channel's subscribers a few times a second, knows within a fraction of a
second, where the heartbeat timeout would take seconds.

A process forked from the worker (a DataLoader's workers, by default on Linux) inherits the
subscription's socket; were the worker killed, such a child would hold the subscription
until it noticed and exited itself (a DataLoader worker checks every 5 s). So a forked
child closes its copy at once (`os.register_at_fork`); the worker's own stays open.

A connection that drops while the process lives (a network blip, a proxy restarting,
Redis restarting or failing over) is taken up again at once, with a short backoff: the
leader waits `disconnect_grace` for it to come back before it fails the worker. A server
that refuses the subscription (an ACL from before cohort watched connections, a proxy
without Pub/Sub) leaves the worker to be judged by its heartbeats alone; that is said once,
and the subscription asked for again every REFUSED_RETRY s (an ACL applied again later).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import weakref
from typing import Any

import redis

from cohort.events.connection import UNAVAILABLE, Client, backoff

LISTEN = 0.2
"""Seconds each wait for the subscription's traffic lasts: how soon a stop is noticed."""
RETRY_BASE, RETRY_CAP = 0.01, 0.1
"""The backoff between tries to take the subscription up again: well inside any grace."""
REFUSED_RETRY = 60.0
"""Seconds between tries while Redis refuses the subscription (an ACL applied again later)."""
DROPPED: tuple[type[BaseException], ...] = (*UNAVAILABLE, OSError)
"""What a connection that went away raises (UNAVAILABLE, or the socket's own error)."""


class PresenceThread:
    """Holds `channel`'s subscription on `conn` until `stop` is set."""

    def __init__(
        self, conn: Client, channel: str, stop: threading.Event, log: logging.Logger
    ) -> None:
        self.conn = conn
        self.channel = channel
        self._stop = stop
        self.log = log
        self.subscribed = threading.Event()
        """Set while the subscription is in place (tests and the worker's log read it)."""
        self.refused: str | None = None
        """Why Redis refused the subscription, if it did: then only heartbeats tell."""
        self._pubsub: Any = None
        _HOLDERS.add(self)

    def run(self) -> None:
        attempt = 0
        while not self._stop.is_set():
            try:
                self._hold()
                return
            except redis.ResponseError as exc:  # NOPERM, or no sharded Pub/Sub at all
                if self.refused is None:
                    self.log.warning(
                        "Redis refused the presence subscription %s (%s): the leader judges "
                        "this worker by its heartbeats alone; give the worker role channel "
                        "access (`cohort acl --apply`) for fast failure detection (asked "
                        "again every %g s)",
                        self.channel, exc, REFUSED_RETRY,
                    )  # fmt: skip
                self.refused = str(exc)
                self._stop.wait(REFUSED_RETRY)
            except DROPPED as exc:
                self.subscribed.clear()
                if attempt == 0:
                    self.log.debug("presence subscription %s lost (%s)", self.channel, exc)
                self._stop.wait(backoff(attempt, RETRY_BASE, RETRY_CAP))
                attempt += 1

    def _hold(self) -> None:
        """Subscribe, then listen until stopped; a dropped connection raises."""
        pubsub: Any = self.conn.pubsub()
        self._pubsub = pubsub
        try:
            pubsub.ssubscribe(self.channel)
            # a cluster's Pub/Sub reads each node's shard channels apart; one server's, all
            listen = getattr(pubsub, "get_sharded_message", pubsub.get_message)
            while not self._stop.is_set():
                message = listen(timeout=LISTEN)
                if message is not None and message.get("type") == "ssubscribe":
                    self.subscribed.set()
                    self.refused = None
        finally:
            self.subscribed.clear()
            with contextlib.suppress(*DROPPED):
                pubsub.close()

    def drop_inherited(self) -> None:
        """In a forked child: close this process's copy of the subscription's sockets (in a
        child redis-py closes without a shutdown, which would end the parent's too)."""
        pubsub = self._pubsub
        if pubsub is None:
            return
        nodes = getattr(pubsub, "node_pubsub_mapping", {}) or {}  # a cluster's, per node
        for connection in [pubsub.connection, *(p.connection for p in nodes.values())]:
            if connection is not None:
                with contextlib.suppress(Exception):
                    connection.disconnect()


_HOLDERS: weakref.WeakSet[PresenceThread] = weakref.WeakSet()
"""Every presence of this process, for a forked child to close its copies."""


def _forget_in_child() -> None:
    for holder in list(_HOLDERS):
        holder.drop_inherited()


os.register_at_fork(after_in_child=_forget_in_child)
