"""Redis ACL users for one job: coordinator, worker and viewer roles, and workers' own.

docs/design.md's "Two streams" promise (a worker cannot forge a fact) is kept by Redis
itself: the worker user may XADD to the inbox (and nothing else on it: a Redis 7 selector),
touch its gradient/weights keys and read the journal, and nothing else. Only the
coordinator user may FCALL the fenced functions that write the journal, cursor, snapshot
and dead letters. The viewer reads. Every role may SELECT only the database it was made
for (`+select|N`): its key patterns would name free keys in another.

A worker speaks only for itself (issue 24, docs/identity.md) once it has its own
credential: `issue` makes the job's identity key (`Keys.identity`, 32 random bytes, which
only the coordinator role's pattern covers: the worker role's patterns name other keys, and
the viewer's skip every key whose name starts with `i` but the inbox) and a user
`cohort-<job>-w-<worker>` with the worker role's rules whose password is the worker's secret,
HMAC-SHA256(job key, "cohort-worker:" + worker). The worker signs each command with it; the
leader dead-letters any command that is unsigned, badly signed, signed by a revoked worker,
or names another worker than its signer. `revoke` deletes the user on every node, kills its
connections and adds it to the revoked set the leader reads every second; `unrevoke` takes
it off that set again.

`begin_rotation` replaces the job key without a restart (issue 33): the old key stays as
`Keys.identity_previous` until the grace ends (PXAT), the leader verifies under either, each
worker user takes both passwords, and each worker reads its new secret from
`Keys.credential(worker)` (its own user alone may) and moves to it; `finish_rotation` leaves
only the new passwords. `default_user_exposure` / `lock_default` deal with Redis's
`default` user, which, open, makes every role pointless.

What each mode protects against:
- no ACLs: nothing; anyone who reaches Redis is every role (the demo, a private Redis).
- role users: a worker cannot write or fake a fact, the cursor, the lease or dead letters,
  read, trim or delete the inbox (so it cannot replay another's signed entry), leave its
  database, or touch another job.
- per-worker credentials: on top, worker A cannot make worker B leave, fail, commit,
  diverge or stay alive; each such command is dead-lettered with the reason. Nor can A
  write B's collective notices, chunks, broadcast pieces or weights (Redis refuses).

What ACLs cannot do: a command is allowed on a key or not, whatever its arguments, so XADD's
own MAXLEN/MINID may still trim the inbox and an explicit ID move its last ID forward; the
leader repairs that (coordinator/service.py). The collective's gradient and weights keys
end in their writer's worker name (`Keys.by`): a worker's own user reads them all and
writes only its own (issue 33), so it cannot forge another rank's notices or data; the
shared worker role writes them all (no identity, no authentication).

`rules` and the plans (`rotation_setusers`, `finish_setusers`, `default_exposure`) are pure
(Redis 7 ACL syntax); `apply`, `issue`, `revoke`, `unrevoke`, `retire`, the rotation and
`lock_default` talk to Redis.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args
from urllib.parse import quote, urlsplit

import redis
from redis.cluster import ClusterNode, RedisCluster

from cohort.errors import CohortError
from cohort.events import identity
from cohort.events.connection import Client, credentials
from cohort.events.keys import Keys

Role = Literal["coordinator", "worker", "viewer", "torchrun"]
ROLES: tuple[Role, ...] = get_args(Role)
DEFAULT_ROLES: tuple[Role, ...] = ("coordinator", "worker", "viewer")
"""What `cohort acl` makes unless asked (--role): a torchrun job's agents need `torchrun`."""
PASSWORD_ENV = "COHORT_ACL_{role}_PASSWORD"
MIN_VERSION = (7, 0)  # %R~ / %W~ key permissions

# What redis-py sends on connect and for health checks, for every role. CLIENT SETNAME
# names the connection (client_name); a Cluster client asks for the slot map when it
# connects and after a MOVED. SELECT is granted for the URL's /db only (`select_rule`):
# key patterns hold in every database, so another database would be a fresh namespace.
_CONNECTION = (
    "+ping", "+hello", "+auth", "+client|setname", "+client|getname",
    # a cluster client's slot map and key positions (COMMAND, COMMAND GETKEYS): no data
    "+cluster|slots", "+cluster|shards", "+command",
)  # fmt: skip
# Redis 7.2 added CLIENT SETINFO, which redis-py sends (and tolerates being refused).
_CONNECTION_7_2 = ("+client|setinfo",)

# The coordinator's own commands, plus those its Redis Functions call: Redis checks a
# function's redis.call() against the caller's ACL too (fencing.lua).
_COORDINATOR = (
    "+fcall", "+fcall_ro", "+function|load", "+function|list",  # election.load_library
    "+get", "+set", "+exists", "+incr", "+pexpire", "+del",  # fencing.lua, status
    "+xadd", "+xrange", "+xrevrange", "+xread", "+xlen", "+xtrim",  # journal, inbox
    "+xdel", "+xsetid", "+xinfo|stream",  # cohort_repair_inbox, cohort_inbox_marks
    "+time",  # the server clock decides silence
    "+smembers",  # the revoked workers (identity mode)
    "+info",  # durability: refuse a Redis without AOF (INFO persistence)
    "+pubsub|shardnumsub",  # whose presence subscription is gone (a process that died)
)  # fmt: skip
_COORDINATOR_7_2 = ("+waitaof",)  # --wait-aof

# worker.client, worker.collective and worker.wire: the inbox, the journal, the collective's keys.
_WORKER = (
    "+xadd",  # the inbox (write only) and per-step notice streams
    "+xread", "+xrange", "+xrevrange", "+xlen",  # the journal and notice streams
    "+set", "+get", "+unlink", "+del", "+pexpire", "+exists",  # grad / weights blobs
    "+time",
    "+ssubscribe", "+sunsubscribe",  # its presence channel (worker/membership/presence.py)
)  # fmt: skip

# torchrun's agents (--rdzv-backend=cohort): each a member of the job as a worker is, but
# with no collective, plus torch's rendezvous state and the agents' c10d store. Both are
# Lua scripts over hashes, lists, sets and streams (worker/pytorch/torchrun), whose
# redis.call()s Redis checks against the caller's ACL too.
_TORCHRUN = (
    "+xadd", "+xread", "+xrange", "+xrevrange", "+xlen", "+time", "+get",  # membership
    "+evalsha", "+eval", "+script|load",  # the state's compare-and-set, the store's writes
    "+hget", "+hmget", "+hset", "+hincrby", "+hdel", "+hlen", "+hkeys",
    "+rpush", "+lpop", "+llen", "+sadd", "+srem", "+smembers",
    "+exists", "+pexpire", "+del", "+unlink",
    "+ssubscribe", "+sunsubscribe",  # its presence channel, as a worker's
)  # fmt: skip

# Read commands that take no key would show other jobs' key names: key patterns
# do not restrict them, so the viewer does not get them.
_KEYLESS_READS = ("-scan", "-randomkey", "-dbsize", "-lolwut")


class AclError(CohortError):
    """ACL users could not be described or applied; the message names the fix."""


def user(job: str, role: Role) -> str:
    """The Redis user name of `role` for `job`: cohort-<job>-<role>."""
    return f"cohort-{Keys(job).job}-{role}"


def parse_version(text: str) -> tuple[int, int]:
    """(major, minor) of a Redis version string such as '7.2.4'."""
    match = re.match(r"^(\d+)\.(\d+)", text.strip())
    if match is None:
        raise AclError(f"Redis version {text!r} is not of the form MAJOR.MINOR[.PATCH]")
    return int(match.group(1)), int(match.group(2))


def rules(
    job: str,
    role: Role,
    redis_version: tuple[int, int] = MIN_VERSION,
    *,
    worker: str | None = None,
    db: int = 0,
) -> list[str]:
    """The ACL SETUSER rules of `role` for `job` (no user name, no password).

    Everything starts denied (`-@all`, no keys, no channels); each role is then granted
    only the commands cohort's code paths issue and only its own job's key patterns, in
    database `db` alone. `redis_version` adds the commands Redis 7.2 introduced (older
    servers reject them). `worker` (worker role only) confines the collective's keys to
    that worker's own: it reads every rank's, and writes only those whose name ends in
    `/<worker>`.
    """
    keys = Keys(job)
    newer = redis_version >= (7, 2)
    base = ["resetkeys", "resetchannels", "-@all", *_CONNECTION, select_rule(db)]
    if newer:
        base += _CONNECTION_7_2
    if role == "coordinator":
        extra = list(_COORDINATOR) + (list(_COORDINATOR_7_2) if newer else [])
        return [*base, *extra, f"~{keys.prefix}:*"]
    if role == "worker":
        return [
            *base,
            *_WORKER,
            inbox_selector(keys),
            f"%R~{keys.journal}",
            f"%R~{keys.archive}",  # where the journal's archived segments are
            f"%R~{keys.memory}",  # the gradient budget the leader publishes
            *_collective(keys, worker),
            f"&{keys.presence(identity.check_worker(worker) if worker else '*')}",
        ]
    if role == "torchrun":
        return [
            *base,
            *_TORCHRUN,
            inbox_selector(keys),
            f"%R~{keys.journal}",
            f"%R~{keys.archive}",
            f"~{keys.rendezvous}",
            f"~{keys.c10d_groups}*",  # the store's groups, hashes, events and queues
            f"&{keys.presence('*')}",
        ]
    if role == "viewer":
        return [
            *base,
            "+@read",
            "-@dangerous",
            *_KEYLESS_READS,
            "+time",
            # every key of the job but its identity key: Redis has no deny patterns, so
            # the viewer reads no key whose name starts with 'i', but the inbox
            f"%R~{keys.prefix}:[^i]*",
            f"%R~{keys.inbox}",
        ]
    raise AclError(f"role {role!r} is not one of {', '.join(ROLES)}")


def _collective(keys: Keys, worker: str | None) -> list[str]:
    """The collective's keys: chunks, reduced chunks, broadcasts and notice streams
    (`grad`, in the job's slot and spread over a cluster's primaries) and the weights.
    The role user reads and writes them all; a worker's own user reads them all and
    writes only its own (`Keys.writable`), so no rank's data can be forged by another."""
    shared = (f"{keys.prefix}:grad:*", f"{keys.spread('g*')}:grad:*", f"{keys.prefix}:weights:*")
    if worker is None:
        return [f"~{pattern}" for pattern in shared]
    mine = keys.writable(identity.check_worker(worker))
    return [*(f"%R~{pattern}" for pattern in shared), *(f"%W~{pattern}" for pattern in mine)]


def select_rule(db: int) -> str:
    """SELECT of database `db` only (a Redis 7 first-argument rule): a role's key patterns
    cannot follow it into another database, where every key name is free again."""
    if db < 0:
        raise AclError(f"database {db} is not a database number: use the URL's /DB (0 or more)")
    return f"+select|{db}"


def inbox_selector(keys: Keys) -> str:
    """The inbox as the worker role sees it: XADD, nothing else (a Redis 7 selector, whose
    permissions add to the user's own). Write access to the key itself would allow DEL,
    UNLINK, XTRIM, XDEL, XSETID and RENAME of the inbox, and XLEN would read it."""
    return f"(%W~{keys.inbox} +xadd)"


def db_of(conn: Client) -> int:
    """The database `conn` selects (a cluster has only 0)."""
    if isinstance(conn, RedisCluster):
        return 0
    return int(conn.connection_pool.connection_kwargs.get("db") or 0)


def password_hash(password: str) -> str:
    """The `#<sha256>` rule for `password`: the server never sees the password in clear."""
    return "#" + hashlib.sha256(password.encode()).hexdigest()


def setuser_commands(
    job: str,
    passwords: Mapping[Role, str],
    redis_version: tuple[int, int] = MIN_VERSION,
    db: int = 0,
) -> list[list[str]]:
    """One `ACL SETUSER` argument list per role in `passwords`, in ROLES order.

    Each starts with `reset`, so applying again replaces a user's old password and rules.
    """
    commands = []
    for role in ROLES:
        if role not in passwords:
            continue
        password = passwords[role]
        if not password:
            raise AclError(f"the {role} password is empty; set {password_env(role)}")
        commands.append(
            [
                "ACL",
                "SETUSER",
                user(job, role),
                "reset",
                "on",
                password_hash(password),
                *rules(job, role, redis_version, db=db),
            ]
        )
    return commands


def password_env(role: Role) -> str:
    return PASSWORD_ENV.format(role=role.upper())


def passwords(
    roles: Sequence[Role], env: Mapping[str, str] | None = None
) -> tuple[dict[Role, str], set[Role]]:
    """Each role's password from $COHORT_ACL_<ROLE>_PASSWORD, else a new random one.

    Returns the passwords and the roles whose password was generated (to be shown once).
    """
    env = os.environ if env is None else env
    chosen: dict[Role, str] = {}
    generated: set[Role] = set()
    for role in roles:
        given = env.get(password_env(role))
        if given:
            chosen[role] = given
        else:
            chosen[role] = secrets.token_urlsafe(24)
            generated.add(role)
    return chosen, generated


def role_url(admin_url: str, job: str, role: Role, password: str) -> str:
    """`admin_url` with the role's user name and password instead of the admin's."""
    return url_as(admin_url, user(job, role), password)


def url_as(admin_url: str, username: str, password: str) -> str:
    """`admin_url` with `username` and `password` instead of the admin's."""
    parts = urlsplit(admin_url)
    if parts.scheme == "unix":
        query = f"username={quote(username, safe='')}&password={quote(password, safe='*')}"
        rest = "&".join(
            q for q in parts.query.split("&") if q and not q.startswith(("username=", "password="))
        )
        return parts._replace(query=f"{query}&{rest}" if rest else query).geturl()
    # the hosts as given (a cluster's or Sentinels' URL lists several), without the admin's
    hosts = parts.netloc.rpartition("@")[2] or "127.0.0.1"
    netloc = f"{quote(username, safe='')}:{quote(password, safe='*')}@{hosts}"
    return parts._replace(netloc=netloc).geturl()


_BARE = re.compile(r"^[A-Za-z0-9_.:~%@#>+\-|{}*/=!^$,]+$")


def quote_arg(arg: str) -> str:
    """`arg` as redis-cli reads it: bare if safe, else in double quotes with escapes."""
    if _BARE.fullmatch(arg):
        return arg
    escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def command_line(command: Sequence[str]) -> str:
    return " ".join(quote_arg(a) for a in command)


def server_version(conn: Client) -> tuple[int, int]:
    """The server's (major, minor); MIN_VERSION if it will not say (INFO refused)."""
    try:
        info = conn.info("server")
    except redis.ResponseError:
        return MIN_VERSION
    return parse_version(str(info.get("redis_version", "7.0")))


def apply(
    conn: Client,
    job: str,
    passwords: Mapping[Role, str],
    redis_version: tuple[int, int] | None = None,
) -> list[str]:
    """Create or replace the users of `passwords`' roles on `conn`'s server; their names.

    `conn` must be allowed ACL SETUSER (an admin). `redis_version` defaults to the server's;
    the users may SELECT only `conn`'s database.
    """
    version = server_version(conn) if redis_version is None else redis_version
    _check_version(version)
    names = []
    for command in setuser_commands(job, passwords, version, db_of(conn)):
        try:
            on_every_node(conn, command)
        except redis.ResponseError as exc:
            raise _explain(exc, command[2]) from exc
        names.append(command[2])
    return names


def _explain(exc: redis.ResponseError, name: str) -> AclError:
    text = str(exc)
    if isinstance(exc, redis.exceptions.NoPermissionError) or "no permissions" in text.lower():
        return AclError(
            f"creating user {name!r} was refused ({text}): the --redis-url user must be "
            "allowed ACL SETUSER (e.g. the default user, or one with +acl|setuser)"
        )
    if "unknown command" in text.lower() or "unknown subcommand" in text.lower():
        return AclError(
            f"creating user {name!r} failed ({text}): this Redis has no ACL SETUSER or "
            "does not know one of the commands; cohort's ACL users need Redis >= 7.0"
        )
    return AclError(f"creating user {name!r} failed: {text}")


# ---------------------------------------------------------------- workers' own credentials


def worker_setuser(
    job: str,
    worker: str,
    secret: str,
    redis_version: tuple[int, int] = MIN_VERSION,
    db: int = 0,
) -> list[str]:
    """The `ACL SETUSER` arguments of `worker`'s own user: the worker role's rules with the
    collective's keys confined to its own for writing, its secret as the password."""
    return [
        "ACL",
        "SETUSER",
        identity.worker_user(job, worker),
        "reset",
        "on",
        password_hash(secret),
        *rules(job, "worker", redis_version, worker=worker, db=db),
        f"%R~{Keys(job).credential(worker)}",  # its new secret while the job key rotates
    ]


def check_workers(workers: Sequence[str]) -> list[str]:
    """`workers` if each can carry a credential, else CredentialRefusedError naming the first
    that cannot."""
    try:
        return [identity.check_worker(w) for w in workers]
    except identity.IdentityError as exc:
        raise CredentialRefusedError(str(exc)) from None


def job_key(conn: Client, job: str, create: bool) -> bytes:
    """The job's identity key; made (32 random bytes) if absent and `create`, else AclError."""
    keys = Keys(job)
    if create:
        conn.set(keys.identity, secrets.token_bytes(identity.JOB_KEY_BYTES), nx=True)
    found: Any = conn.get(keys.identity)
    if not found:
        raise CredentialRefusedError(
            f"job {job!r} has no identity key yet: issue the first worker credential with "
            f"cohort acl --job {job} --worker W --apply"
        )
    return bytes(found)


def issue(
    conn: Client,
    job: str,
    workers: Sequence[str],
    apply_users: bool = True,
    redis_version: tuple[int, int] | None = None,
) -> dict[str, str]:
    """Each worker's secret (the password of its own user), creating the job key and, if
    `apply_users`, the users on every node. The first issue switches the job to identity
    mode: from then on its leader decides only signed commands."""
    check_workers(workers)
    keys = Keys(job)
    revoked: Any = conn.smembers(keys.revoked)
    for worker in workers:
        if worker.encode() in revoked or worker in revoked:
            raise CredentialRefusedError(
                f"worker {worker!r}'s credential of job {job!r} was revoked; a new one would "
                "carry the same secret: give the worker another id"
            )
    version = server_version(conn) if redis_version is None else redis_version
    key = job_key(conn, job, create=apply_users)
    secrets_of = {w: identity.secret_of(key, w) for w in workers}
    if apply_users:
        _check_version(version)
        for worker, secret in secrets_of.items():
            command = worker_setuser(job, worker, secret, version, db_of(conn))
            try:
                on_every_node(conn, command)
            except redis.ResponseError as exc:
                raise _explain(exc, command[2]) from exc
    return secrets_of


def revoke(conn: Client, job: str, worker: str) -> int:
    """Take `worker`'s credential back on every node: the leader dead-letters its commands
    from its next refresh on, its user is deleted and its connections killed. Returns how
    many connections were killed."""
    check_workers([worker])
    name = identity.worker_user(job, worker)
    keys = Keys(job)
    try:
        known = conn.execute_command("ACL", "GETUSER", name) is not None
    except redis.ResponseError as exc:
        raise _explain(exc, name) from exc
    if not known:
        raise CredentialRefusedError(
            f"worker {worker!r} has no credential in job {job!r} (no Redis user {name!r}): "
            f"check the name, or issue one with cohort acl --job {job} --worker {worker} --apply"
        )
    conn.sadd(keys.revoked, worker)  # first: whatever the worker still sends is refused
    on_every_node(conn, ["ACL", "DELUSER", name])  # Redis closes its connections too
    conn.delete(keys.credential(worker))
    killed = 0
    for node in nodes(conn):
        with contextlib.suppress(redis.ResponseError):  # "No such user": DELUSER closed them
            killed += int(node.execute_command("CLIENT", "KILL", "USER", name))
    return killed


def retire(conn: Client, job: str, worker: str) -> None:
    """Delete `worker`'s own user on every node once its process has ended (`cohort run`
    does, for each rank it issued one): nothing is left to cut off, so unlike `revoke` the
    worker is not marked revoked, and commands it sent before it ended stay valid."""
    name = identity.worker_user(job, worker)
    try:
        on_every_node(conn, ["ACL", "DELUSER", name])
        conn.delete(Keys(job).credential(worker))  # a rotation's secret, if one was left
    except redis.ResponseError as exc:
        raise AclError(f"deleting user {name!r} failed ({exc})") from exc


class CredentialRefusedError(AclError):
    """A worker's credential cannot be issued or revoked as asked (an unknown or revoked
    worker, a job without its key); the message names the value and the fix."""


def nodes(conn: Client) -> list[redis.Redis]:
    """A client of every node: users live on each server, and on a cluster a replica may be
    promoted. CLUSTER NODES lists them all; the client's slot map (CLUSTER SLOTS, which
    `target_nodes=ALL_NODES` goes by) leaves out a replica that has replicated nothing yet."""
    if not isinstance(conn, RedisCluster):
        return [conn]
    listed: Any = conn.cluster_nodes()
    found = []
    for address, node in sorted(listed.items()):
        flags = str(node.get("flags", ""))
        if "fail" in flags or "noaddr" in flags or "handshake" in flags:
            continue
        host, _, port = address.rpartition(":")
        kind = "replica" if "slave" in flags else "primary"
        found.append(conn.get_redis_connection(ClusterNode(host, int(port), kind)))
    return found


def on_every_node(conn: Client, command: Sequence[str]) -> None:
    for node in nodes(conn):
        node.execute_command(*command)


def _check_version(version: tuple[int, int]) -> None:
    if version < MIN_VERSION:
        raise AclError(
            f"Redis {version[0]}.{version[1]} has no per-key read/write ACLs (%R~, %W~); "
            "cohort's ACL users need Redis >= 7.0"
        )


# ---------------------------------------------------------------- the default user

DEFAULT_PASSWORD_ENV = "COHORT_ACL_DEFAULT_PASSWORD"
Exposure = Literal["nopass", "password"]
_BROAD = ("+@all", "allcommands", "allkeys", "~*", "%R~*", "%W~*", "%RW~*")


def default_exposure(acl_list: Sequence[str]) -> Exposure | None:
    """How open Redis's `default` user is, from `ACL LIST`'s lines: "nopass" (whoever reaches
    Redis may run every command or read every key), "password" (whoever knows its password
    may), None (off, or confined to a few commands and keys)."""
    for line in acl_list:
        tokens = line.split()
        if tokens[:2] != ["user", "default"]:
            continue
        if "on" not in tokens or not any(t in _BROAD for t in tokens):
            return None
        if "nopass" in tokens:
            return "nopass"
        return "password" if any(t.startswith("#") for t in tokens) else None
    return None


def default_warning(exposure: Exposure, job: str) -> str:
    """What to tell the operator about an open `default` user, and the commands to close it."""
    lock = f"cohort acl --job {job} --apply --lock-default"
    if exposure == "password":
        return (
            "cohort: note: Redis's `default` user may run every command on every key for "
            "whoever knows its password (requirepass):\n"
            "  keep that password away from workers and viewers (they get their own users), "
            f"or turn `default` off with\n    {lock} --redis-url redis://ADMIN:PASS@HOST:PORT"
        )
    return (
        "cohort: warning: Redis's `default` user is enabled without a password and may run "
        "every command on every key:\n"
        "  whoever reaches this Redis is an admin, so the job's role users protect nothing.\n"
        "  Lock it, after giving the admin a user of its own:\n"
        "    redis-cli ACL SETUSER admin on '>ADMIN_PASSWORD' '~*' '&*' '+@all'\n"
        "    redis-cli --user admin --pass ADMIN_PASSWORD ACL SETUSER default off\n"
        f"  or: {lock} --redis-url redis://admin:ADMIN_PASSWORD@HOST:PORT\n"
        f"  or keep `default` with a password: {DEFAULT_PASSWORD_ENV}=PASS {lock}\n"
        "  From then on cohort's admin URL (cohort acl, cohort run) must carry a user: "
        "redis://admin:ADMIN_PASSWORD@HOST:PORT (or redis://default:PASS@HOST:PORT)."
    )


def default_user_exposure(conn: Client) -> Exposure | None:
    """How open the `default` user of `conn`'s server is (None as well if ACL LIST is
    refused: then `conn` is no admin, and whether `default` is open cannot be told)."""
    try:
        listed: Any = conn.acl_list()
    except redis.ResponseError:
        return None
    return default_exposure([line.decode() if isinstance(line, bytes) else line for line in listed])


def lock_default(conn: Client, password: str | None) -> str:
    """Turn the `default` user off (or, with `password`, make it need that password) on
    every node; the outcome in a sentence. Refuses to turn it off under an admin URL that logs
    in as `default` itself: cohort could not connect as admin again."""
    refusal = lock_refusal(credentials(conn)[0], password)
    if refusal is not None:
        raise DefaultUserError(refusal)
    rules_ = ["on", "resetpass", password_hash(password)] if password else ["off"]
    try:
        on_every_node(conn, ["ACL", "SETUSER", "default", *rules_])
    except redis.ResponseError as exc:
        raise _explain(exc, "default") from exc
    if password:
        return (
            f"locked the default user: it now needs the password from ${DEFAULT_PASSWORD_ENV}; "
            "an admin URL without a user logs in as it: redis://default:PASS@HOST:PORT "
            "(ACL SETUSER lives in memory: ACL SAVE, or requirepass in redis.conf, keeps it)"
        )
    return (
        "locked the default user: it is off, so nobody logs in without a user of their own "
        "(ACL SETUSER lives in memory: ACL SAVE, or `user default off` in the ACL file, keeps it)"
    )


def lock_refusal(admin_user: str | None, password: str | None) -> str | None:
    """Why the `default` user may not be locked as asked from an admin URL logging in as
    `admin_user`, or None: turned off, it would lock that URL out of Redis."""
    if password is None and admin_user in (None, "default"):
        return (
            "--lock-default would turn off the `default` user, and this --redis-url logs in "
            "as `default`: give the admin a user of its own first "
            "(redis-cli ACL SETUSER admin on '>ADMIN_PASSWORD' '~*' '&*' '+@all') and pass "
            f"--redis-url redis://admin:ADMIN_PASSWORD@HOST:PORT, or set {DEFAULT_PASSWORD_ENV} "
            "to keep `default` with that password"
        )
    return None


class DefaultUserError(AclError):
    """The `default` user cannot be locked as asked; the message names the fix."""


# ---------------------------------------------------------------- un-revoking


def unrevoke(conn: Client, job: str, worker: str) -> None:
    """Take `worker` off the revoked set: the leader accepts its signatures again from its
    next refresh of the set (within a second). Its user is not re-created here (`issue`)."""
    check_workers([worker])
    keys = Keys(job)
    if not conn.srem(keys.revoked, worker):
        found: Any = conn.smembers(keys.revoked)
        names = sorted(w.decode() if isinstance(w, bytes) else str(w) for w in found)
        raise CredentialRefusedError(
            f"worker {worker!r} is not revoked in job {job!r} (revoked: "
            f"{', '.join(names) or 'none'}): nothing to un-revoke; check the name"
        )


# ---------------------------------------------------------------- rotating the job key

MIN_GRACE = 10.0
"""Seconds: a rotation's grace must leave running workers time to read their new secret
(they look every few seconds) after the leader has read the new key (`SETTLE`)."""
SETTLE = 3.0
"""Seconds between writing the new key and handing out the new secrets: the leader reads
the key every second, so it knows the new one before any worker signs with it."""


@dataclass(frozen=True)
class Rotation:
    """A rotation under way: the workers whose users take both passwords, their new secrets,
    and when (server time, ms) the previous key vanishes."""

    job: str
    secrets: dict[str, str] = field(repr=False)
    grace_ends_ms: int


def rotation_setusers(
    job: str,
    workers: Sequence[str],
    old_key: bytes,
    new_key: bytes,
    redis_version: tuple[int, int] = MIN_VERSION,
    db: int = 0,
) -> list[list[str]]:
    """Each worker user as it is during the grace: its rules, its new secret's password and
    its old one (a Redis user may hold several), so connections made with either log in."""
    return [
        [
            *worker_setuser(job, w, identity.secret_of(new_key, w), redis_version, db),
            password_hash(identity.secret_of(old_key, w)),
        ]
        for w in workers
    ]


def finish_setusers(job: str, workers: Sequence[str], key: bytes) -> list[list[str]]:
    """Each worker user after the grace: the current key's password alone."""
    return [
        [
            "ACL",
            "SETUSER",
            identity.worker_user(job, w),
            "resetpass",
            password_hash(identity.secret_of(key, w)),
        ]
        for w in workers
    ]


def check_grace(grace: float) -> int:
    """`grace` in ms, if long enough for a running worker to move to its new secret."""
    if not grace >= MIN_GRACE:
        raise AclError(
            f"--grace {grace:g} is too short: running workers need time to read their new "
            f"secret; give at least {MIN_GRACE:g} seconds"
        )
    return int(grace * 1000)


def issued_workers(conn: Client, job: str) -> list[str]:
    """The workers of `job` that hold a credential: its users named cohort-<job>-w-*, on
    any node."""
    found: set[str] = set()
    for node in nodes(conn):
        listed: Any = node.acl_users()
        for name in listed:
            worker = identity.worker_of_user(
                job, name.decode() if isinstance(name, bytes) else str(name)
            )
            if worker is not None:
                found.add(worker)
    return sorted(found)


def begin_rotation(conn: Client, job: str, grace: float, settle: float = SETTLE) -> Rotation:
    """Make a new job key, keep the old one as the previous key until the grace ends (it
    vanishes by itself), let every worker's user log in with either secret and, `settle`
    seconds later, hand each worker its new secret (`Keys.credential`). Refused while a
    rotation's grace is still running."""
    keys = Keys(job)
    grace_ms = check_grace(grace)
    old = job_key(conn, job, create=False)
    left = int(conn.pttl(keys.identity_previous))
    if left != -2:
        raise CredentialRefusedError(
            f"a rotation of job {job!r}'s key is under way (its grace ends in "
            f"{max(left, 0) / 1000:.0f} s): end it first with "
            f"cohort acl --job {job} --finish-rotation"
        )
    version = server_version(conn)
    _check_version(version)
    workers = issued_workers(conn, job)
    new = secrets.token_bytes(identity.JOB_KEY_BYTES)
    seconds, micros = conn.time()  # the server's clock: PXAT is judged by it
    ends = int(seconds) * 1000 + int(micros) // 1000 + grace_ms
    conn.set(keys.identity_previous, old, pxat=ends)  # first: both keys verify from now on
    conn.set(keys.identity, new)
    for command in rotation_setusers(job, workers, old, new, version, db_of(conn)):
        try:
            on_every_node(conn, command)
        except redis.ResponseError as exc:
            raise _explain(exc, command[2]) from exc
    threading.Event().wait(settle)
    secrets_of = {w: identity.secret_of(new, w) for w in workers}
    for worker, secret in secrets_of.items():
        conn.set(keys.credential(worker), secret, pxat=ends)
    return Rotation(job, secrets_of, ends)


def finish_rotation(conn: Client, job: str) -> list[str]:
    """End a rotation's grace now (idempotent): the previous key goes, so the leader accepts
    only the current key from its next refresh, every worker's user keeps only the current
    secret's password, and the handed-out secrets go. Returns the workers."""
    keys = Keys(job)
    key = job_key(conn, job, create=False)
    workers = issued_workers(conn, job)
    conn.delete(keys.identity_previous)
    for command in finish_setusers(job, workers, key):
        try:
            on_every_node(conn, command)
        except redis.ResponseError as exc:
            raise _explain(exc, command[2]) from exc
    for worker in workers:
        conn.delete(keys.credential(worker))
    return workers
