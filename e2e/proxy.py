"""A proxy on loopback in front of the API server, to drop connections the way networks do.

It terminates TLS with a certificate of its own (`ca_file` for clients), opens TLS to the
real API server, and passes requests and answers through. `hang_up()` closes every open
connection and, from then on, closes each connection as soon as its client has sent a
request, before any answer: the client sees a server that accepted a connection and went
away mid-request (aiohttp's `ServerDisconnectedError`), which a refused connection does not
show. `pass_through()` goes back to normal. Only loopback is used.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime
import ipaddress
import ssl
from pathlib import Path

import yaml


def _self_signed(directory: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flaky-proxy")])
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    cert_file, key_file = directory / "proxy.crt", directory / "proxy.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))  # fmt: skip
    return cert_file, key_file


class FlakyProxy:
    def __init__(self, cluster, workdir: Path) -> None:
        self.cluster = cluster
        self.workdir = Path(workdir)
        self.ca_file, self._key_file = _self_signed(self.workdir)
        self.port = 0
        self.hanging_up = False
        self.hung_up = 0  # requests left unanswered so far
        self._server: asyncio.base_events.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> FlakyProxy:
        serving = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        serving.load_cert_chain(self.ca_file, self._key_file)
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=serving)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def kubeconfig(self, path: Path) -> Path:
        """The cluster's admin kubeconfig, through this proxy."""
        config = yaml.safe_load(self.cluster.kubeconfig.read_text())
        cluster = config["clusters"][0]["cluster"]
        cluster["server"] = f"https://127.0.0.1:{self.port}"
        cluster["certificate-authority-data"] = base64.b64encode(self.ca_file.read_bytes()).decode()
        path.write_text(yaml.safe_dump(config))
        path.chmod(0o600)
        return path

    def hang_up(self) -> None:
        self.hanging_up = True
        for writer in list(self._writers):  # pooled connections too: in-flight requests end here
            writer.close()

    def pass_through(self) -> None:
        self.hanging_up = False

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            await self._server.wait_closed()

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        upstream = ssl.create_default_context(cafile=str(self.cluster.ca_file))
        host, port = self.cluster.server.removeprefix("https://").rsplit(":", 1)
        try:
            upstream_reader, upstream_writer = await asyncio.open_connection(host, int(port), ssl=upstream)
        except OSError:
            client_writer.close()
            return
        writers = (client_writer, upstream_writer)
        self._writers.update(writers)

        async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, requests: bool) -> None:
            with contextlib.suppress(OSError, ssl.SSLError):
                while data := await reader.read(65536):
                    if requests and self.hanging_up:
                        self.hung_up += 1
                        break
                    writer.write(data)
                    await writer.drain()
            for w in writers:
                w.close()

        try:
            await asyncio.gather(pump(client_reader, upstream_writer, True), pump(upstream_reader, client_writer, False))
        finally:
            self._writers.difference_update(writers)
