"""A small client for the Kubernetes API: one aiohttp session, plain JSON in and out.

The agent and the operator make a handful of kinds of request (get, list, watch, apply,
delete, an Event), all of which read and write plain JSON. kubernetes_asyncio's package
imports a model class for every Kubernetes type on first use (32 MiB of heap, in an agent
whose goal is 60 MiB in all) and serializes, sanitizes and deserializes through them on
every call. Here a request is a path, a query and a body.

Credentials: the pod's service account (its token read again every minute, as client-go
does, since bound tokens rotate), or a kubeconfig's own credentials (client certificates,
a token or token file, basic auth; files or inline data). Certificate files (the CA, the
client's certificate and key) are read again when they change, so a rotated certificate
needs no restart. A cluster's `proxy-url` (HTTP) is honoured. A kubeconfig whose user needs an
exec plugin or an auth provider, or a KUBECONFIG naming several files to merge, is loaded
by kubernetes_asyncio's loader (imported only then), whose configuration then supplies the
headers of every request.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import platform
import ssl
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import yarl

from passthrough import __version__

JSON = "application/json"
APPLY_PATCH = "application/apply-patch+yaml"
MERGE_PATCH = "application/merge-patch+json"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
TOKEN_REREAD_SECONDS = 60.0
CERTIFICATES_RECHECK_SECONDS = 60.0  # how often certificate files are looked at for a change
DEFAULT_TIMEOUT = 60.0  # seconds for one request that is not a watch
TOO_MANY_REQUESTS_ATTEMPTS = 5  # tries of one request while the server answers 429
RETRY_AFTER_CAP = 10.0  # seconds at most between them, whatever Retry-After says

log = logging.getLogger(__name__)


def user_agent() -> str:
    """Ours, as client-go makes its own: program/version (os/arch), plus the subcommand when
    the process is `passthrough <command>`, so an audit log or the API server's metrics tell
    the operator from the agents."""
    agent = f"passthrough/{__version__} ({sys.platform}/{platform.machine() or 'unknown'})"
    program = os.path.basename(sys.argv[0]) if sys.argv else ""
    if program in ("passthrough", "__main__.py") and len(sys.argv) > 1 and sys.argv[1].isidentifier():
        agent += f" {sys.argv[1]}"
    return agent


USER_AGENT = user_agent()


class ApiError(Exception):
    """The API server answered with a status outside 2xx (or a watch sent an ERROR event).

    `body` is the answer's text (a Status object, usually), `message` what it says.
    """

    def __init__(self, status: int | None, reason: str = "", body: str = "", headers: Mapping[str, str] | None = None) -> None:
        super().__init__(f"{status} {reason}".strip())
        self.status, self.reason, self.body, self.headers = status, reason, body, dict(headers or {})

    @property
    def message(self) -> str:
        try:
            return str(json.loads(self.body or "{}").get("message", ""))
        except (ValueError, AttributeError):
            return ""


def retry_after(exc: ApiError) -> float:
    """Seconds to wait before trying again after a 429: the server's Retry-After, within bounds."""
    try:
        delay = float((exc.headers or {}).get("Retry-After", 1))
    except ValueError:
        delay = 1.0
    return min(max(delay, 0.1), RETRY_AFTER_CAP)


class KubeconfigError(RuntimeError):
    """A kubeconfig that cannot be used; the message says which and why."""


Headers = Callable[[], Awaitable[dict[str, str]]]


class Session:
    """Requests to one API server over one aiohttp session."""

    def __init__(
        self, http: aiohttp.ClientSession, host: str, headers: Headers | None = None, *, owned: bool = True,
        server_hostname: str | None = None, on_close: Callable[[], Awaitable[None]] | None = None,
        tls: TLSFiles | None = None, proxy: str | None = None,
    ) -> None:  # fmt: skip
        self.http, self.host = http, host.rstrip("/")
        self._headers, self._owned, self._on_close = headers, owned, on_close
        self._extra: dict[str, Any] = {"server_hostname": server_hostname} if server_hostname else {}
        self.tls = tls
        self.proxy: str | None = None
        self.proxy_headers: dict[str, str] | None = None
        if proxy:
            self._use_proxy(proxy)
        if owned:
            self._resolve_proxy_once()

    def _use_proxy(self, proxy: str) -> None:
        url = yarl.URL(proxy)
        if url.scheme != "http" or not url.host:
            raise KubeconfigError(f"proxy-url {proxy!r}: only an http:// proxy is supported (it tunnels TLS with CONNECT)")
        if url.user is not None:  # sent with the CONNECT that opens the tunnel
            self.proxy_headers = {"Proxy-Authorization": aiohttp.encode_basic_auth(url.user, url.password or "")}
        self.proxy = str(url.with_user(None))

    def _resolve_proxy_once(self) -> None:
        # Trusting the environment, aiohttp reads ~/.netrc and the proxy variables in a worker
        # thread for every request: a tenth of the operator's CPU in a burst. The server is one
        # and known, so its proxy (if the environment names one) is looked up once, here.
        if self.proxy:  # named by the configuration: it stands
            return
        with contextlib.suppress(LookupError):
            proxy, auth = aiohttp.helpers.get_env_proxy_for_url(yarl.URL(self.host))
            self.proxy = str(proxy)
            if auth is not None:
                self.proxy_headers = {"Proxy-Authorization": auth.encode()}

    async def close(self) -> None:
        if self._on_close is not None:
            await self._on_close()
        elif self._owned:
            await self.http.close()

    async def __aenter__(self) -> Session:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.close()

    # -- requests -------------------------------------------------------------------------

    def _request(self, method: str, path: str, query: Mapping[str, Any] | None, body: Any, content_type: str,
                 headers: dict[str, str], timeout: aiohttp.ClientTimeout) -> Any:  # fmt: skip
        data = None
        if body is not None:
            # UTF-8, not \\u escapes: a character beyond the Basic Multilingual Plane (an emoji in
            # a device's name) escaped is a surrogate pair, which is JSON but not YAML, and the
            # API server parses apply patches as YAML.
            data = body if isinstance(body, bytes) else json.dumps(body, ensure_ascii=False).encode()
            headers["Content-Type"] = content_type
        extra = self._extra if self.tls is None else {**self._extra, "ssl": self.tls.current()}
        return self.http.request(
            method, self.host + path, params=_query(query), data=data, headers=headers, timeout=timeout,
            proxy=self.proxy, proxy_headers=self.proxy_headers, **extra,
        )  # fmt: skip

    async def _all_headers(self) -> dict[str, str]:
        headers = {"Accept": JSON, "User-Agent": USER_AGENT}
        if self._headers is not None:
            headers.update(await self._headers())
        return headers

    async def request(
        self, method: str, path: str, *, query: Mapping[str, Any] | None = None, body: Any = None,
        content_type: str = JSON, timeout: float | None = DEFAULT_TIMEOUT, attempts: int = TOO_MANY_REQUESTS_ATTEMPTS,
    ) -> Any:  # fmt: skip
        """The answer's JSON; ApiError for a status outside 2xx.

        A 429 (Too Many Requests: priority and fairness shedding load, a kind's storage
        initializing, the server's in-flight limit) is tried again after the server's
        Retry-After, up to `attempts` tries in all, whatever the verb: a 429 is answered before
        the request is acted on, so trying again never does anything twice.
        """
        for attempt in range(1, attempts + 1):
            try:
                return await self._request_once(method, path, query, body, content_type, timeout)
            except ApiError as exc:
                if exc.status != 429 or attempt >= attempts:
                    raise
                await asyncio.sleep(retry_after(exc))
        raise AssertionError("unreachable")

    async def _request_once(self, method: str, path: str, query: Mapping[str, Any] | None, body: Any, content_type: str,
                            timeout: float | None) -> Any:  # fmt: skip
        headers = await self._all_headers()
        try:
            async with self._request(method, path, query, body, content_type, headers, aiohttp.ClientTimeout(total=timeout)) as response:
                data = await response.read()
                if not 200 <= response.status < 300:
                    raise ApiError(response.status, response.reason or "", data.decode(errors="replace"), response.headers)
                return json.loads(data) if data else None
        except aiohttp.ClientSSLError:
            self._handshake_failed()
            raise

    def _handshake_failed(self) -> None:
        # A certificate rotated since the last look is the likely cause: look again at once.
        if self.tls is not None:
            self.tls.look_again()

    async def watch(
        self, path: str, query: Mapping[str, Any] | None = None, *, connect: float = 10.0, read: float = 330.0
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """(type, object) of each event of a watch of `path`; an ERROR event raises ApiError with
        its code. `connect` and `read` bound the wait for the connection and for each line: a
        server gone silent ends the watch (to be started again) instead of holding it for ever."""
        headers = await self._all_headers()
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=connect, connect=connect, sock_read=read)
        try:
            opened = await self._request("GET", path, {**(query or {}), "watch": True}, None, JSON, headers, timeout)
        except aiohttp.ClientSSLError:
            self._handshake_failed()
            raise
        async with opened as response:
            if response.status != 200:
                data = await response.read()
                raise ApiError(response.status, response.reason or "", data.decode(errors="replace"), response.headers)
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)  # a line cut short by a dropped connection raises: the watch starts over
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    raise ApiError(obj.get("code"), f"{obj.get('reason')}: {obj.get('message')}", json.dumps(obj))
                yield kind, obj


def _query(query: Mapping[str, Any] | None) -> dict[str, str] | None:
    if not query:
        return None
    out = {}
    for key, value in query.items():
        if value is None or value == "":
            continue
        out[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return out or None


# -- credentials ---------------------------------------------------------------------------------


async def open_session(kubeconfig: str | None = None, connections: int = 64) -> Session:
    """A session from the pod's service account (in a pod, with no kubeconfig named), else
    from a kubeconfig (`kubeconfig`, $KUBECONFIG, ~/.kube/config). KubeconfigError when
    neither can be used.

    `connections`: how many requests may be in flight at once.
    """
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        return _in_cluster(connections)
    paths = [kubeconfig] if kubeconfig else [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if not paths:
        paths = [str(Path.home() / ".kube" / "config")]
    if len(paths) > 1:
        return await _through_kubernetes_asyncio(None, connections)  # several files merged: its loader's job
    path = Path(paths[0]).expanduser()
    try:
        config = _read_yaml(path)
        cluster, user = _current(config, path)
    except OSError as exc:
        raise KubeconfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    if user.get("exec") or user.get("auth-provider"):
        return await _through_kubernetes_asyncio(str(path), connections)
    return _from_kubeconfig(path, cluster, user, connections)


def _read_yaml(path: Path) -> dict[str, Any]:
    import yaml  # only a kubeconfig needs it

    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise KubeconfigError(f"{path} is not YAML: {exc}") from None
    if not isinstance(config, dict):
        raise KubeconfigError(f"{path} is not a kubeconfig (no mapping at the top)")
    return config


def _named(config: dict[str, Any], section: str, name: str, path: Path) -> dict[str, Any]:
    for entry in config.get(section) or ():
        if isinstance(entry, dict) and entry.get("name") == name:
            return entry.get(section[:-1]) or {}
    raise KubeconfigError(f"{path}: no {section[:-1]} named {name!r} (named by its current context)")


def _current(config: dict[str, Any], path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    name = config.get("current-context")
    if not name:
        raise KubeconfigError(f"{path} has no current-context")
    context = _named(config, "contexts", name, path)
    cluster = _named(config, "clusters", context.get("cluster", ""), path)
    if not cluster.get("server"):
        raise KubeconfigError(f"{path}: cluster {context.get('cluster')!r} has no server")
    user = _named(config, "users", context.get("user", ""), path) if context.get("user") else {}
    return cluster, user


def _material(entry: dict[str, Any], key: str, base: Path) -> tuple[str | None, bytes | None]:
    """(file, data) of a kubeconfig credential given as `key` (a path, relative to the
    kubeconfig) or `key-data` (base64)."""
    if entry.get(f"{key}-data"):
        try:
            return None, base64.b64decode("".join(str(entry[f"{key}-data"]).split()), validate=True)
        except (ValueError, TypeError):
            raise KubeconfigError(f"{key}-data is not base64") from None
    if entry.get(key):
        return str(base / os.path.expanduser(entry[key])), None
    return None, None


def _ssl_context(ca: tuple[str | None, bytes | None], cert: tuple[str | None, bytes | None],
                 key: tuple[str | None, bytes | None], insecure: bool) -> ssl.SSLContext:  # fmt: skip
    ca_file, ca_data = ca
    try:
        context = ssl.create_default_context(cafile=ca_file, cadata=ca_data.decode() if ca_data else None)
        if cert != (None, None):
            with tempfile.TemporaryDirectory(prefix="passthrough-tls-") as private:
                # load_cert_chain reads files only; inline data goes through a private directory
                # that is gone once they are read.
                files = []
                for (file, data), name in ((cert, "cert"), (key, "key")):
                    if data is not None:
                        file = os.path.join(private, name)
                        with open(os.open(file, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as out:
                            out.write(data)
                    files.append(file)
                try:
                    context.load_cert_chain(files[0], files[1])
                except ssl.SSLError as exc:
                    raise KubeconfigError(
                        f"the client certificate and key cannot be used ({exc.reason or exc}): each must be PEM, and the key "
                        "the certificate's"
                    ) from None
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise KubeconfigError(f"cannot load the TLS credentials: {exc}") from None
    if insecure:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class TLSFiles:
    """A session's TLS context, made again from its files when one of them changes (a rotated
    CA, client certificate or key: cert-manager, kubeadm and the kubelet rotate them in place).

    Files are looked at (stat) at most every CERTIFICATES_RECHECK_SECONDS, and at once after a
    handshake failed. A change that cannot be loaded yet (the certificate written, its key not
    yet) keeps the context in use and is tried again at the next look. Connections already open
    keep the credentials they were opened with; new ones take the new context.
    """

    def __init__(self, build: Callable[[], ssl.SSLContext], files: list[str]) -> None:
        self._build, self.files = build, [f for f in files if f]
        self._stamp = self._stamps()
        self.context = build()
        self._looked = time.monotonic()
        self.reloads = 0

    def _stamps(self) -> tuple:
        stamps = []
        for file in self.files:
            try:
                st = os.stat(file)
                stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                stamps.append(None)
        return tuple(stamps)

    def look_again(self) -> None:
        self._looked = -float("inf")

    def current(self) -> ssl.SSLContext:
        now = time.monotonic()
        if self.files and now - self._looked >= CERTIFICATES_RECHECK_SECONDS:
            self._looked = now
            stamp = self._stamps()
            if stamp != self._stamp:
                try:
                    context = self._build()
                except KubeconfigError as exc:
                    log.warning("a certificate file changed but cannot be loaded yet (%s); keeping the one in use", exc)
                else:
                    self.context, self._stamp = context, stamp
                    self.reloads += 1
                    log.info("certificate files changed: %s read again", ", ".join(self.files))
        return self.context


def _http(context: ssl.SSLContext, connections: int) -> aiohttp.ClientSession:
    connector = aiohttp.TCPConnector(limit=connections, ssl=context)
    # Watch events of large objects (a Node with many images) exceed aiohttp's default buffer.
    return aiohttp.ClientSession(connector=connector, trust_env=False, read_bufsize=2**21)


def _from_kubeconfig(path: Path, cluster: dict[str, Any], user: dict[str, Any], connections: int) -> Session:
    base = path.parent
    ca, cert, key = (_material(cluster, "certificate-authority", base), _material(user, "client-certificate", base),
                     _material(user, "client-key", base))  # fmt: skip
    insecure = bool(cluster.get("insecure-skip-tls-verify"))
    tls = TLSFiles(lambda: _ssl_context(ca, cert, key, insecure), [ca[0], cert[0], key[0]])
    headers: Headers | None = None
    if user.get("token"):
        fixed = {"Authorization": f"Bearer {user['token']}"}
        headers = _constant(fixed)
    elif user.get("tokenFile"):
        headers = _token_file(base / user["tokenFile"])
    elif user.get("username"):
        basic = aiohttp.BasicAuth(user["username"], user.get("password") or "").encode()
        headers = _constant({"Authorization": basic})
    return Session(_http(tls.context, connections), cluster["server"], headers, server_hostname=cluster.get("tls-server-name"),
                   tls=tls, proxy=cluster.get("proxy-url"))  # fmt: skip


def _in_cluster(connections: int) -> Session:
    host, port = os.environ["KUBERNETES_SERVICE_HOST"], os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if ":" in host:
        host = f"[{host}]"
    ca = str(SERVICE_ACCOUNT / "ca.crt")

    def context() -> ssl.SSLContext:
        try:
            return ssl.create_default_context(cafile=ca)
        except (ssl.SSLError, OSError) as exc:
            raise KubeconfigError(f"in a pod, but its service account's ca.crt cannot be read: {exc}") from None

    tls = TLSFiles(context, [ca])  # the cluster's CA rotates too (kube-root-ca.crt)
    return Session(_http(tls.context, connections), f"https://{host}:{port}", _token_file(SERVICE_ACCOUNT / "token"), tls=tls)


def _constant(headers: dict[str, str]) -> Headers:
    async def constant() -> dict[str, str]:
        return headers

    return constant


def _token_file(path: Path) -> Headers:
    """Bearer headers from a token file, read again every minute (bound tokens rotate)."""
    cache: dict[str, Any] = {"at": -TOKEN_REREAD_SECONDS, "headers": {}}

    async def headers() -> dict[str, str]:
        now = time.monotonic()
        if now - cache["at"] >= TOKEN_REREAD_SECONDS:
            try:
                token = path.read_text().strip()
            except OSError as exc:
                if not cache["headers"]:
                    raise KubeconfigError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
            else:
                cache["headers"] = {"Authorization": f"Bearer {token}"}
            cache["at"] = now
        return cache["headers"]

    try:
        path.stat()
    except OSError as exc:
        raise KubeconfigError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    return headers


async def _through_kubernetes_asyncio(path: str | None, connections: int) -> Session:
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    try:
        await config.load_kube_config(config_file=path, client_configuration=configuration)
    except (config.ConfigException, OSError) as exc:
        raise KubeconfigError(str(exc)) from None
    configuration.connection_pool_maxsize = connections
    api = client.ApiClient(configuration)
    session = session_of(api)
    session._on_close = api.close  # noqa: SLF001 (the session is its own)
    return session


def session_of(api: Any) -> Session:
    """A Session for `api`: itself, or one over a kubernetes_asyncio ApiClient's own aiohttp
    session and credentials (as the tests and tools hold), which that client closes."""
    if isinstance(api, Session) or not hasattr(api, "rest_client"):
        return api  # a Session, or something shaped as one
    session = getattr(api, "_passthrough_session", None)
    if session is None:
        configuration, rest = api.configuration, api.rest_client

        async def headers() -> dict[str, str]:
            settings = await configuration.auth_settings()
            return {s["key"]: s["value"] for s in settings.values() if s.get("in") == "header" and s.get("value")}

        session = Session(rest.pool_manager, configuration.host, headers, owned=False, server_hostname=rest.server_hostname)
        session.proxy, session.proxy_headers = rest.proxy, rest.proxy_headers
        api._passthrough_session = session  # noqa: SLF001
    return session
