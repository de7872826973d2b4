"""The small API client's transport, against local servers: every request says who we are, a
429 is waited out on every verb, certificate files rotated in place are read again without a
restart, a kubeconfig's proxy-url is used, and relists after a brownout are spread."""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import ssl
from pathlib import Path

import pytest
import yaml
from aiohttp import web

from passthrough.kube import cache, client
from passthrough.kube.client import ApiError, KubeconfigError, Session, open_session


# -- certificates --------------------------------------------------------------------------


def _pem_key(key) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


def authority(directory: Path, name: str):
    """A CA: (its certificate file, a function that issues a leaf signed by it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(ca_key, hashes.SHA256()))  # fmt: skip
    ca_file = directory / f"{name}.crt"
    ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))

    def issue(common_name: str, server: bool) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
                   .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]),
                                  critical=False))  # fmt: skip
        if server:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                            critical=False)  # fmt: skip
        return builder.sign(ca_key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM), _pem_key(key)

    return ca_file, issue


def kubeconfig(path: Path, server: str, cluster: dict, user: dict) -> str:
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": {"server": server, **cluster}}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    return str(path)


async def serve(app: web.Application, context: ssl.SSLContext | None = None) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # noqa: SLF001
    return runner, f"{'https' if context else 'http'}://127.0.0.1:{port}"


async def connect_proxy(tunnels: list[tuple[str, str]]) -> tuple[asyncio.Server, int]:
    """A forward proxy as squid is one for https, on loopback: CONNECT host:port, then bytes
    both ways. Each tunnel's request line and Proxy-Authorization go to `tunnels`."""

    async def tunnel(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        line, *headers = (await reader.readuntil(b"\r\n\r\n")).decode().split("\r\n")
        auth = next((h.split(":", 1)[1].strip() for h in headers if h.lower().startswith("proxy-authorization:")), "")
        tunnels.append((line, auth))
        host, port = line.split()[1].rsplit(":", 1)
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
            dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    server = await asyncio.start_server(tunnel, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


# -- tests -----------------------------------------------------------------------------------


def test_our_user_agent_names_the_program_its_version_and_platform(monkeypatch):
    monkeypatch.setattr("sys.argv", ["/usr/bin/passthrough", "agent", "--node-name", "n"])
    agent = client.user_agent()
    assert agent.startswith("passthrough/0.1.0 (linux/") and agent.endswith(") agent"), agent
    monkeypatch.setattr("sys.argv", ["pytest"])
    assert client.user_agent().startswith("passthrough/") and client.user_agent().endswith(")")


async def test_every_request_carries_our_user_agent_and_a_429_is_waited_out_on_every_verb():
    seen: list[tuple[str, str]] = []
    refusals: dict[str, int] = {}

    async def handler(request: web.Request) -> web.Response:
        seen.append((request.method, request.headers.get("User-Agent", "")))
        key = f"{request.method} {request.path}"
        if refusals.get(key, 0) < 2:
            refusals[key] = refusals.get(key, 0) + 1
            return web.json_response({"kind": "Status", "code": 429}, status=429, headers={"Retry-After": "0"})
        return web.json_response({"ok": request.method})

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handler)
    runner, url = await serve(app)
    try:
        async with Session(client._http(ssl.create_default_context(), 4), url) as session:
            # A Node read, a Node's label patch, an Event: each was refused twice first.
            assert await session.request("GET", "/api/v1/nodes/n") == {"ok": "GET"}
            assert await session.request("PATCH", "/api/v1/nodes/n", body={}, content_type=client.APPLY_PATCH) == {"ok": "PATCH"}
            assert await session.request("POST", "/api/v1/namespaces/default/events", body={}) == {"ok": "POST"}
            with pytest.raises(ApiError) as refused:
                await session.request("DELETE", "/x", attempts=2)  # out of tries: the 429 is the answer
            assert refused.value.status == 429
    finally:
        await runner.cleanup()
    assert len(seen) == 3 * 3 + 2
    assert {agent for _, agent in seen} == {client.USER_AGENT}


async def test_a_rotated_ca_and_client_certificate_are_read_again_without_a_restart(tmp_path, monkeypatch):
    monkeypatch.setattr(client, "CERTIFICATES_RECHECK_SECONDS", 0.0)
    server_ca, issue_server = authority(tmp_path, "server-ca")
    client_ca, issue_client = authority(tmp_path, "client-ca")
    cert, key = issue_server("server", server=True)
    (tmp_path / "server.crt").write_bytes(cert)
    (tmp_path / "server.key").write_bytes(key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=str(client_ca))
    context.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")
    context.verify_mode = ssl.CERT_REQUIRED

    async def whoami(request: web.Request) -> web.Response:
        peer = request.transport.get_extra_info("peercert")
        return web.json_response({"cn": dict(x[0] for x in peer["subject"])["commonName"]})

    app = web.Application()
    app.router.add_get("/whoami", whoami)
    runner, url = await serve(app, context)
    other_ca, _ = authority(tmp_path, "other-ca")
    (tmp_path / "ca.crt").write_bytes(other_ca.read_bytes())  # not yet the server's CA
    for name in ("alice", "bob"):
        (tmp_path / f"{name}.crt").write_bytes((pair := issue_client(name, server=False))[0])
        (tmp_path / f"{name}.key").write_bytes(pair[1])
    (tmp_path / "tls.crt").write_bytes((tmp_path / "alice.crt").read_bytes())
    (tmp_path / "tls.key").write_bytes((tmp_path / "alice.key").read_bytes())
    path = kubeconfig(tmp_path / "config", url, {"certificate-authority": "ca.crt"},
                      {"client-certificate": "tls.crt", "client-key": "tls.key"})  # fmt: skip
    try:
        async with await open_session(path) as session:
            with pytest.raises(Exception, match="certificate verify failed"):
                await session.request("GET", "/whoami")
            (tmp_path / "ca.crt").write_bytes(server_ca.read_bytes())  # the CA rotated in place
            assert await session.request("GET", "/whoami") == {"cn": "alice"}
            # The certificate written before its key: the pair cannot be loaded yet, the old one stays.
            (tmp_path / "tls.crt").write_bytes((tmp_path / "bob.crt").read_bytes())
            assert await session.request("GET", "/whoami") == {"cn": "alice"}
            (tmp_path / "tls.key").write_bytes((tmp_path / "bob.key").read_bytes())
            assert await session.request("GET", "/whoami") == {"cn": "bob"}
            assert session.tls.reloads == 2
    finally:
        await runner.cleanup()


async def test_a_kubeconfigs_proxy_url_carries_every_request_with_its_credentials(tmp_path):
    ca, issue = authority(tmp_path, "ca")
    cert, key = issue("server", server=True)
    (tmp_path / "server.crt").write_bytes(cert)
    (tmp_path / "server.key").write_bytes(key)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tmp_path / "server.crt", tmp_path / "server.key")

    async def upstream(request: web.Request) -> web.Response:
        return web.json_response({"via": "proxy"})

    app = web.Application()
    app.router.add_get("/api", upstream)
    runner, url = await serve(app, context)
    tunnels: list[tuple[str, str]] = []
    server, proxy_port = await connect_proxy(tunnels)
    path = kubeconfig(tmp_path / "config", url, {"proxy-url": f"http://who:secret@127.0.0.1:{proxy_port}",
                                                 "certificate-authority": str(ca)}, {"token": "t"})  # fmt: skip
    try:
        async with await open_session(path) as session:
            assert session.proxy == f"http://127.0.0.1:{proxy_port}"
            assert await session.request("GET", "/api") == {"via": "proxy"}
            assert await session.request("GET", "/api") == {"via": "proxy"}
    finally:
        server.close()
        await runner.cleanup()
    assert tunnels == [(f"CONNECT {url.removeprefix('https://')} HTTP/1.1", "Basic d2hvOnNlY3JldA==")]  # who:secret, one tunnel kept


def test_a_proxy_url_that_is_not_http_is_refused_with_why(tmp_path):
    path = kubeconfig(tmp_path / "config", "https://127.0.0.1:1", {"proxy-url": "socks5://127.0.0.1:1080"}, {})
    with pytest.raises(KubeconfigError, match="only an http:// proxy is supported"):
        asyncio.run(open_session(path))


async def test_watches_cut_off_together_come_back_spread_out(monkeypatch):
    waits: list[float] = []

    class Gone:
        async def request(self, *_a, **_k):
            raise ApiError(503, "Service Unavailable")

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) % 2 == 0:
            raise asyncio.CancelledError

    informers = [cache.Informer(Gone(), "things", lambda b: b) for _ in range(200)]
    monkeypatch.setattr(cache.asyncio, "sleep", sleep)
    for informer in informers:
        with pytest.raises(asyncio.CancelledError):
            await informer.run()
    first, second = waits[0::2], waits[1::2]
    assert all(1 <= w < 2 for w in first) and all(2 <= w < 4 for w in second)  # the backoff, doubled, each jittered
    assert max(first) - min(first) > 0.8 and len({round(w, 3) for w in first}) > 150  # not in step


async def test_relists_after_a_410_are_spread(monkeypatch):
    waits: list[float] = []

    class Expired:
        async def request(self, *_a, **_k):
            return {"items": [], "metadata": {"resourceVersion": "5"}}

        def watch(self, *_a, **_k):
            raise ApiError(410, "Gone")

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        raise asyncio.CancelledError

    monkeypatch.setattr(cache.asyncio, "sleep", sleep)
    for _ in range(100):
        with pytest.raises(asyncio.CancelledError):
            await cache.Informer(Expired(), "things", lambda b: b).run()
    assert all(0 <= w <= 1 for w in waits) and max(waits) - min(waits) > 0.8
