"""torch's `RendezvousBackend` on Redis: the rendezvous state with a fencing token.

torch's `DynamicRendezvousHandler` keeps its state (round, participants, wait list,
keep-alives) in a backend and changes it by compare-and-set. Here the state is one hash,
`cohort:{J}:rdzv` = {state: the bytes torch wrote, token: a counter}; one Lua script
compares the token and writes, so two agents never both win. The contract, as torch's
c10d and etcd backends honour it:

- `get_state()`: None when there is no state, else (state, token);
- `set_state(state, token)`: with the current token, the state is written and
  (state, new token, True) returned; with a stale token (or one this backend never gave
  out), nothing is written and (current state, its token, False) returned, or None if
  there is no state any more; with no token (None or falsy), the state is written only if
  there is none yet, otherwise the current one is returned with False;
- a state that is not what this backend writes raises RendezvousStateError; a Redis that
  cannot be reached raises RendezvousConnectionError.
"""

from __future__ import annotations

from typing import Any

import redis
from torch.distributed.elastic.rendezvous.api import (
    RendezvousConnectionError,
    RendezvousStateError,
)
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from cohort.events.connection import UNAVAILABLE, Client, where
from cohort.events.keys import Keys

DEFAULT_TTL_S = 2 * 3600
"""The state expires this long after its last write (as etcd's does; agents keep-alive
every few seconds, so only an abandoned rendezvous expires)."""

# KEYS: the state hash; ARGV: the new state, the expected token ('' = there must be no
# state), TTL ms. Replies {1, state, token} when written, else {0, state, token} as stored.
_SET_STATE = """
local token = redis.call('HGET', KEYS[1], 'token')
local absent = redis.call('EXISTS', KEYS[1]) == 0
if (ARGV[2] == '' and absent) or (ARGV[2] ~= '' and token == ARGV[2]) then
  local new = redis.call('HINCRBY', KEYS[1], 'token', 1)
  redis.call('HSET', KEYS[1], 'state', ARGV[1])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {1, ARGV[1], tostring(new)}
end
return {0, redis.call('HGET', KEYS[1], 'state'), token}
"""


class RedisRendezvousBackend(RendezvousBackend):
    """The rendezvous state of job `job` in Redis (see the module doc for the contract)."""

    def __init__(self, conn: Client, job: str, ttl_s: float = DEFAULT_TTL_S) -> None:
        self.conn = conn
        self.job = job
        self.key = Keys(job).rendezvous
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._set = conn.register_script(_SET_STATE)

    @property
    def name(self) -> str:
        return "cohort"

    def get_state(self) -> tuple[bytes, Token] | None:
        state, token = self._call(lambda: self.conn.hmget(self.key, "state", "token"))
        if state is None and token is None:
            return None
        return self._decoded(state, token)

    def set_state(
        self, state: bytes, token: Token | None = None
    ) -> tuple[bytes, Token, bool] | None:
        expected = self._expected(token)
        if expected is None:  # not a token of ours: it cannot be current
            current = self.get_state()
            return None if current is None else (*current, False)
        written, stored, stored_token = self._call(
            lambda: self._set(keys=[self.key], args=[bytes(state), expected, self.ttl_ms])
        )
        if stored is None and stored_token is None:
            return None
        return (*self._decoded(stored, stored_token), bool(written))

    @staticmethod
    def _expected(token: Token | None) -> str | None:
        """The token as the script compares it: '' for none, None for one never given out."""
        if not token:
            return ""
        if isinstance(token, bool):
            return None
        if isinstance(token, bytes | str):
            token = token.decode() if isinstance(token, bytes) else token
            return token if token.isdigit() else None
        if isinstance(token, int):
            return str(token)
        return None

    def _decoded(self, state: Any, token: Any) -> tuple[bytes, int]:
        if state is None or token is None or not bytes(token).isdigit():
            raise RendezvousStateError(
                f"the rendezvous state at {self.key} is corrupt: state "
                f"{'missing' if state is None else f'{len(state)} bytes'}, token {token!r}; "
                f"`cohort reset --job {self.job}` clears it"
            )
        return bytes(state), int(token)

    def _call(self, op: Any) -> Any:
        try:
            return op()
        except UNAVAILABLE as exc:
            raise RendezvousConnectionError(
                f"the rendezvous state at {self.key} could not be reached in Redis at "
                f"{where(self.conn)}: {exc}"
            ) from exc
        except redis.ResponseError as exc:  # e.g. WRONGTYPE: something else owns the key
            raise RendezvousStateError(
                f"the rendezvous state at {self.key} is corrupt: {exc}"
            ) from exc
