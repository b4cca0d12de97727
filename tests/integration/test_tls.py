"""rediss:// against a real redis-server that speaks TLS only and asks for client certificates.

The test makes its own CA, server and client certificates (with the `cryptography` package
if installed, else the `openssl` binary) and a second, unrelated CA to play a wrong one.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from cohort.coordinator.service import Coordinator, ServiceSettings
from cohort.events.connection import RedisSettings, connect
from cohort.events.errors import SettingsError
from cohort.events.keys import Keys
from cohort.events.models import JobConfig, Join, WeightsLoaded
from cohort.events.streams import Inbox
from cohort.localredis import LocalRedis, LocalRedisError, TlsFiles
from tests.helpers import require_redis_server, wait_until

JOB = "tls"


@dataclass(frozen=True)
class Pki:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    wrong_ca: Path

    def server_files(self) -> TlsFiles:
        return TlsFiles(
            ca=self.ca,
            server_cert=self.server_cert,
            server_key=self.server_key,
            client_cert=self.client_cert,
            client_key=self.client_key,
        )


# ---------------------------------------------------------------- certificates


def _with_cryptography(out: Path) -> Pki:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def key_file(name: str) -> tuple[ec.EllipticCurvePrivateKey, Path]:
        key = ec.generate_private_key(ec.SECP256R1())
        path = out / f"{name}.key"
        path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return key, path

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def build(
        subject: str,
        key: ec.EllipticCurvePrivateKey,
        issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
        extensions: list[tuple[x509.ExtensionType, bool]],
    ) -> x509.Certificate:
        issuer_name, issuer_key = issuer or (name(subject), key)
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(cert: x509.Certificate, file: str) -> Path:
        path = out / file
        path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        return path

    def ca(cn: str, file: str) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path]:
        key, _ = key_file(file)
        usage = x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=False,
            data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
            encipher_only=False, decipher_only=False,
        )  # fmt: skip
        cert = build(
            cn, key, None, [(x509.BasicConstraints(ca=True, path_length=None), True), (usage, True)]
        )
        return cert, key, write(cert, f"{file}.crt")

    ca_cert, ca_key, ca_path = ca("cohort test CA", "ca")
    _, _, wrong_path = ca("some other CA", "wrong-ca")
    issuer = (ca_cert.subject, ca_key)
    server_key, server_key_path = key_file("server")
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    server = build(
        "localhost",
        server_key,
        issuer,
        [(san, False), (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), False)],
    )
    client_key, client_key_path = key_file("client")
    client = build(
        "cohort-client",
        client_key,
        issuer,
        [(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), False)],
    )
    return Pki(
        ca=ca_path,
        server_cert=write(server, "server.crt"),
        server_key=server_key_path,
        client_cert=write(client, "client.crt"),
        client_key=client_key_path,
        wrong_ca=wrong_path,
    )


def _with_openssl(out: Path, openssl: str) -> Pki:
    def run(*args: str) -> None:
        subprocess.run([openssl, *args], cwd=out, check=True, capture_output=True)

    for ca in ("ca", "wrong-ca"):
        run(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{ca}.key", "-out", f"{ca}.crt", "-days", "1", "-subj", f"/CN={ca}",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        )  # fmt: skip
    (out / "server.ext").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"
    )
    (out / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who, cn in (("server", "localhost"), ("client", "cohort-client")):
        run(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{who}.key", "-out", f"{who}.csr", "-subj", f"/CN={cn}",
        )  # fmt: skip
        run(
            "x509", "-req", "-in", f"{who}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "1", "-out", f"{who}.crt", "-extfile", f"{who}.ext",
        )  # fmt: skip
    return Pki(
        ca=out / "ca.crt",
        server_cert=out / "server.crt",
        server_key=out / "server.key",
        client_cert=out / "client.crt",
        client_key=out / "client.key",
        wrong_ca=out / "wrong-ca.crt",
    )


def make_pki(out: Path) -> Pki:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("neither the cryptography package nor an openssl binary to make certs")
        return _with_openssl(out, openssl)
    return _with_cryptography(out)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def tls_server(pki: Pki) -> Iterator[LocalRedis]:
    """A redis-server listening with TLS only, requiring client certificates."""
    server = LocalRedis(binary=require_redis_server(), tls=pki.server_files())
    try:
        server.start()
    except LocalRedisError as exc:
        text = str(exc)
        if any(s in text for s in ("not supported", "Bad directive", "Unsupported")):
            pytest.skip(f"this redis-server build has no TLS: {text.splitlines()[-1]}")
        raise
    yield server
    server.stop()


def _cohort(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "cohort", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
        stdin=subprocess.DEVNULL,
    )


# ---------------------------------------------------------------- against a TLS server


@pytest.mark.redis_server
def test_ca_and_client_certificate_reach_the_server_and_a_coordinator_leads_over_tls(
    tls_server: LocalRedis, pki: Pki
) -> None:
    assert tls_server.url.startswith("rediss://")
    conn = connect(tls_server.settings())
    try:
        assert conn.ping()
        # no plain-text listener: TLS is the only way in
        assert conn.config_get("port") == {"port": "0"}
        coord = Coordinator.on_redis(
            conn,
            ServiceSettings(
                job=JOB,
                coordinator="c1",
                config=JobConfig(min_workers=1, dataset_size=1000),
                block_ms=10,
            ),
        )
        coord.start()

        def turn(done: Callable[[], bool]) -> Callable[[], bool]:
            def once() -> bool:
                coord.step()
                return done()

            return once

        wait_until(turn(lambda: coord.leading), message="coordinator leads over TLS")
        inbox = Inbox(conn, Keys(JOB).inbox)
        inbox.send(Join(at=0, job=JOB, worker="w1"))
        inbox.send(WeightsLoaded(at=0, job=JOB, worker="w1"))
        wait_until(turn(lambda: coord.state.ranks == ("w1",)), message="w1 active")
        coord.close()
    finally:
        conn.close()


@pytest.mark.redis_server
def test_without_a_client_certificate_the_server_refuses_the_connection(
    tls_server: LocalRedis, pki: Pki
) -> None:
    conn = connect(RedisSettings(url=tls_server.url, tls_ca=str(pki.ca), retries=0))
    try:
        with pytest.raises(redis.ConnectionError):
            conn.ping()
    finally:
        conn.close()


@pytest.mark.redis_server
def test_a_plain_redis_url_cannot_talk_to_a_tls_only_server(tls_server: LocalRedis) -> None:
    plain = tls_server.url.replace("rediss://", "redis://")
    conn = connect(RedisSettings(url=plain, retries=0, socket_timeout=2, connect_timeout=2))
    try:
        with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
            conn.ping()
    finally:
        conn.close()


@pytest.mark.redis_server
def test_a_wrong_ca_fails_certificate_verification_and_the_cli_names_tls(
    tls_server: LocalRedis, pki: Pki
) -> None:
    settings = RedisSettings(
        url=tls_server.url,
        tls_ca=str(pki.wrong_ca),
        tls_cert=str(pki.client_cert),
        tls_key=str(pki.client_key),
        retries=0,
    )
    conn = connect(settings)
    try:
        with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
            conn.ping()
    finally:
        conn.close()

    done = _cohort(
        "--redis-tls-ca", str(pki.wrong_ca),
        "--redis-tls-cert", str(pki.client_cert),
        "--redis-tls-key", str(pki.client_key),
        "status", "--job", JOB, "--redis-url", tls_server.url,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert "TLS" in done.stderr and "certificate verify failed" in done.stderr
    assert "--redis-tls-ca" in done.stderr


@pytest.mark.redis_server
def test_the_cli_reaches_a_tls_server_with_files_from_the_environment(
    tls_server: LocalRedis, pki: Pki
) -> None:
    done = _cohort(
        "status",
        "--job",
        "nobody-here",
        env={
            "COHORT_REDIS_URL": tls_server.url,
            "COHORT_REDIS_TLS_CA": str(pki.ca),
            "COHORT_REDIS_TLS_CERT": str(pki.client_cert),
            "COHORT_REDIS_TLS_KEY": str(pki.client_key),
        },
    )
    assert done.returncode == 0, done.stderr
    assert "has no journal yet" in done.stdout


@pytest.mark.redis_server
def test_the_cli_without_a_client_certificate_exits_with_a_redis_error(
    tls_server: LocalRedis, pki: Pki
) -> None:
    done = _cohort(
        "--redis-tls-ca", str(pki.ca), "status", "--job", JOB, "--redis-url", tls_server.url
    )
    assert done.returncode == 3, done.stderr
    assert "TLS" in done.stderr


# ---------------------------------------------------------------- settings, no server


def test_a_missing_tls_file_is_named_with_its_flag_and_variable(tmp_path: Path) -> None:
    missing = tmp_path / "nope.pem"
    with pytest.raises(SettingsError) as caught:
        RedisSettings.resolve("rediss://127.0.0.1:1/0", env={}, tls_ca=str(missing))
    text = str(caught.value)
    assert str(missing) in text and "--redis-tls-ca" in text and "COHORT_REDIS_TLS_CA" in text


def test_tls_files_come_from_the_environment_and_flags_win(tmp_path: Path) -> None:
    a, b = tmp_path / "a.pem", tmp_path / "b.pem"
    a.write_text("x")
    b.write_text("x")
    env = {"COHORT_REDIS_TLS_CA": str(a)}
    assert RedisSettings.resolve("rediss://h:1/0", env=env).tls_ca == str(a)
    assert RedisSettings.resolve("rediss://h:1/0", env=env, tls_ca=str(b)).tls_ca == str(b)
    assert RedisSettings.resolve("redis://h:1/0", env={}).tls_ca is None


def test_an_unreadable_tls_file_is_refused(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root reads any file")
    key = tmp_path / "client.key"
    key.write_text("x")
    key.chmod(0)
    cert = tmp_path / "client.crt"
    cert.write_text("x")
    with pytest.raises(SettingsError, match="not readable.*COHORT_REDIS_TLS_KEY"):
        RedisSettings.resolve("rediss://h:1/0", env={}, tls_cert=str(cert), tls_key=str(key))


def test_a_client_certificate_without_its_key_is_refused(tmp_path: Path) -> None:
    cert = tmp_path / "client.crt"
    cert.write_text("x")
    with pytest.raises(SettingsError, match="go together.*--redis-tls-key"):
        RedisSettings.resolve("rediss://h:1/0", env={}, tls_cert=str(cert))


def test_tls_files_with_a_plain_url_are_refused(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    with pytest.raises(SettingsError, match="rediss://"):
        RedisSettings.resolve("redis://h:1/0", env={"COHORT_REDIS_TLS_CA": str(ca)})


def test_the_cli_names_a_missing_ca_file_and_exits_2(tmp_path: Path) -> None:
    done = _cohort(
        "--redis-tls-ca", str(tmp_path / "missing.pem"),
        "status", "--job", JOB, "--redis-url", "rediss://127.0.0.1:1/0",
    )  # fmt: skip
    assert done.returncode == 2
    assert "missing.pem" in done.stderr and "--redis-tls-ca" in done.stderr
