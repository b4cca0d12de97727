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


class RedisSettings(BaseModel):
    """Where Redis is and how patiently to talk to it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = DEFAULT_URL
    socket_timeout: float = Field(default=10.0, gt=0)
    connect_timeout: float = Field(default=3.0, gt=0)
    retries: int = Field(default=2, ge=0, le=20)
    client_name: str | None = None

    @classmethod
    def resolve(
        cls, url: str | None = None, env: Mapping[str, str] | None = None, **kw: object
    ) -> RedisSettings:
        """`url` if given, else $COHORT_REDIS_URL, else the local default; checked."""
        env = os.environ if env is None else env
        chosen = url or env.get(ENV_URL) or DEFAULT_URL
        check_url(chosen)
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


def connect(settings: RedisSettings) -> redis.Redis:
    """A client for `settings`: bytes in, bytes out, a few quick retries on connection errors.

    Longer outages are the caller's loop's business: it logs and backs off.
    """
    return redis.Redis.from_url(
        settings.url,
        socket_timeout=settings.socket_timeout,
        socket_connect_timeout=settings.connect_timeout,
        retry=Retry(ExponentialWithJitterBackoff(cap=0.5, base=0.02), settings.retries),
        retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        health_check_interval=30,
        client_name=settings.client_name,
        decode_responses=False,
    )
