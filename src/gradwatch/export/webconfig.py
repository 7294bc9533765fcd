"""What protects the endpoint: TLS and basic authentication, from the exporter ecosystem's file.

:func:`web_settings` turns a :class:`~gradwatch.config.WatchConfig` into :class:`WebSettings`,
from either

* ``web_config_file``: the Prometheus exporter-toolkit web configuration (the file
  ``--web.config.file`` of node_exporter takes), so one file protects every exporter of a host
  and Prometheus's ``basic_auth``/``tls_config`` scrape settings work unchanged; or
* the older ``certfile``/``keyfile``/``client_cafile`` fields (TLS only).

Everything is checked here, in the constructing process, so a bad file fails the construction
with an error naming the key, before any port is taken. The settings then travel to the server
process as JSON (:meth:`WebSettings.to_json`), which builds its TLS context with
:func:`tls_context` and checks passwords with :class:`BasicAuth` (bcrypt, successful checks
cached by a salted digest of the credentials).

This module imports neither torch nor pydantic: the server process imports it.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import re
import ssl
from collections import OrderedDict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gradwatch.errors import GradWatchError

if TYPE_CHECKING:
    from gradwatch.config import WatchConfig

__all__ = [
    "BasicAuth",
    "TLSSettings",
    "WebSettings",
    "load_web_config",
    "tls_context",
    "web_settings",
]

#: Successful (user, password) checks remembered, so a scraper costs one bcrypt, not one a scrape.
AUTH_CACHE_SIZE = 64

#: exporter-toolkit's ``client_auth_type`` values gradwatch honours, and what they mean here.
#: ``RequestClientCert`` and ``RequireAnyClientCert`` (a certificate asked for but not
#: verified) have no equivalent in Python's ssl module and are refused.
CLIENT_AUTH_TYPES = {
    "NoClientCert": "none",
    "VerifyClientCertIfGiven": "optional",
    "RequireAndVerifyClientCert": "required",
}
_TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
_TOP_KEYS = {"tls_server_config", "http_server_config", "basic_auth_users"}
_TLS_KEYS = {
    "cert_file",
    "key_file",
    "client_auth_type",
    "client_ca_file",
    "min_version",
    "max_version",
    "prefer_server_cipher_suites",  # a no-op in Go since 1.18: accepted and ignored
}
# Valid in exporter-toolkit, but gradwatch cannot honour them: refused rather than ignored,
# since each one narrows who may connect.
_TLS_UNSUPPORTED = {"cipher_suites", "curve_preferences", "client_allowed_sans", "cert", "key",
                    "client_ca"}  # fmt: skip
_HTTP_KEYS = {"http2", "headers"}
#: The response headers exporter-toolkit lets a web config set.
_HEADERS = ("Content-Security-Policy", "X-Frame-Options", "X-Content-Type-Options",
            "X-XSS-Protection", "Strict-Transport-Security")  # fmt: skip
_BCRYPT = re.compile(r"^\$2[abxy]?\$\d\d\$[./A-Za-z0-9]{53}$")


@dataclass(frozen=True)
class TLSSettings:
    """The endpoint's TLS: certificate and key, and how clients are authenticated.

    ``client_auth`` is ``"none"``, ``"optional"`` (a client certificate, when given, must
    verify against ``client_ca_file``) or ``"required"`` (mutual TLS).
    """

    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    client_auth: str = "none"
    min_version: str = "TLS12"
    max_version: str | None = None


@dataclass(frozen=True)
class WebSettings:
    """TLS (or None: plain HTTP), basic-auth users (name -> bcrypt hash), extra headers."""

    tls: TLSSettings | None = None
    basic_auth_users: Mapping[str, str] = field(default_factory=dict)
    headers: Mapping[str, str] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> WebSettings:
        data = json.loads(text)
        tls = TLSSettings(**data["tls"]) if data.get("tls") else None
        return cls(tls, dict(data["basic_auth_users"]), dict(data["headers"]))


def web_settings(cfg: WatchConfig) -> WebSettings:
    """The settings ``cfg`` asks for; raises :class:`GradWatchError` naming what is wrong.

    The TLS files are loaded once here (:func:`tls_context`) so a bad one fails now.
    """
    old_fields = [name for name in ("certfile", "keyfile", "client_cafile")
                  if getattr(cfg, name) is not None]  # fmt: skip
    web_config_file = getattr(cfg, "web_config_file", None)
    if web_config_file is not None:
        if old_fields:
            raise GradWatchError(
                f"gradwatch: web_config_file and {', '.join(old_fields)} are both set; put TLS "
                "in the web config file's tls_server_config (or drop web_config_file)"
            )
        settings = load_web_config(web_config_file)
    elif cfg.certfile is not None and cfg.keyfile is not None:
        client_ca = str(cfg.client_cafile) if cfg.client_cafile is not None else None
        tls = TLSSettings(
            cert_file=str(cfg.certfile),
            key_file=str(cfg.keyfile),
            client_ca_file=client_ca,
            client_auth="required" if client_ca is not None else "none",
        )
        settings = WebSettings(tls=tls)
    else:
        settings = WebSettings()
    if settings.tls is not None:
        try:
            tls_context(settings.tls)
        except (ssl.SSLError, OSError, ValueError) as exc:
            source = (
                f"web_config_file={web_config_file}"
                if web_config_file is not None
                else f"certfile={cfg.certfile}, keyfile={cfg.keyfile}, "
                f"client_cafile={cfg.client_cafile}"
            )
            raise GradWatchError(
                f"gradwatch: cannot load the TLS files of the metrics endpoint ({source}): {exc}"
            ) from exc
    return settings


def load_web_config(path: str | os.PathLike[str]) -> WebSettings:
    """Parse and check an exporter-toolkit web configuration file.

    Relative file names inside it are relative to the file's directory, as in exporter-toolkit.
    Raises :class:`GradWatchError` naming the file and the offending key.
    """
    path = Path(path)
    where = f"web_config_file {path}"
    try:
        text = path.read_text()
    except OSError as exc:
        raise GradWatchError(f"gradwatch: cannot read {where}: {exc.strerror or exc}") from exc
    try:
        import yaml
    except ImportError as exc:  # pragma: no cover - pyyaml comes with gradwatch[auth]
        raise GradWatchError(
            f"gradwatch: reading {where} needs PyYAML: pip install 'gradwatch[auth]'"
        ) from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise GradWatchError(f"gradwatch: {where} is not valid YAML: {exc}") from exc
    if data is None:
        data = {}
    _check_keys(data, _TOP_KEYS, set(), where, "")
    base = path.parent
    tls = _tls(data.get("tls_server_config"), base, where)
    users = _users(data.get("basic_auth_users"), where)
    headers = _http(data.get("http_server_config"), where)
    return WebSettings(tls=tls, basic_auth_users=users, headers=headers)


def _check_keys(data: Any, known: set[str], unsupported: set[str], where: str, prefix: str) -> None:
    section = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise GradWatchError(f"gradwatch: {where}: {section} must be a mapping")
    for key in data:
        if key in unsupported:
            raise GradWatchError(
                f"gradwatch: {where}: {prefix}{key} is not supported by gradwatch "
                f"(supported: {', '.join(sorted(known))})"
            )
        if key not in known:
            raise GradWatchError(
                f"gradwatch: {where}: unknown key {prefix}{key} "
                f"(known: {', '.join(sorted(known | unsupported))})"
            )


def _string(data: dict[str, Any], key: str, where: str, prefix: str) -> str | None:
    value = data.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise GradWatchError(f"gradwatch: {where}: {prefix}{key} must be a string")
    return value


def _tls(data: Any, base: Path, where: str) -> TLSSettings | None:
    if data is None:
        return None
    prefix = "tls_server_config."
    _check_keys(data, _TLS_KEYS, _TLS_UNSUPPORTED, where, prefix)
    files: dict[str, str | None] = {}
    for key in ("cert_file", "key_file", "client_ca_file"):
        name = _string(data, key, where, prefix)
        files[key] = str(base / name) if name is not None else None
    for key in ("cert_file", "key_file"):
        if files[key] is None:
            raise GradWatchError(f"gradwatch: {where}: {prefix}{key} is missing")
    auth_type = _string(data, "client_auth_type", where, prefix) or "NoClientCert"
    if auth_type not in CLIENT_AUTH_TYPES:
        raise GradWatchError(
            f"gradwatch: {where}: {prefix}client_auth_type {auth_type!r} is not supported "
            f"(supported: {', '.join(CLIENT_AUTH_TYPES)})"
        )
    client_auth = CLIENT_AUTH_TYPES[auth_type]
    if client_auth != "none" and files["client_ca_file"] is None:
        raise GradWatchError(
            f"gradwatch: {where}: {prefix}client_auth_type {auth_type} needs client_ca_file"
        )
    if client_auth == "none" and files["client_ca_file"] is not None:
        raise GradWatchError(
            f"gradwatch: {where}: {prefix}client_ca_file is set without a client_auth_type "
            "that verifies client certificates"
        )
    versions: dict[str, str | None] = {}
    for key in ("min_version", "max_version"):
        version = _string(data, key, where, prefix)
        if version is not None and version not in _TLS_VERSIONS:
            raise GradWatchError(
                f"gradwatch: {where}: {prefix}{key} {version!r} is not one of "
                f"{', '.join(_TLS_VERSIONS)}"
            )
        versions[key] = version
    return TLSSettings(
        cert_file=str(files["cert_file"]),
        key_file=str(files["key_file"]),
        client_ca_file=files["client_ca_file"],
        client_auth=client_auth,
        min_version=versions["min_version"] or "TLS12",
        max_version=versions["max_version"],
    )


def _users(data: Any, where: str) -> dict[str, str]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise GradWatchError(f"gradwatch: {where}: basic_auth_users must be a mapping")
    users: dict[str, str] = {}
    for user, hashed in data.items():
        if not isinstance(user, str) or not user or ":" in user:
            raise GradWatchError(
                f"gradwatch: {where}: basic_auth_users: {user!r} is not a valid user name"
            )
        if not isinstance(hashed, str) or not _BCRYPT.match(hashed):
            raise GradWatchError(
                f"gradwatch: {where}: basic_auth_users.{user} is not a bcrypt hash "
                "(make one with `htpasswd -nBC 10 \"\" | tr -d ':\\n'`)"
            )
        users[user] = hashed
    if users:
        try:
            import bcrypt  # noqa: F401 - checked now, used by the server process
        except ImportError as exc:
            raise GradWatchError(
                f"gradwatch: {where}: basic_auth_users needs the bcrypt package: "
                "pip install 'gradwatch[auth]'"
            ) from exc
    return users


def _http(data: Any, where: str) -> dict[str, str]:
    if data is None:
        return {}
    prefix = "http_server_config."
    _check_keys(data, _HTTP_KEYS, set(), where, prefix)
    headers = data.get("headers") or {}
    if not isinstance(headers, dict):
        raise GradWatchError(f"gradwatch: {where}: {prefix}headers must be a mapping")
    out: dict[str, str] = {}
    allowed = {h.lower(): h for h in _HEADERS}
    for name, value in headers.items():
        canonical = allowed.get(str(name).lower())
        if canonical is None:
            raise GradWatchError(
                f"gradwatch: {where}: {prefix}headers.{name} cannot be set "
                f"(allowed: {', '.join(_HEADERS)})"
            )
        if not isinstance(value, str) or "\r" in value or "\n" in value:
            raise GradWatchError(f"gradwatch: {where}: {prefix}headers.{name} must be one line")
        out[canonical] = value
    return out


def tls_context(tls: TLSSettings) -> ssl.SSLContext:
    """The server-side context ``tls`` describes; raises what loading the files raises."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = _TLS_VERSIONS[tls.min_version]
    if tls.max_version is not None:
        ctx.maximum_version = _TLS_VERSIONS[tls.max_version]
    ctx.load_cert_chain(certfile=tls.cert_file, keyfile=tls.key_file)
    if tls.client_ca_file is not None:
        ctx.load_verify_locations(cafile=tls.client_ca_file)
        ctx.verify_mode = ssl.CERT_REQUIRED if tls.client_auth == "required" else ssl.CERT_OPTIONAL
    return ctx


# -- authentication -------------------------------------------------------------------------------


class BasicAuth:
    """Checks ``Authorization: Basic`` against bcrypt hashes, remembering successes.

    The cache key is a digest of the credentials with a per-process salt; a failed check is
    never cached (it costs a bcrypt each time, behind the client's rate limit). An unknown
    user costs a bcrypt too, so timing does not tell which users exist.
    """

    def __init__(self, users: dict[str, str]) -> None:
        import bcrypt

        self._bcrypt = bcrypt
        self._users = {user.encode(): hashed.encode() for user, hashed in users.items()}
        self._decoy = next(iter(self._users.values()))
        self._salt = os.urandom(16)
        self._ok: OrderedDict[bytes, None] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gradwatch-bcrypt")

    async def check(self, header: str | None) -> bool:
        credentials = _basic_credentials(header)
        if credentials is None:
            return False
        user, password = credentials
        key = hmac.new(self._salt, user + b"\0" + password, hashlib.sha256).digest()
        if key in self._ok:
            self._ok.move_to_end(key)
            return True
        hashed = self._users.get(user)
        loop = asyncio.get_running_loop()
        ok = await loop.run_in_executor(
            self._pool, self._checkpw, password, hashed if hashed is not None else self._decoy
        )
        if ok and hashed is not None:
            self._ok[key] = None
            if len(self._ok) > AUTH_CACHE_SIZE:
                self._ok.popitem(last=False)
            return True
        return False

    def _checkpw(self, password: bytes, hashed: bytes) -> bool:
        try:
            return bool(self._bcrypt.checkpw(password, hashed))
        except ValueError:
            return False


def _basic_credentials(header: str | None) -> tuple[bytes, bytes] | None:
    if not header:
        return None
    scheme, _, encoded = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(encoded.strip(), validate=True)
    except ValueError:
        return None
    user, sep, password = decoded.partition(b":")
    return (user, password) if sep else None
