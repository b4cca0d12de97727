"""Extra clients to the server behind `conn`, so each simulated rank talks on its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import fakeredis
import pytest
import redis

from cohort.events.connection import RedisSettings, connect


@pytest.fixture
def connect_more(
    conn: redis.Redis, request: pytest.FixtureRequest
) -> Iterator[Callable[[], redis.Redis]]:
    """A factory of new clients to the same server as `conn` (fakeredis: the same FakeServer)."""
    made: list[redis.Redis] = []

    def more() -> redis.Redis:
        if isinstance(conn, fakeredis.FakeRedis):
            server = conn.connection_pool.connection_kwargs["server"]
            client: redis.Redis = fakeredis.FakeRedis(server=server)
        else:
            url = request.getfixturevalue("redis_server").url
            client = connect(RedisSettings(url=url))
        made.append(client)
        return client

    yield more
    for client in made:
        client.close()
