"""Authentication in the exporter ecosystem's format: ``WatchConfig.web_config_file`` takes the
Prometheus exporter-toolkit web configuration (TLS and bcrypt basic-auth users).

The file is checked when the endpoint starts (an error names the key); a request without the
right password gets 401 and nothing else; a successful password costs one bcrypt, not one per
scrape. The real-Prometheus test is in tests/test_export_e2e.py.
"""

from __future__ import annotations

import base64
import http.client
import shutil
import socket
import ssl
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml
from tls import self_signed

from gradwatch import GradWatchError, WatchConfig
from gradwatch.export import MetricsServer, load_web_config
from gradwatch.snapshot import GroupStats, Snapshot

pytestmark = pytest.mark.timeout(120)

PASSWORD = "s3cret-scrape"


def snapshot(step: int = 1) -> Snapshot:
    return Snapshot(
        step=step,
        global_norm=2.0,
        groups={"other": GroupStats(norm=2.0, numel=3, tensors=1)},
        health=1.0,
        timestamp=1000.0 + step,
    )


def bcrypt_hash(password: str, rounds: int = 4) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds)).decode()


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return self_signed(tmp_path_factory.mktemp("tls"))


def write_config(path: Path, data: dict[str, Any] | str) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


@pytest.fixture
def servers() -> Iterator[Callable[..., MetricsServer]]:
    started: list[MetricsServer] = []

    def make(**fields: Any) -> MetricsServer:
        cfg = WatchConfig(port=0, bind_address="127.0.0.1", **fields)
        server = MetricsServer(cfg, world_size=1, parallelism="single")
        started.append(server)
        return server

    yield make
    for server in started:
        server.close()


def request(
    url: str,
    *,
    user: str | None = None,
    password: str | None = None,
    context: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, str], bytes]:
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "https":
        conn: http.client.HTTPConnection = http.client.HTTPSConnection(
            parts.hostname, parts.port, timeout=15, context=context
        )
    else:
        conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=15)
    headers = {}
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        headers["Authorization"] = f"Basic {token}"
    try:
        conn.request("GET", parts.path, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


# -- validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "names"),
    [
        ("basic_auth_users: [unclosed\n", ["not valid YAML"]),
        ({"tls_server_confg": {}}, ["unknown key tls_server_confg"]),
        ({"basic_auth_users": {"alice": "plaintext"}}, ["basic_auth_users.alice", "bcrypt"]),
        ({"tls_server_config": {"cert_file": "a.pem"}}, ["tls_server_config.key_file"]),
        ({"tls_server_config": {"cert_file": "a", "key_file": "b", "bogus": 1}},
         ["unknown key tls_server_config.bogus"]),
        ({"tls_server_config": {"cert_file": "a", "key_file": "b", "cipher_suites": ["x"]}},
         ["tls_server_config.cipher_suites", "not supported"]),
        ({"tls_server_config": {"cert_file": "a", "key_file": "b",
                                "client_auth_type": "RequireAnyClientCert"}},
         ["client_auth_type", "RequireAnyClientCert"]),
        ({"tls_server_config": {"cert_file": "a", "key_file": "b",
                                "client_auth_type": "RequireAndVerifyClientCert"}},
         ["needs client_ca_file"]),
        ({"http_server_config": {"headers": {"Server": "x"}}}, ["headers.Server"]),
        ("- a list\n", ["must be a mapping"]),
    ],
    ids=["yaml", "unknown-top", "hash", "no-key", "unknown-tls", "unsupported", "auth-type",
         "no-ca", "header", "not-mapping"],
)  # fmt: skip
def test_a_bad_web_config_fails_at_construction_naming_the_key(
    tmp_path: Path, content: dict[str, Any] | str, names: list[str]
) -> None:
    path = write_config(tmp_path / "web.yml", content)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(GradWatchError) as info:
        MetricsServer(
            WatchConfig(port=port, bind_address="127.0.0.1", web_config_file=str(path)),
            world_size=1,
            parallelism="single",
        )
    message = str(info.value)
    assert str(path) in message
    for name in names:
        assert name in message, message
    with socket.socket() as s:  # nothing was bound
        s.bind(("127.0.0.1", port))


def test_a_missing_web_config_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yml"
    with pytest.raises(GradWatchError, match=r"web_config_file .*nope\.yml"):
        load_web_config(missing)


def test_web_config_and_the_old_tls_fields_together_are_refused(
    tmp_path: Path, tls_files: tuple[Path, Path]
) -> None:
    cert, key = tls_files
    path = write_config(tmp_path / "web.yml", {"basic_auth_users": {"a": bcrypt_hash("x")}})
    cfg = WatchConfig(
        port=0, bind_address="127.0.0.1", web_config_file=str(path), certfile=cert, keyfile=key
    )
    with pytest.raises(GradWatchError, match="web_config_file and certfile, keyfile"):
        MetricsServer(cfg, world_size=1, parallelism="single")


def test_web_config_file_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GRADWATCH_WEB_CONFIG_FILE", str(tmp_path / "web.yml"))
    assert WatchConfig().web_config_file == str(tmp_path / "web.yml")


def test_an_exporter_toolkit_file_parses_with_relative_paths(
    tmp_path: Path, tls_files: tuple[Path, Path]
) -> None:
    cert, key = tls_files
    (tmp_path / "certs").mkdir()
    shutil.copy(cert, tmp_path / "certs" / "c.pem")
    shutil.copy(key, tmp_path / "certs" / "c.key")
    hashed = bcrypt_hash("pw").replace("$2b$", "$2y$")  # htpasswd -B writes $2y$
    text = f"""
tls_server_config:
  cert_file: certs/c.pem
  key_file: certs/c.key
  min_version: TLS12
  prefer_server_cipher_suites: true
http_server_config:
  http2: true
  headers:
    X-Frame-Options: deny
basic_auth_users:
  prometheus: {hashed}
"""
    settings = load_web_config(write_config(tmp_path / "web.yml", text))
    assert settings.tls is not None
    assert settings.tls.cert_file == str(tmp_path / "certs" / "c.pem")
    assert settings.basic_auth_users == {"prometheus": hashed}
    assert settings.headers == {"X-Frame-Options": "deny"}


# -- serving -------------------------------------------------------------------------------------


def test_basic_auth_wrong_or_missing_password_gets_401_and_nothing_else(
    tmp_path: Path, servers: Callable[..., MetricsServer]
) -> None:
    path = write_config(
        tmp_path / "web.yml", {"basic_auth_users": {"prometheus": bcrypt_hash(PASSWORD)}}
    )
    server = servers(web_config_file=str(path))
    server.publish(snapshot(5))
    for user, password in ((None, None), ("prometheus", "wrong"), ("nobody", PASSWORD)):
        status, headers, body = request(server.url, user=user, password=password)
        assert status == 401, (user, password, status)
        assert headers["WWW-Authenticate"].startswith("Basic")
        assert b"gradwatch" not in body
    status, _, body = request(server.url, user="prometheus", password=PASSWORD)
    assert status == 200 and b"gradwatch_step 5.0" in body


def test_a_scraper_costs_one_bcrypt_not_one_per_scrape(
    tmp_path: Path, servers: Callable[..., MetricsServer]
) -> None:
    path = write_config(
        tmp_path / "web.yml", {"basic_auth_users": {"prometheus": bcrypt_hash(PASSWORD, 12)}}
    )
    server = servers(web_config_file=str(path))
    started = time.monotonic()
    assert request(server.url, user="prometheus", password=PASSWORD)[0] == 200
    first = time.monotonic() - started
    started = time.monotonic()
    for _ in range(4):  # within the client's burst
        assert request(server.url, user="prometheus", password=PASSWORD)[0] == 200
    later = time.monotonic() - started
    assert later < first, (first, later)


def test_tls_and_basic_auth_from_the_web_config(
    tmp_path: Path, tls_files: tuple[Path, Path], servers: Callable[..., MetricsServer]
) -> None:
    cert, key = tls_files
    path = write_config(
        tmp_path / "web.yml",
        {
            "tls_server_config": {"cert_file": str(cert), "key_file": str(key)},
            "http_server_config": {"headers": {"X-Content-Type-Options": "nosniff"}},
            "basic_auth_users": {"prometheus": bcrypt_hash(PASSWORD)},
        },
    )
    server = servers(web_config_file=str(path))
    assert server.url == f"https://127.0.0.1:{server.port}/metrics"
    server.publish(snapshot(9))
    ctx = ssl.create_default_context(cafile=str(cert))
    status, headers, body = request(server.url, user="prometheus", password=PASSWORD, context=ctx)
    assert status == 200 and b"gradwatch_step 9.0" in body
    assert headers["X-Content-Type-Options"] == "nosniff"
    assert request(server.url, user="prometheus", password="no", context=ctx)[0] == 401


def test_the_documented_web_config_is_valid_and_its_password_is_the_documented_one(
    tmp_path: Path,
) -> None:
    doc = (Path(__file__).resolve().parents[3] / "docs" / "operations.md").read_text()
    block = doc.split("# /etc/gradwatch/web.yml\n", 1)[1].split("```", 1)[0]
    settings = load_web_config(write_config(tmp_path / "web.yml", block))
    assert settings.tls is not None and settings.tls.cert_file == str(tmp_path / "gradwatch.crt")
    hashed = settings.basic_auth_users["prometheus"].encode()
    assert bcrypt.checkpw(b"change-me", hashed)
