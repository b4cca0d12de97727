"""Redis URLs for one server, a cluster and Sentinel: parsed into what redis-py's clients take,
and refused with the bad value and an example when they cannot work."""

from __future__ import annotations

import pytest
import redis
from redis.sentinel import SentinelConnectionPool

from cohort.events.connection import RedisSettings, connect, mask_password, parse_url
from cohort.events.errors import SettingsError


def test_a_cluster_url_lists_its_startup_nodes_with_credentials() -> None:
    target = parse_url("redis+cluster://app:s%40cret@10.0.0.1:7000,10.0.0.2,[::1]:7002")
    assert target.kind == "cluster" and not target.tls
    assert target.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 6379), ("::1", 7002))
    assert (target.username, target.password) == ("app", "s@cret")
    assert parse_url("rediss+cluster://h:7000/0").tls


def test_a_sentinel_url_names_the_sentinels_the_service_and_a_database() -> None:
    target = parse_url("redis+sentinel://:pw@s1,s2:5000/mymaster/3")
    assert target.kind == "sentinel"
    assert target.nodes == (("s1", 26379), ("s2", 5000))
    assert (target.service, target.db, target.password) == ("mymaster", 3, "pw")
    assert parse_url("redis+sentinel://s1/mymaster").db == 0


def test_single_server_urls_are_unchanged() -> None:
    for url in ("redis://127.0.0.1:6379/0", "rediss://h:1/0", "unix:///tmp/r.sock"):
        assert parse_url(url).kind == "single"


@pytest.mark.parametrize(
    ("url", "named"),
    [
        ("http://h:1", "'http'"),
        ("redis+clustr://h:1", "'redis+clustr'"),
        ("redis+cluster://h:1,h:x", "'x'"),
        ("redis+cluster://h:1,h:70000", "'70000'"),
        ("redis+cluster://h:1,,h:2", "host ''"),
        ("redis+cluster://h:1/2", "database '2'"),
        ("redis+cluster://h:1?ssl=1", "ssl="),
        ("redis+sentinel://s1:26379", "Sentinel service"),
        ("redis+sentinel://s1/mymaster/zero", "database 'zero'"),
        ("redis+sentinel://s1/a/1/2", "Sentinel service"),
        ("redis://:1/0", "no host"),
    ],
)
def test_a_bad_url_is_refused_naming_the_bad_value_and_an_example(url: str, named: str) -> None:
    with pytest.raises(SettingsError) as caught:
        RedisSettings.resolve(url, env={})
    text = str(caught.value)
    assert named in text
    assert "redis" in text.split(named, 1)[1] or "redis://" in text  # an example follows


def test_passwords_are_masked_for_every_url_form() -> None:
    for url in (
        "redis://u:hunter2@h:1/0",
        "redis+cluster://u:hunter2@a:1,b:2",
        "redis+sentinel://:hunter2@s1,s2/m",
        "unix:///tmp/r.sock?db=0&password=hunter2",
    ):
        shown = RedisSettings(url=url).display_url
        assert "hunter2" not in shown and "***" in shown
    assert mask_password("redis://h:1/0") == "redis://h:1/0"
    with pytest.raises(SettingsError) as caught:
        parse_url("redis+cluster://u:hunter2@h:1,h:x")
    assert "hunter2" not in str(caught.value)


def test_tls_files_go_with_the_tls_forms_of_cluster_and_sentinel_urls(tmp_path) -> None:  # type: ignore[no-untyped-def]
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    for url in ("rediss+cluster://h:1", "rediss+sentinel://s/m"):
        assert RedisSettings.resolve(url, env={}, tls_ca=str(ca)).tls_ca == str(ca)
    with pytest.raises(SettingsError, match="rediss://"):
        RedisSettings.resolve("redis+cluster://h:1", env={}, tls_ca=str(ca))


def test_the_factory_builds_redis_pys_sentinel_client_without_connecting() -> None:
    conn = connect(RedisSettings(url="redis+sentinel://127.0.0.1:1,127.0.0.1:2/svc/2"))
    pool = conn.connection_pool
    assert isinstance(pool, SentinelConnectionPool)
    assert pool.service_name == "svc" and pool.connection_kwargs["db"] == 2
    assert [
        s.connection_pool.connection_kwargs["port"] for s in pool.sentinel_manager.sentinels
    ] == [1, 2]
    conn.close()


def test_an_unreachable_cluster_is_a_connection_error_naming_the_url() -> None:
    settings = RedisSettings(url="redis+cluster://127.0.0.1:1", connect_timeout=0.2, retries=0)
    with pytest.raises(redis.ConnectionError, match=r"redis\+cluster://127\.0\.0\.1:1"):
        connect(settings)
