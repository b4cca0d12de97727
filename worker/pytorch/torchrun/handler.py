"""`torchrun --rdzv-backend=cohort`: torchrun's rendezvous on the job's Redis and journal.

torch >= 2.6 loads rendezvous backends from the `torchrun.handlers` entry-point group;
ours (`plugin.entry_point`, also importable from here, where installs made before it moved
still name it until reinstalled) gives `create_handler`, which builds torch's own
`DynamicRendezvousHandler` over three pieces of cohort:

- the rendezvous state in Redis (`RedisRendezvousBackend`, compare-and-set with a fencing
  token) and the agents' c10d store there too (`RedisStore`, a group of keys per round,
  the rounds nobody uses any more deleted): no agent hosts anything the job needs to
  survive, so any agent may die, including the first;
- each agent is a member of the cohort job (`Worker`: Join, heartbeats, Leave), so a
  running `cohort coordinator` journals WorkerJoined, WorkerFailed and WorkerLeft for
  torchrun jobs and `cohort status`, `replay --audit` and `report` read them. The agents
  stay "syncing" members: torchrun's workers train with torch.distributed, not with
  cohort's steps, so no world or step of cohort's is journaled for them;
- the journal feeds torchrun's restart: once it says a participant of the current round
  failed or left, `JournalStateHolder` drops it from the rendezvous state (as torch's own
  keep-alive check would, 15 s later by default) and `num_nodes_waiting()` counts it, so
  every surviving agent restarts its workers into a new round within the coordinator's
  heartbeat timeout instead of waiting for gloo's or NCCL's timeout.

Each round's rank 0 hosts a fresh TCPStore for its workers' `init_process_group` and
publishes it in that round's keys: torch keeps the first one an agent learnt, which is
lost with the agent that hosted it.

Bad settings (endpoint, run id, --rdzv-conf values, torch too old) end torchrun with one
line naming the value, exit code 2.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from datetime import timedelta
from urllib.parse import urlsplit

import torch
from torch.distributed.elastic.rendezvous.api import RendezvousInfo, RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    DynamicRendezvousHandler,
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
    _RendezvousState,
)

from cohort.events.connection import ENV_URL, UNAVAILABLE, Client, RedisSettings, connect
from cohort.events.errors import EventsError
from cohort.events.keys import ENV_JOB, check_job
from cohort.events.models import AGENT_SUCCEEDED, RoundStarted
from cohort.worker.errors import Stopped, WorkerError
from cohort.worker.membership.client import Worker
from cohort.worker.pytorch.torchrun.c10d_store import RedisStore
from cohort.worker.pytorch.torchrun.plugin import entry_point as entry_point
from cohort.worker.pytorch.torchrun.rendezvous_backend import RedisRendezvousBackend

log = logging.getLogger("cohort.torchrun")

BACKEND = "cohort"
MIN_TORCH = (2, 6)
"""torchrun loads `torchrun.handlers` entry points since torch 2.6."""
LEAVE_TIMEOUT_S = 5.0
STORE_TIMEOUT_S = 60
"""How long a store `get` waits for its key (c10d's `read_timeout`)."""
DEFAULT_TIMEOUTS_S = {"last_call": 2}
"""Our defaults for torch's rendezvous timeouts, where they differ from torch's. last_call:
how long a round that has its minimum of nodes waits for more. torch's 30 s is all of a
restart's wait on c10d, where a lost node is only noticed by its own timeouts; here the
journal has already dropped it, so the survivors' round waits 2 s for a replacement."""
REOPEN_POLL_S = 1.0
NO_ID = "none"
"""torchrun's --rdzv-id when none is given."""
_NOT_ID = re.compile(r"[^A-Za-z0-9._:@-]")


class SetupError(WorkerError):
    """torchrun was started with settings this backend cannot use (the message says which)."""


def create_handler(params: RendezvousParameters) -> CohortRendezvousHandler:
    """The handler for `params`; bad settings end the process with one line saying why."""
    try:
        return build(params)
    except SetupError as exc:
        print(f"torchrun --rdzv-backend={BACKEND}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def too_old(version: str) -> bool:
    """Whether torch `version` predates the `torchrun.handlers` entry points."""
    numbers = re.match(r"(\d+)\.(\d+)", version)
    return numbers is None or (int(numbers[1]), int(numbers[2])) < MIN_TORCH


def agent_id(node: _NodeDesc) -> str:
    """The cohort worker id of a torchrun agent: the same on every agent that sees `node`."""
    addr = _NOT_ID.sub("-", str(node.addr)) or "host"
    if len(addr) > 80:
        addr = hashlib.sha256(addr.encode()).hexdigest()[:16]
    return f"torchrun-{addr}-{node.pid}-{node.local_id}"


def build(params: RendezvousParameters) -> CohortRendezvousHandler:
    """Connect, check and assemble the handler; SetupError names any bad setting."""
    if too_old(torch.__version__):
        raise SetupError(
            f"needs torch >= {'.'.join(map(str, MIN_TORCH))} (it loads rendezvous backends "
            f"from the torchrun.handlers entry points); this is torch {torch.__version__}"
        )
    job = job_of(params.run_id, os.environ)
    try:
        settings = RedisSettings.resolve(
            endpoint_url(params.endpoint, os.environ), client_name=f"torchrun-{job}"
        )
    except EventsError as exc:
        raise SetupError(f"--rdzv-endpoint: {in_torchrun_words(str(exc))}") from None
    timeouts = RendezvousTimeout(
        *(_seconds(params, name) for name in ("join", "last_call", "close", "heartbeat"))
    )
    rdzv = RendezvousSettings(
        job,
        params.min_nodes,
        params.max_nodes,
        timeouts,
        keep_alive_interval=timedelta(seconds=_whole(params, "keep_alive_interval", 5)),
        keep_alive_max_attempt=_whole(params, "keep_alive_max_attempt", 3),
    )
    read_timeout = timedelta(seconds=_whole(params, "read_timeout", STORE_TIMEOUT_S))
    conn = connect(settings)
    try:
        conn.ping()
    except UNAVAILABLE as exc:
        raise SetupError(f"cannot reach Redis at {settings.display_url}: {exc}") from None
    node = DynamicRendezvousHandler._node_desc_generator.generate(params.local_addr)
    membership = AgentMembership(Worker(conn, job, worker_id=agent_id(node), role="agent"))
    holder = JournalStateHolder(RedisRendezvousBackend(conn, job), rdzv, membership.gone, node)
    store = RedisStore(conn, job, timeout=read_timeout)
    return CohortRendezvousHandler(node, rdzv, store, holder, membership, conn)


def job_of(run_id: str, env: Mapping[str, str]) -> str:
    """The cohort job: torchrun's run id, else (torchrun's default 'none', which
    `accelerate launch` leaves) $PET_RDZV_ID or $COHORT_JOB; SetupError if none names one."""
    named = "" if run_id in ("", NO_ID) else run_id
    chosen = named or env.get("PET_RDZV_ID", "").replace(NO_ID, "") or env.get(ENV_JOB, "")
    if not chosen:
        raise SetupError(
            f"no job id: torchrun's --rdzv-id is {run_id or NO_ID!r}, which every run without "
            f"one would share; pass --rdzv-id=J, or set {ENV_JOB}=J (accelerate launch passes "
            "no id)"
        )
    try:
        return check_job(chosen)
    except EventsError as exc:
        raise SetupError(f"--rdzv-id: {exc}") from None


def endpoint_url(endpoint: str, env: Mapping[str, str]) -> str | None:
    """The Redis URL --rdzv-endpoint names: a URL as given; a bare HOST:PORT (the form
    `accelerate launch` builds) as redis://HOST:PORT/0, or as $COHORT_REDIS_URL when that
    names the same server (so its user, password and TLS come along); none: $COHORT_REDIS_URL
    or the local default."""
    endpoint = endpoint.strip()
    if not endpoint or "://" in endpoint:
        return endpoint or None
    host, colon, port = endpoint.rpartition(":")  # the last colon, as torch's c10d parses it
    if not colon:
        host, port = endpoint, ""
    host = host.removeprefix("[").removesuffix("]")  # accelerate writes IPv6 bare: fd00::5:6379
    configured = env.get(ENV_URL, "")
    if configured:
        with contextlib.suppress(EventsError, ValueError):
            parts = urlsplit(configured)
            if (parts.hostname, parts.port or 6379) == (host.lower(), int(port or 6379)):
                return configured
    netloc = f"[{host}]" if ":" in host else host
    return f"redis://{netloc}{colon}{port}/0"


def in_torchrun_words(message: str) -> str:
    """A cohort settings message with cohort's own flag named as torchrun's."""
    return message.replace("--redis-url", "--rdzv-endpoint")


def leave_reason(ending: BaseException) -> str:
    """The Leave reason of an agent shutting down while `ending` is raised."""
    if type(ending).__name__ == "ChildFailedError":
        return "torchrun agent shut down: its workers failed past --max-restarts"
    first = str(ending).splitlines()[0] if str(ending) else ""
    return f"torchrun agent shut down: {type(ending).__name__}: {first}"[:1024]


def _whole(params: RendezvousParameters, key: str, default: int) -> int:
    value = params.get(key, default)
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1 or str(value).strip() != str(number):
        raise SetupError(f"--rdzv-conf {key}={value!r} is not a whole number >= 1")
    return number


def _seconds(params: RendezvousParameters, name: str) -> timedelta | None:
    key = f"{name}_timeout"
    default = DEFAULT_TIMEOUTS_S.get(name)
    if params.get(key) is None and default is None:
        return None  # torch's default
    return timedelta(seconds=_whole(params, key, default or 1))


class AgentMembership:
    """A torchrun agent as a member of the cohort job: it joins (in the background, so a
    coordinator may start later), heartbeats, and leaves at shutdown; it reads from the
    journal which agents are gone."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._round: tuple[int, list[str]] | None = None
        """The round this agent's workers run in, and its agents in rank order."""

    def ensure_joined(self) -> None:
        """Join unless a member or joining (again, after the journal removed this agent)."""
        if self._stop.is_set() or self.worker.view.member:
            return
        if self._thread is not None and self._thread.is_alive():
            return
        self._thread = threading.Thread(
            target=self._join, name=f"cohort-join-{self.worker.id}", daemon=True
        )
        self._thread.start()

    def _join(self) -> None:
        try:
            self.worker.join(stop=self._stop)
            self._report()
        except Stopped:
            pass
        except WorkerError as exc:
            log.warning(
                "agent %s is not in job %r's journal: %s", self.worker.id, self.worker.job, exc
            )

    def gone(self) -> frozenset[str]:
        return self.worker.view.gone

    def started(self, round_: int, agents: list[str]) -> None:
        """Report the round this agent's workers start in (RoundStarted), once a member;
        a round started before the Join was answered is reported as it is."""
        self._round = (round_, agents)
        if self.worker.view.member:
            self._report()

    def _report(self) -> None:
        if self._round is None:
            return
        round_, agents = self._round
        try:
            self.worker.send(RoundStarted, round=round_, agents=tuple(agents))
        except WorkerError as exc:  # the other agents report it too
            log.warning("agent %s could not report round %d: %s", self.worker.id, round_, exc)

    def leave(self, reason: str) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(LEAVE_TIMEOUT_S)
        self.worker.leave(reason=reason, timeout=LEAVE_TIMEOUT_S)


class JournalStateHolder(_BackendRendezvousStateHolder):
    """torch's state holder that also drops the nodes the journal says are gone.

    torch drops a node from the state once its keep-alives stop for
    keep_alive_interval * keep_alive_max_attempt; here also once cohort's coordinator
    journals its agent failed or left. The drop is local, like torch's, and reaches the
    backend with this agent's next write. Participants dropped so are kept in `lost` with
    the round they were in: a survivor of that round must restart its workers.
    """

    def __init__(
        self,
        backend: RedisRendezvousBackend,
        settings: RendezvousSettings,
        gone: Callable[[], frozenset[str]],
        me: _NodeDesc,
    ) -> None:
        super().__init__(backend, settings)
        self._gone = gone
        self._me = me
        self.lost: set[tuple[int, _NodeDesc]] = set()

    def sync(self) -> bool | None:
        has_set = super().sync()
        self.drop(self._gone())
        return has_set

    def reopen(self) -> bool:
        """Whether the rendezvous is open to this agent, starting a new run if it was
        closed by a finished one: a closed state none of whose agents keeps alive any more
        (each takes itself out as it shuts down; one killed expires, or the journal drops
        it) becomes a fresh state one round on, so no key of the old run's rounds is read
        as the new run's. False: the closing run still has live agents."""
        self.sync()
        for _ in range(3):
            state = self.state
            if not state.closed:
                return True
            if state.last_heartbeats:
                return False
            fresh = _RendezvousState()
            fresh.round = state.round + 1
            self._state = fresh
            self.mark_dirty()
            self.sync()  # a lost race reads the state another new agent wrote
            log.info(
                "rendezvous %r was closed by a finished run: this run starts at round %d",
                self._settings.run_id,
                self.state.round,
            )
        return not self.state.closed

    def depart(self) -> None:
        """Take this agent's keep-alive out of a closed state, so that once every agent has
        shut down a new run on the same id starts at once (see `reopen`)."""
        for _ in range(3):
            self.sync()
            if not self.state.closed or self._me not in self.state.last_heartbeats:
                return
            del self.state.last_heartbeats[self._me]
            self.mark_dirty()
            if self.sync():
                return

    def drop(self, gone: frozenset[str]) -> None:
        """Take the nodes whose agents are `gone` out of the state (not this one)."""
        state = self.state
        nodes = set(state.participants) | state.wait_list | state.redundancy_list
        dead = [n for n in nodes if n != self._me and agent_id(n) in gone]
        if not dead:
            return
        participants = [n for n in dead if n in state.participants]
        self.lost.update((state.round, node) for node in participants)
        for node in dead:
            state.participants.pop(node, None)
            state.wait_list.discard(node)
            state.redundancy_list.discard(node)
            state.last_heartbeats.pop(node, None)
        log.warning(
            "the journal says agent(s) %s are gone: dropped from round %d of the rendezvous",
            ", ".join(agent_id(n) for n in dead),
            state.round,
        )
        if not participants:
            return
        if state.complete and not state.participants:  # as torch does when a node expires
            state.complete = False
            state.round += 1
        elif not state.complete and len(state.participants) < self._settings.min_nodes:
            state.deadline = None


class CohortRendezvousHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous on cohort: see the module doc."""

    def __init__(
        self,
        node: _NodeDesc,
        settings: RendezvousSettings,
        store: RedisStore,
        holder: JournalStateHolder,
        membership: AgentMembership,
        conn: Client,
    ) -> None:
        super().__init__(node, settings, BACKEND, store, holder)
        self.redis_store = store
        self.holder = holder
        self.membership = membership
        self.conn = conn
        self._round = -1
        """The round this agent's workers run in (-1: none yet)."""

    @property
    def agent(self) -> str:
        """This agent's worker id in the cohort job."""
        return self.membership.worker.id

    def next_rendezvous(self) -> RendezvousInfo:
        self.membership.ensure_joined()
        if self._round < 0:
            self._await_open()
        self._fresh_bootstrap()
        info = super().next_rendezvous()
        self._round = self.holder.state.round
        ranked = sorted(self.holder.state.participants.items(), key=lambda item: item[1])
        self.membership.started(self._round, [agent_id(node) for node, _ in ranked])
        self.holder.lost = {(r, node) for r, node in self.holder.lost if r >= self._round}
        self._drop_old_rounds()
        return info

    def _await_open(self) -> None:
        """Wait until the rendezvous is open, for as long as a dead agent's keep-alive
        takes to expire: a closed one whose agents keep alive past that belongs to a run
        still ending, and this agent exits with one line saying what to do."""
        expiry = self.settings.keep_alive_interval * (self.settings.keep_alive_max_attempt + 1)
        deadline = time.monotonic() + expiry.total_seconds()
        warned = False
        while not self.holder.reopen():
            live = ", ".join(sorted(agent_id(n) for n in self.holder.state.last_heartbeats))
            if time.monotonic() > deadline:
                print(
                    f"torchrun --rdzv-backend={BACKEND}: --rdzv-id={self.settings.run_id} "
                    f"was closed by a run that is still ending (its agents {live} keep "
                    "alive); start again once they exit, or with a new --rdzv-id "
                    f"(`cohort reset --job {self.settings.run_id}` clears the old run)",
                    file=sys.stderr,
                )
                raise SystemExit(2)
            if not warned:
                log.warning(
                    "--rdzv-id=%s was closed by the last run; waiting up to %g s for its "
                    "agents (%s) to exit",
                    self.settings.run_id,
                    expiry.total_seconds(),
                    live,
                )
                warned = True
            time.sleep(REOPEN_POLL_S)

    def num_nodes_waiting(self) -> int:
        """Agents waiting to join, plus participants of this agent's round that the journal
        says are gone: either way torchrun restarts the workers into a new round."""
        waiting = super().num_nodes_waiting()
        return waiting + sum(1 for r, _ in self.holder.lost if r == self._round)

    def shutdown(self) -> bool:
        """Close the rendezvous, take this agent out of it and leave the job, saying how its
        workers ended: torchrun calls this from a `finally`, where the exception under way
        (ChildFailedError: the workers failed past --max-restarts) is still current."""
        ending = sys.exc_info()[1]
        closed = super().shutdown()
        try:
            self.holder.depart()
        except Exception as exc:  # the keep-alive expires anyway
            log.warning("could not take this agent out of the closed rendezvous: %s", exc)
        self.membership.leave(AGENT_SUCCEEDED if ending is None else leave_reason(ending))
        return closed

    def _fresh_bootstrap(self) -> None:
        """Make this round's rank 0 host a new TCPStore for the workers and publish it in
        the round's keys (see the module doc)."""
        self._bootstrap_store_info = None
        self._shared_tcp_store_server = None

    def _drop_old_rounds(self) -> None:
        """Delete the store's keys of the rounds before this one: nobody reads them now."""
        current = self.holder.state.round
        prefix = f"torch.rendezvous.{self.settings.run_id}."

        def old(group: str) -> bool:
            number = group[len(prefix) :]
            return group.startswith(prefix) and number.isdigit() and int(number) < current

        try:
            self.redis_store.drop(old)
        except Exception as exc:  # the keys expire anyway; the round goes on
            log.warning("could not delete the c10d keys of old rounds: %s", exc)
