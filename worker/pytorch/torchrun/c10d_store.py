"""A c10d `Store` in Redis: where torchrun's agents meet when `--rdzv-backend=cohort`.

torch's dynamic rendezvous hands its agents a store per round (a `PrefixStore` of
"torch.rendezvous.RUN.ROUND" over this one); they exchange the master's address, their
worker ranks and the exit barrier in it. Here it lives in the job's Redis, not in an agent
that may die: each group of keys (a key's part before its first '/', so one per
rendezvous round) is one hash, `cohort:{J}:c10d:GROUP`, with a stream of "key written"
notices beside it that blocked `get`/`wait` calls XREAD, so nothing polls. Every write is
one Lua script (the value, its notice and the group's registration together) and renews
the group's TTL; `drop` deletes whole groups (the rounds nobody uses any more).

It keeps torch's whole `Store` contract with TCPStore's semantics, directly and through
the `PrefixStore` torch wraps around it: set, get, add, compare_set, wait (with or without
a timeout), check, num_keys, delete_key, append, multi_get, multi_set, list_keys, clone,
the queues (queue_push, queue_pop, queue_len: a list per queue beside the group's hash,
blocking pops woken by the same notices) and set_timeout/timeout. A timeout raises
`DistStoreError`; counts and listings hold the keys written, not this store's own
bookkeeping (notices, registrations) nor queues, as TCPStore's do. torch's C++
`PrefixStore` does not pass list_keys and the queue calls on to any store written in
Python (torch 2.13): those work on the store itself only.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from cohort.events.connection import UNAVAILABLE, Client, text, where
from cohort.events.keys import Keys

BLOCK_S = 1.0
"""Longest single XREAD BLOCK of a waiting getter (a notice wakes it at once)."""
NOTICES = 256
"""Notices kept per group: a waiter only needs the ones after its last read."""
DEFAULT_TTL_S = 2 * 3600
"""A group expires this long after its last write (etcd's rendezvous state lives 2 h)."""

_NOTIFY = """
local function notify(field)
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[1], '*', 'k', field)
  redis.call('SADD', KEYS[3], ARGV[2])
  for i = 1, 3 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
end
"""
# KEYS: the group's hash, its notices, the set of groups; ARGV: notices kept, group, TTL ms,
# then each script's own arguments.
_SET = (
    _NOTIFY
    + """
for i = 4, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
notify(ARGV[4])
return 1
"""
)
_ADD = (
    _NOTIFY
    + """
local value = redis.call('HINCRBY', KEYS[1], ARGV[4], ARGV[5])
notify(ARGV[4])
return value
"""
)
_APPEND = (
    _NOTIFY
    + """
local value = (redis.call('HGET', KEYS[1], ARGV[4]) or '') .. ARGV[5]
redis.call('HSET', KEYS[1], ARGV[4], value)
notify(ARGV[4])
return 1
"""
)
# c10d's compare_set: a missing key is set only when `expected` is empty, and the answer is
# the value the key holds afterwards (or `expected`, when it is missing and stays so).
_COMPARE_SET = (
    _NOTIFY
    + """
local current = redis.call('HGET', KEYS[1], ARGV[4])
if (not current and ARGV[5] == '') or current == ARGV[5] then
  redis.call('HSET', KEYS[1], ARGV[4], ARGV[6])
  notify(ARGV[4])
  return ARGV[6]
end
return current or ARGV[5]
"""
)
# KEYS: ... then the queue's list and the group's set of queues; ARGV: ..., field, value.
_PUSH = (
    _NOTIFY
    + """
redis.call('RPUSH', KEYS[4], ARGV[5])
redis.call('SADD', KEYS[5], ARGV[4])
for i = 4, 5 do redis.call('PEXPIRE', KEYS[i], ARGV[3]) end
notify(ARGV[4])
return 1
"""
)
# KEYS: the group's notices, the queue's list. The last notice's ID and the popped value
# (nil: empty) from the same instant, so a popper waiting on from it misses no push.
_POP = """
local last = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)
return {last[1] and last[1][1] or '0-0', redis.call('LPOP', KEYS[2])}
"""
# KEYS: the group's hash, its notices, then each field's queue; ARGV: fields. The values
# (a non-empty queue reads as b'' where no value is set, as TCPStore's check and wait see
# it), and the last notice's ID from the same instant, so a waiter reading on from it
# misses no write.
_READ = """
local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)
local reply = {last[1] and last[1][1] or '0-0'}
for i = 1, #ARGV do
  local value = redis.call('HGET', KEYS[1], ARGV[i])
  if not value and redis.call('LLEN', KEYS[i + 2]) > 0 then value = '' end
  reply[i + 1] = value
end
return reply
"""


def _bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def split(key: str) -> tuple[str, str]:
    """(group, field) of a c10d key: its part before the first '/' names the group."""
    group, sep, field = key.partition("/")
    return (group, field) if sep else ("", key)


class RedisStore(dist.Store):
    """torch.distributed's key-value store on the job's Redis (see the module doc).

    `get`, `wait` and a blocking `queue_pop` wait until the keys exist or the store's
    timeout passes, then raise `torch.distributed.DistStoreError` as TCPStore does; a Redis
    that cannot be reached raises `torch.distributed.DistNetworkError` naming it.
    """

    def __init__(
        self,
        conn: Client,
        job: str,
        timeout: timedelta = timedelta(seconds=300),
        ttl_s: float = DEFAULT_TTL_S,
    ) -> None:
        super().__init__()  # the pybind trampoline needs it
        self.conn = conn
        self.keys = Keys(job)
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.set_timeout(timeout)
        self._clones: list[RedisStore] = []
        self._scripts = {
            name: conn.register_script(body)
            for name, body in (
                ("set", _SET),
                ("add", _ADD),
                ("append", _APPEND),
                ("compare_set", _COMPARE_SET),
                ("push", _PUSH),
                ("pop", _POP),
                ("read", _READ),
            )
        }

    def clone(self) -> RedisStore:
        """Another store on the same keys with this one's timeout, for another thread.

        It shares the client, whose pool gives each concurrent call a connection of its
        own: a clone blocked in `get` holds up nobody else. torch keeps only the C++ half
        of a Python store it is handed; this store keeps the clone's Python half alive (as
        long as this one lives), else torch's calls on it would find no methods.
        """
        twin = RedisStore(self.conn, self.keys.job, self._timeout(), self.ttl_ms / 1000)
        self._clones.append(twin)
        return twin

    def has_extended_api(self) -> bool:
        """append, multi_get and multi_set are this store's own (atomic per group)."""
        return True

    # ------------------------------------------------------------ writes
    def set(self, key: str, value: str | bytes) -> None:
        self.multi_set([key], [value])

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        by_group: dict[str, list[bytes]] = {}
        for key, value in zip(keys, values, strict=True):
            group, field = split(key)
            by_group.setdefault(group, []).extend((field.encode(), _bytes(value)))
        for group, pairs in by_group.items():
            self._write("set", group, *pairs)

    def add(self, key: str, amount: int) -> int:
        group, field = split(key)
        return int(self._write("add", group, field.encode(), int(amount)))

    def append(self, key: str, value: str | bytes) -> None:
        group, field = split(key)
        self._write("append", group, field.encode(), _bytes(value))

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        group, field = split(key)
        answer = self._write(
            "compare_set", group, field.encode(), _bytes(expected), _bytes(desired)
        )
        return bytes(answer)

    def delete_key(self, key: str) -> bool:
        """Delete a key set, add-ed or appended (not a queue: TCPStore keeps those apart)."""
        group, field = split(key)
        return bool(self._call(lambda: self.conn.hdel(self.keys.c10d(group), field)))

    def deleteKey(self, key: str) -> bool:
        """`delete_key` by the name torch's C++ trampoline calls (e.g. from a PrefixStore)."""
        return self.delete_key(key)

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append `value` to queue `key`, waking a `queue_pop` or `wait` on it."""
        group, field = split(key)
        queue = [self.keys.c10d_queue(group, field), self.keys.c10d_queues(group)]
        self._write("push", group, field.encode(), _bytes(value), more=queue)

    def _write(self, script: str, group: str, *args: Any, more: Sequence[str] = ()) -> Any:
        keys = [self.keys.c10d(group), self.keys.c10d_events(group), self.keys.c10d_groups]
        return self._call(
            lambda: self._scripts[script](
                keys=[*keys, *more], args=[NOTICES, group, self.ttl_ms, *args]
            )
        )

    # ------------------------------------------------------------ reads
    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        found = self._await(keys, self._timeout())
        return [found[key] for key in keys]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:  # type: ignore[override]
        self._await(keys, self._timeout() if timeout is None else timeout)

    def check(self, keys: list[str]) -> bool:
        return all(value is not None for _, value in self._read(keys)[1].items())

    def num_keys(self) -> int:
        """Keys in every group, as TCPStore counts them: not queues, not bookkeeping (a
        PrefixStore passes this on unprefixed, so it counts them all there too)."""
        return sum(
            int(self._call(lambda: self.conn.hlen(self.keys.c10d(group))))  # noqa: B023
            for group in self.groups()
        )

    def getNumKeys(self) -> int:
        """`num_keys` by the name torch's C++ trampoline calls (e.g. from a PrefixStore)."""
        return self.num_keys()

    def list_keys(self) -> list[str]:
        """Every key in every group, as `num_keys` counts them."""
        listed: list[str] = []
        for group in self.groups():
            fields = self._call(lambda: self.conn.hkeys(self.keys.c10d(group)))  # noqa: B023
            listed.extend(f"{group}/{text(f)}" if group else text(f) for f in fields)
        return sorted(listed)

    def queue_len(self, key: str) -> int:
        """The values waiting in queue `key` (0 for a queue never pushed to)."""
        group, field = split(key)
        return int(self._call(lambda: self.conn.llen(self.keys.c10d_queue(group, field))))

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """The oldest value of queue `key`. An empty queue raises QueueEmptyError unless
        `block`, which waits for a push up to the store's timeout (then DistStoreError)."""
        group, field = split(key)
        names = [self.keys.c10d_events(group), self.keys.c10d_queue(group, field)]
        timeout = self._timeout()
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            last, value = self._call(lambda: self._scripts["pop"](keys=names, args=[]))
            if value is not None:
                return bytes(value)
            if not block:
                raise dist.QueueEmptyError(f"queue is empty: {key!r} ({self._where()})")
            self._block({names[0]: text(last)}, deadline, [key], timeout)

    def _timeout(self) -> timedelta:
        """The store's timeout, as `set_timeout` (also torch's, from C++) left it."""
        return self.timeout  # type: ignore[attr-defined,no-any-return]

    def _read(self, keys: Iterable[str]) -> tuple[dict[str, str], dict[str, bytes | None]]:
        """The values of `keys` (None: missing) and, per group, the last notice's ID."""
        by_group: dict[str, list[str]] = {}
        for key in keys:
            by_group.setdefault(split(key)[0], []).append(key)
        last: dict[str, str] = {}
        values: dict[str, bytes | None] = {}
        for group, members in by_group.items():
            fields = [split(key)[1] for key in members]
            names = [self.keys.c10d(group), self.keys.c10d_events(group)]
            names += [self.keys.c10d_queue(group, field) for field in fields]
            reply = self._call(lambda: self._scripts["read"](keys=names, args=fields))  # noqa: B023
            last[group] = text(reply[0])
            values.update(zip(members, reply[1:], strict=True))
        return last, values

    def _await(self, keys: list[str], timeout: timedelta) -> dict[str, bytes]:
        """The values of `keys` once all exist; DistStoreError after `timeout`."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            last, values = self._read(keys)
            missing = [key for key, value in values.items() if value is None]
            if not missing:
                return {key: bytes(value) for key, value in values.items() if value is not None}
            streams = {self.keys.c10d_events(split(key)[0]): last[split(key)[0]] for key in missing}
            self._block(streams, deadline, missing, timeout)

    def _block(
        self, streams: dict[str, str], deadline: float, keys: list[str], timeout: timedelta
    ) -> None:
        """Wait for a notice after `streams`' IDs (a second at most), or raise the timeout
        error for `keys` once `deadline` has passed."""
        left = deadline - time.monotonic()
        if left <= 0:
            raise dist.DistStoreError(
                f"wait timeout after {timeout.total_seconds() * 1000:.0f}ms, keys: {keys} "
                f"({self._where()})"
            )
        block = max(1, int(min(left, BLOCK_S) * 1000))
        self._call(lambda: self.conn.xread(streams, block=block))  # type: ignore[arg-type]

    def _where(self) -> str:
        return f"cohort's c10d store of job {self.keys.job!r} at {where(self.conn)}"

    # ------------------------------------------------------------ clean-up
    def groups(self) -> list[str]:
        return sorted(
            text(g) for g in self._call(lambda: self.conn.smembers(self.keys.c10d_groups))
        )

    def drop(self, unused: Callable[[str], bool]) -> list[str]:
        """Delete every group for which `unused(group)` holds (its keys, queues, notices)."""
        gone = [group for group in self.groups() if unused(group)]
        for group in gone:
            queues = self._call(lambda: self.conn.smembers(self.keys.c10d_queues(group)))  # noqa: B023
            pipe = self.conn.pipeline(transaction=False)
            for field in queues:
                pipe.delete(self.keys.c10d_queue(group, text(field)))
            pipe.delete(self.keys.c10d_queues(group))
            pipe.delete(self.keys.c10d(group))
            pipe.delete(self.keys.c10d_events(group))
            pipe.srem(self.keys.c10d_groups, group)
            self._call(pipe.execute)
        return gone

    def _call(self, op: Callable[[], Any]) -> Any:
        try:
            return op()
        except UNAVAILABLE as exc:
            raise dist.DistNetworkError(
                f"cohort's c10d store of job {self.keys.job!r} could not reach Redis at "
                f"{where(self.conn)}: {exc}"
            ) from exc
