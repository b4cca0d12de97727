"""The one Redis connection factory. Settings are data; nothing holds a global client."""

from __future__ import annotations

import os
from collections.abc import Mapping
from urllib.parse import urlsplit

import redis
from pydantic import BaseModel, ConfigDict, Field
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from .errors import SettingsError

ENV_URL = "COHORT_REDIS_URL"
DEFAULT_URL = "redis://127.0.0.1:6379/0"
SCHEMES = ("redis", "rediss", "unix")
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
        parts = urlsplit(self.url)
        if parts.password:
            netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
            return parts._replace(netloc=netloc).geturl()
        return self.url


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise SettingsError(
            f"Redis URL {url!r} has scheme {parts.scheme!r}; use redis://HOST:PORT/DB, "
            f"rediss:// for TLS or unix:///path/to/socket (set --redis-url or ${ENV_URL})"
        )
    if parts.scheme != "unix" and not parts.hostname:
        raise SettingsError(f"Redis URL {url!r} names no host; e.g. redis://127.0.0.1:6379/0")
    try:
        parts.port  # noqa: B018 - raises ValueError on a bad port
    except ValueError:
        raise SettingsError(f"Redis URL {url!r} has a bad port; use a number 1-65535") from None
    return url


def check_tls(url: str, files: Mapping[str, str | None]) -> None:
    """Raise SettingsError naming the flag and env var if a TLS file is unusable or the
    URL cannot use it."""
    given = {field: path for field, path in files.items() if path}
    if not given:
        return
    names = {field: f"{flag} / ${env_name}" for field, env_name, flag, _ in TLS_FILES}
    scheme = urlsplit(url).scheme
    if scheme != "rediss":
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


def connect(settings: RedisSettings) -> redis.Redis:
    """A client for `settings`: bytes in, bytes out, a few quick retries on connection errors.

    Longer outages are the caller's loop's business: it logs and backs off. rediss:// URLs
    verify the server's certificate (against `tls_ca`, else the system store) and present
    `tls_cert` when given.
    """
    tls: dict[str, object] = {}
    if urlsplit(settings.url).scheme == "rediss":
        tls = {
            "ssl_cert_reqs": "required",
            "ssl_ca_certs": settings.tls_ca,
            "ssl_certfile": settings.tls_cert,
            "ssl_keyfile": settings.tls_key,
        }
    return redis.Redis.from_url(
        settings.url,
        socket_timeout=settings.socket_timeout,
        socket_connect_timeout=settings.connect_timeout,
        retry=Retry(ExponentialWithJitterBackoff(cap=0.5, base=0.02), settings.retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
        client_name=settings.client_name,
        decode_responses=False,
        **tls,  # type: ignore[arg-type]
    )
