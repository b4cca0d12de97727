"""The one Redis connection factory. Settings are data; nothing holds a global client.

Three kinds of deployment, chosen by the URL's scheme, each through redis-py's own client:

- `redis://[user:pass@]host:port/db`, `rediss://...` (TLS), `unix:///path`: one server
  (`redis.Redis`);
- `redis+cluster://[user:pass@]host:port[,host:port...]` (`rediss+cluster://` for TLS):
  Redis Cluster (`redis.cluster.RedisCluster`); the hosts are startup nodes, the client
  discovers the rest and follows MOVED/ASK;
- `redis+sentinel://[user:pass@]host:port[,host:port...]/SERVICE[/db]`
  (`rediss+sentinel://` for TLS): the primary of SERVICE as the Sentinels name it
  (`redis.sentinel.Sentinel(...).master_for(SERVICE)`), found again after a failover.
  The credentials are for the Redis servers; the Sentinels are asked without them.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias
from urllib.parse import unquote, urlsplit

import redis
from pydantic import BaseModel, ConfigDict, Field
from redis.backoff import ExponentialWithJitterBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import ClusterDownError, RedisClusterException, TryAgainError
from redis.retry import Retry
from redis.sentinel import Sentinel

from cohort.events.errors import RedisUnavailableError, SettingsError

log = logging.getLogger("cohort.events")

ENV_URL = "COHORT_REDIS_URL"
ENV_WAIT = "COHORT_WAIT_FOR_REDIS"
DEFAULT_WAIT = 10.0
"""Seconds a process waits at start-up for Redis to answer before it gives up, naming it."""
DEFAULT_URL = "redis://127.0.0.1:6379/0"
SCHEMES = (
    "redis", "rediss", "unix",
    "redis+cluster", "rediss+cluster",
    "redis+sentinel", "rediss+sentinel",
)  # fmt: skip
EXAMPLES = (
    "redis://HOST:6379/0, rediss:// for TLS, unix:///path/to/socket, "
    "redis+cluster://HOST:PORT[,HOST:PORT...] for Redis Cluster or "
    "redis+sentinel://HOST:26379[,HOST:PORT...]/SERVICE[/DB] for Sentinel"
)
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&]*")
DEFAULT_PORTS = {"single": 6379, "cluster": 6379, "sentinel": 26379}

Client: TypeAlias = "redis.Redis | RedisCluster"
"""What the connection factory returns: one server (also via Sentinel) or a cluster."""

Kind = Literal["single", "cluster", "sentinel"]

UNAVAILABLE: tuple[type[BaseException], ...] = (
    redis.ConnectionError,
    redis.TimeoutError,
    ClusterDownError,  # also MASTERDOWN: a replica cut off from its primary
    TryAgainError,  # a slot in the middle of a migration
    RedisClusterException,  # e.g. SlotNotCoveredError while a failover reshapes the cluster
)
"""Errors that mean "Redis is not there right now": wait and retry, nothing is decided."""


def text(value: bytes | str) -> str:
    """A reply's bytes as text (clients made with decode_responses=True already give str)."""
    return value.decode() if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class Target:
    """A checked Redis URL taken apart: which kind of deployment, where, as whom."""

    kind: Kind
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    """Cluster startup nodes or Sentinels; empty for a single server (redis-py parses it)."""
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None


# TLS files for rediss:// URLs: (field, env var, CLI flag, what it is)
TLS_FILES = (
    ("tls_ca", "COHORT_REDIS_TLS_CA", "--redis-tls-ca", "CA certificate"),
    ("tls_cert", "COHORT_REDIS_TLS_CERT", "--redis-tls-cert", "client certificate"),
    ("tls_key", "COHORT_REDIS_TLS_KEY", "--redis-tls-key", "client key"),
)


class RedisSettings(BaseModel):
    """Where Redis is and how patiently to talk to it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = DEFAULT_URL
    socket_timeout: float = Field(default=10.0, gt=0)
    connect_timeout: float = Field(default=3.0, gt=0)
    retries: int = Field(default=2, ge=0, le=20)
    client_name: str | None = None
    tls_ca: str | None = None
    """PEM file of the CA(s) to trust for a rediss:// server; None: the system store."""
    tls_cert: str | None = None
    """PEM client certificate, for servers that authenticate clients (tls-auth-clients)."""
    tls_key: str | None = None
    """PEM private key of `tls_cert`."""

    @classmethod
    def resolve(
        cls, url: str | None = None, env: Mapping[str, str] | None = None, **kw: object
    ) -> RedisSettings:
        """`url` if given, else $COHORT_REDIS_URL, else the local default; checked.

        TLS files come from `tls_ca`/`tls_cert`/`tls_key` if given (not None), else from
        $COHORT_REDIS_TLS_CA/_CERT/_KEY; each must be a readable file, and only go with
        rediss:// URLs.
        """
        env = os.environ if env is None else env
        chosen = url or env.get(ENV_URL) or DEFAULT_URL
        check_url(chosen)
        for field, env_name, _, _ in TLS_FILES:
            if kw.get(field) is None and env.get(env_name):
                kw[field] = env[env_name]
        check_tls(chosen, {f: str(kw[f]) if kw.get(f) else None for f, *_ in TLS_FILES})
        return cls(url=chosen, **kw)  # type: ignore[arg-type]

    @property
    def display_url(self) -> str:
        """The URL with any password masked, for logs and errors."""
        return mask_password(self.url)

    @property
    def target(self) -> Target:
        return parse_url(self.url)


def mask_password(url: str) -> str:
    """`url` with the password of its user info (or a `password=` query option) as ***."""
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        user = userinfo.split(":", 1)[0]
        return f"{scheme}://{user}:***@{hosts}{slash}{path}"
    return url


def check_url(url: str) -> str:
    """Return `url` if it is usable, else raise SettingsError naming it and an example."""
    parse_url(url)
    return url


def parse_url(url: str) -> Target:
    """Take a Redis URL apart (see the module docstring for the forms); SettingsError if bad."""
    shown = mask_password(url)
    scheme = _scheme(url, shown)
    base, _, kind_name = scheme.partition("+")
    kind: Kind = kind_name if kind_name else "single"  # type: ignore[assignment]
    tls = base == "rediss"
    if kind == "single":
        _check_single(url, scheme, shown)
        return Target(kind="single", tls=tls, nodes=())
    rest, _, query = url.split("://", 1)[1].partition("?")
    netloc, _, path = rest.partition("/")
    if query:
        raise SettingsError(
            f"Redis URL {shown!r} has query options ({query.split('=')[0]}=...), which "
            f"{scheme}:// URLs do not take; e.g. {_example(kind)}"
        )
    userinfo, at, hosts = netloc.rpartition("@")
    username, password = _credentials(userinfo) if at else (None, None)
    nodes = tuple(_host_port(h, shown, kind) for h in hosts.split(","))
    segments = [p for p in path.split("/") if p]
    if kind == "cluster":
        _check_cluster_db(segments, shown)
        service, db = None, 0
    else:
        service, db = _sentinel_service(segments, shown)
    return Target(
        kind=kind,
        tls=tls,
        nodes=nodes,
        service=service,
        db=db,
        username=username,
        password=password,
    )


def _scheme(url: str, shown: str) -> str:
    """The URL's scheme, if cohort knows it; else SettingsError listing the ones it does."""
    scheme = urlsplit(url).scheme if "://" in url else ""
    if scheme not in SCHEMES:
        raise SettingsError(
            f"Redis URL {shown!r} has scheme {scheme!r}; use {EXAMPLES} "
            f"(set --redis-url or ${ENV_URL})"
        )
    return scheme


def _check_single(url: str, scheme: str, shown: str) -> None:
    """A one-server URL needs a host (unless a socket) and a numeric port; redis-py parses
    the rest."""
    parts = urlsplit(url)
    if scheme != "unix" and not parts.hostname:
        raise SettingsError(f"Redis URL {shown!r} names no host; e.g. redis://127.0.0.1:6379/0")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise SettingsError(f"Redis URL {shown!r} has a bad port; use a number 1-65535") from None


def _credentials(userinfo: str) -> tuple[str | None, str | None]:
    """(username, password) of a URL's `user:pass` part, percent-decoded."""
    user, colon, secret = userinfo.partition(":")
    return unquote(user) or None, unquote(secret) if colon else None


def _check_cluster_db(segments: list[str], shown: str) -> None:
    """A cluster URL names no database but 0: Redis Cluster has no other."""
    if segments and segments != ["0"]:
        raise SettingsError(
            f"Redis URL {shown!r} names database {'/'.join(segments)!r}; Redis Cluster has "
            f"only database 0: use {_example('cluster')}"
        )


def _sentinel_service(segments: list[str], shown: str) -> tuple[str, int]:
    """(service, db) of a Sentinel URL's path `/SERVICE[/DB]`."""
    if not segments or len(segments) > 2:
        raise SettingsError(
            f"Redis URL {shown!r} must name the Sentinel service (the master's name in "
            f"sentinel.conf) and optionally a database: {_example('sentinel')}"
        )
    service = unquote(segments[0])
    if len(segments) == 1:
        return service, 0
    if not segments[1].isdigit():
        raise SettingsError(
            f"Redis URL {shown!r} has database {segments[1]!r}; use a number, "
            f"e.g. {_example('sentinel')}"
        )
    return service, int(segments[1])


def _example(kind: Kind) -> str:
    if kind == "cluster":
        return "redis+cluster://10.0.0.1:7000,10.0.0.2:7000"
    return "redis+sentinel://10.0.0.1:26379,10.0.0.2:26379/mymaster"


def _host_port(text: str, shown: str, kind: Kind) -> tuple[str, int]:
    """(host, port) of one `host[:port]` or `[v6]:port` of a multi-host URL."""
    if text.startswith("["):
        host, bracket, after = text[1:].partition("]")
        port_text = after[1:] if after.startswith(":") else ""
        if not bracket or (after and not after.startswith(":")):
            host = ""
    else:
        host, _, port_text = text.partition(":")
    if not host:
        raise SettingsError(
            f"Redis URL {shown!r} has an empty or malformed host {text!r}; e.g. {_example(kind)}"
        )
    if not port_text:
        return host, DEFAULT_PORTS[kind]
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise SettingsError(
            f"Redis URL {shown!r} has a bad port {port_text!r} for host {host!r}; "
            f"use a number 1-65535, e.g. {_example(kind)}"
        )
    return host, int(port_text)


def check_tls(url: str, files: Mapping[str, str | None]) -> None:
    """Raise SettingsError naming the flag and env var if a TLS file is unusable or the
    URL cannot use it."""
    given = {field: path for field, path in files.items() if path}
    if not given:
        return
    names = {field: f"{flag} / ${env_name}" for field, env_name, flag, _ in TLS_FILES}
    scheme = urlsplit(url).scheme
    if not scheme.startswith("rediss"):
        which = ", ".join(names[f] for f in given)
        raise SettingsError(
            f"TLS files are set ({which}) but the Redis URL uses {scheme}://; "
            "use a rediss:// URL for TLS, or unset them"
        )
    for field, _, _, what in TLS_FILES:
        path = given.get(field)
        if path is None:
            continue
        if not os.path.isfile(path):
            raise SettingsError(f"TLS {what} {path!r} ({names[field]}) is not a file")
        if not os.access(path, os.R_OK):
            raise SettingsError(f"TLS {what} {path!r} ({names[field]}) is not readable")
    if bool(given.get("tls_cert")) != bool(given.get("tls_key")):
        raise SettingsError(
            "a TLS client certificate and its key go together: set both "
            f"{names['tls_cert']} and {names['tls_key']}"
        )


def connect(settings: RedisSettings) -> Client:
    """A client for `settings`: bytes in, bytes out, a few quick retries on connection errors.

    Longer outages are the caller's loop's business: it logs and backs off. rediss:// URLs
    verify the server's certificate (against `tls_ca`, else the system store) and present
    `tls_cert` when given. The URL's scheme picks the client: one server, a cluster, or the
    primary a set of Sentinels names.
    """
    target = settings.target
    tls = _tls_options(settings) if target.tls else {}
    retry = Retry(ExponentialWithJitterBackoff(cap=0.5, base=0.02), settings.retries)
    common: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.connect_timeout,
        "client_name": settings.client_name,
        "decode_responses": False,
    }
    if target.kind == "cluster":
        return _cluster_client(settings, retry, common, tls)
    if target.kind == "sentinel":
        return _sentinel_client(settings, retry, common, tls)
    return redis.Redis.from_url(
        settings.url,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
        **common,
        **tls,  # type: ignore[arg-type]
    )


def _tls_options(settings: RedisSettings) -> dict[str, Any]:
    """redis-py's TLS options for a rediss:// URL: verify the server, present our files."""
    return {
        "ssl_cert_reqs": "required",
        "ssl_ca_certs": settings.tls_ca,
        "ssl_certfile": settings.tls_cert,
        "ssl_keyfile": settings.tls_key,
    }


def _cluster_client(
    settings: RedisSettings, retry: Retry, common: dict[str, Any], tls: dict[str, Any]
) -> RedisCluster:
    """A Redis Cluster client from the URL's startup nodes; it reads the slot map at once."""
    target = settings.target
    try:
        return RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            retry=retry,
            username=target.username,
            password=target.password,
            ssl=target.tls,
            **common,
            **tls,  # type: ignore[arg-type]
        )
    except RedisClusterException as exc:  # the client asks for the slot map at once
        raise redis.ConnectionError(
            f"no startup node of the cluster at {settings.display_url} answered with a "
            f"usable slot map: {exc}"
        ) from exc


def _sentinel_client(
    settings: RedisSettings, retry: Retry, common: dict[str, Any], tls: dict[str, Any]
) -> redis.Redis:
    """A client of the primary the Sentinels name for the URL's service (found again after
    a failover); the Sentinels themselves are asked without the servers' credentials."""
    target = settings.target
    assert target.service is not None
    sentinel_kw: dict[str, Any] = {
        "socket_timeout": settings.socket_timeout,
        "socket_connect_timeout": settings.connect_timeout,
    }
    if target.tls:
        sentinel_kw.update(ssl=True, **tls)
    sentinel = Sentinel(list(target.nodes), sentinel_kwargs=sentinel_kw)
    return sentinel.master_for(  # type: ignore[no-any-return]
        target.service,
        db=target.db,
        username=target.username,
        password=target.password,
        retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
        ssl=target.tls,
        **common,
        **tls,
    )


def credentials(conn: Client) -> tuple[str | None, str | None]:
    """The (username, password) `conn` authenticates with; (None, None) if it does not say."""
    if isinstance(conn, RedisCluster):
        kw = conn.nodes_manager.connection_kwargs
    else:
        kw = getattr(getattr(conn, "connection_pool", None), "connection_kwargs", {})
    username, password = kw.get("username"), kw.get("password")
    return (
        username if isinstance(username, str) else None,
        password if isinstance(password, str) else None,
    )


def reauthenticate(conn: Client, username: str | None, password: str) -> None:
    """Log `conn` in with `password` (AUTH on each server: the server refuses a password it
    does not take), and every connection it makes or re-makes from now on. Sessions already
    open stay logged in either way: Redis checks a password only at AUTH."""
    if isinstance(conn, RedisCluster):
        servers = [n.redis_connection for n in conn.get_nodes() if n.redis_connection is not None]
        conn.nodes_manager.connection_kwargs["password"] = password
    else:
        servers = [conn]
    auth = ("AUTH", username, password) if username else ("AUTH", password)
    for server in servers:
        server.execute_command(*auth)
    for server in servers:
        pool = server.connection_pool
        pool.connection_kwargs["password"] = password
        # redis-py keeps each connection's password for its reconnects: no public setter
        with getattr(pool, "_lock", contextlib.nullcontext()):
            pooled = [
                *getattr(pool, "_available_connections", ()),
                *getattr(pool, "_in_use_connections", ()),
                *getattr(pool, "_connections", ()),  # BlockingConnectionPool
            ]
        for connection in pooled:
            if connection is not None and hasattr(connection, "password"):
                connection.password = password


def is_cluster(conn: Client) -> bool:
    """True for a Redis Cluster client (keys are routed to the primary owning their slot)."""
    return isinstance(conn, RedisCluster)


def where(conn: Client) -> str:
    """Where `conn` points, as a URL without credentials, for log lines and errors."""
    if isinstance(conn, RedisCluster):
        nodes = sorted(node.name for node in conn.get_primaries())
        return f"redis+cluster://{','.join(nodes)}"
    pool = conn.connection_pool
    manager = getattr(pool, "sentinel_manager", None)
    kw = pool.connection_kwargs
    if manager is not None:
        sentinels = ",".join(
            "{host}:{port}".format_map(s.connection_pool.connection_kwargs)
            for s in manager.sentinels
        )
        return (
            f"redis+sentinel://{sentinels}/{getattr(pool, 'service_name', '?')}/{kw.get('db', 0)}"
        )
    if kw.get("path"):
        return f"unix://{kw['path']}"
    return f"redis://{kw.get('host', '?')}:{kw.get('port', '?')}/{kw.get('db', 0)}"


def primaries(conn: Client) -> list[tuple[str, redis.Redis]]:
    """(name, client) of every primary `conn` writes to: the cluster's primaries (as its slot
    map names them now), else the one server. For commands that act on one server's state,
    such as FUNCTION LOAD and INFO, which a cluster client would send to one node only."""
    if isinstance(conn, RedisCluster):
        return [
            (node.name, conn.get_redis_connection(node))
            for node in sorted(conn.get_primaries(), key=lambda n: n.name)
        ]
    return [(where(conn), conn)]


def server_for(conn: Client, key: str) -> redis.Redis:
    """A client of the one server holding `key` (the cluster primary owning its slot), for
    per-connection commands that must follow a write to that key on the same connection
    (WAIT, WAITAOF)."""
    if isinstance(conn, RedisCluster):
        return conn.get_redis_connection(conn.get_node_from_key(key))
    return conn


def backoff(attempt: int, base: float = 0.05, cap: float = 2.0) -> float:
    """Seconds to wait before retry number `attempt` (0-based): exponential, capped, jittered."""
    ceiling = min(cap, base * 2**attempt)
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def start_wait(value: float | None = None, env: Mapping[str, str] | None = None) -> float:
    """The start-up wait: `value` if given, else $COHORT_WAIT_FOR_REDIS, else DEFAULT_WAIT
    seconds; SettingsError naming a value that is not a number of seconds >= 0."""
    return seconds_of(value, ENV_WAIT, DEFAULT_WAIT, env, zero=True)


def seconds_of(
    value: float | None,
    name: str,
    default: float,
    env: Mapping[str, str] | None = None,
    zero: bool = False,
) -> float:
    """`value`, else the environment variable `name`, else `default`: a finite number of
    seconds > 0 (>= 0 with `zero`), or SettingsError naming the variable or value and what
    to do."""
    bound = ">= 0" if zero else "> 0"

    def fits(seconds: float) -> bool:
        return (seconds >= 0 if zero else seconds > 0) and seconds < float("inf")

    if value is None:
        raw = (os.environ if env is None else env).get(name)
        if not raw:
            return default
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not fits(value):
            raise SettingsError(
                f"${name} {raw!r} is not a number of seconds {bound}; use e.g. {name}={default:g}"
            )
    if not fits(value):
        what = name.removeprefix("COHORT_").lower().replace("_", " ")
        raise SettingsError(f"{what} {value!r} is not a number of seconds {bound}")
    return float(value)


def reach(
    open_client: Callable[[], Client],
    shown: str,
    wait: float,
    halt: threading.Event | None = None,
) -> Client:
    """The first client `open_client()` makes that answers PING, trying for `wait` seconds.

    For start-up only, when a process has never talked to Redis: a wrong URL or a server
    that is not there ends in one RedisUnavailableError naming `shown` (the URL without its
    password) instead of a retry loop that says a connection it never had was lost. Once
    running, callers retry with backoff as long as it takes. `halt`, when set, ends the
    wait early with the same error.
    """
    deadline = time.monotonic() + wait
    pause = halt or threading.Event()
    attempt = 0
    while True:
        try:
            client = open_client()
            client.ping()
            return client
        except redis.AuthenticationError:
            raise  # waiting does not change the credentials
        except UNAVAILABLE as exc:
            delay = backoff(attempt, cap=1.0)
            if attempt == 0 and wait:
                log.info("waiting up to %g s for Redis at %s (%s)", wait, shown, _reason(exc))
            attempt += 1
            if time.monotonic() + delay > deadline or pause.wait(delay):
                within = f" within {wait:g} s" if wait else ""
                longer = f" (--wait-for-redis / ${ENV_WAIT} waits longer)" if wait else ""
                raise RedisUnavailableError(
                    f"cannot reach Redis at {shown}{within} ({_reason(exc)}); start it, or "
                    f"point --redis-url / ${ENV_URL} at it{longer}"
                ) from exc


def _reason(exc: BaseException) -> str:
    """redis-py's message, on one line."""
    return " ".join(str(exc).split()) or type(exc).__name__
