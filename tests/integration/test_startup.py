"""Start-up against a Redis that is not there: a short wait, then one line naming the URL
and exit 3 (`Exit.REDIS`); a Redis that comes up within the wait is used."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest

from cohort.errors import Exit
from cohort.events.connection import RedisSettings, connect
from cohort.localredis import LocalRedis, free_port
from cohort.worker.errors import RedisUnreachableError
from cohort.worker.membership.client import Worker
from tests.helpers import wait_until
from tests.integration.cluster import Cluster
from tests.integration.test_cli import cohort

pytestmark = [pytest.mark.redis_server, pytest.mark.slow]


@pytest.mark.parametrize("command", ["coordinator", "worker", "example-worker"])
def test_an_unreachable_redis_at_start_up_ends_in_one_line_naming_it_and_exit_3(
    command: str,
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    started = time.monotonic()
    result = cohort(command, "--job", "j", "--redis-url", url, "--wait-for-redis", "1", timeout=60)
    took = time.monotonic() - started
    assert result.returncode == Exit.REDIS, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("cohort: error:")]
    assert errors == [errors[0]] and f"cannot reach Redis at {url} within 1 s" in errors[0]
    assert "Traceback" not in result.stderr and "lost the connection" not in result.stderr
    assert took < 20, f"{command} took {took:.0f} s to give up"


def test_the_wait_comes_from_the_environment_too() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    env = {**os.environ, "COHORT_WAIT_FOR_REDIS": "0.5"}
    result = cohort("worker", "--job", "j", "--redis-url", url, env=env, timeout=60)
    assert result.returncode == Exit.REDIS
    assert f"cannot reach Redis at {url} within 0.5 s" in result.stderr


def test_a_coordinator_started_before_redis_waits_for_it_then_leads(
    server: LocalRedis, tmp_path: Path
) -> None:
    server.kill()  # its port and dir stay: restart() brings the same server back
    job = Cluster(url=server.url, conn=server.client(), job="late", tmp=tmp_path)
    try:
        leader = job.coordinator("c1", "--wait-for-redis", "60", "--allow-volatile")
        wait_until(
            lambda: "waiting up to 60 s for Redis" in leader.output(), 30, message="it waits"
        )
        assert leader.alive()
        server.restart()
        job.until(lambda s: s.leader == "c1", 30, message="c1 leads once Redis is up")
        assert "Traceback" not in leader.output()
    finally:
        job.stop()


def test_the_worker_api_raises_redis_unreachable_naming_the_url(
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"
    worker = Worker(connect(RedisSettings(url=url)), "j", wait_for_redis=0.5)
    with caplog.at_level(logging.INFO), pytest.raises(RedisUnreachableError) as raised:
        worker.join(timeout=30)
    assert f"cannot reach Redis at {url} within 0.5 s" in str(raised.value)
    assert "lost the connection" not in caplog.text
