"""`passthrough operator`: run the Kopf operator until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import hashlib
import logging
import os
import signal
import socket
import ssl
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from passthrough import metrics
from passthrough.api.models import NODE_PCI_DEVICE, PASSTHROUGH_CONFIG, PCI_DEVICE
from passthrough.controller.metrics import OPERATOR, OPERATOR_STATE
from passthrough.durations import DurationError, parse_duration
from passthrough.kube.connect import CannotStart, session, smaller_tls_buffers
from passthrough.kube.preflight import require_crds
from passthrough.kube.review import MetricsReviewer

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    import kopf


async def _preflight(kubeconfig: str | None) -> None:
    api = await session(kubeconfig)
    try:
        await require_crds(api, NODE_PCI_DEVICE.plural, PCI_DEVICE.plural, PASSTHROUGH_CONFIG.plural)
    finally:
        await api.close()


@contextlib.contextmanager
def _without_kubernetes_asyncio() -> Iterator[None]:
    """Kopf, imported and its handlers registered, without kubernetes_asyncio.

    Kopf recognises that package's model objects and offers a login through it when it is
    installed, which imports a class for every Kubernetes type: 32 MiB of the operator's
    memory. Our handlers hand Kopf plain dicts, log in with Kopf's own kubeconfig and service
    account logins, and our own requests go through passthrough.kube. (A process that
    already has the package, such as a test's, keeps it.)
    """
    if "kubernetes_asyncio" in sys.modules:
        yield
        return
    sys.modules["kubernetes_asyncio"] = None  # type: ignore[assignment]  # an ImportError to Kopf
    try:
        yield
    finally:
        del sys.modules["kubernetes_asyncio"]


def load_kopf() -> Any:
    """Kopf, and its registry made (which looks for the client libraries when made)."""
    with _without_kubernetes_asyncio():
        import kopf

        kopf.get_default_registry()
    return kopf


def run(args: argparse.Namespace) -> int:
    kopf = load_kopf()
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if not args.verbose:
        # Kopf narrates every watch and handler at INFO; an operator of 2,000 devices should not.
        logging.getLogger("kopf").setLevel(logging.WARNING)
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)  # every liveness probe
    try:
        grace = parse_duration(args.not_found_grace)
    except DurationError as exc:
        print(f"passthrough operator: --not-found-grace: {exc}", file=sys.stderr)
        return 2
    webhook_server = None
    if args.webhook_port:
        if not args.webhook_cert_dir:
            print("passthrough operator: --webhook-port needs --webhook-cert-dir (tls.crt, tls.key)", file=sys.stderr)
            return 2
        cert_dir = Path(args.webhook_cert_dir)
        missing = [str(cert_dir / f) for f in ("tls.crt", "tls.key") if not (cert_dir / f).is_file()]
        if missing:
            print(f"passthrough operator: --webhook-cert-dir: {', '.join(missing)} not found", file=sys.stderr)
            return 2
        try:
            check = parse_duration(args.webhook_cert_check)
        except DurationError as exc:
            print(f"passthrough operator: --webhook-cert-check: {exc}", file=sys.stderr)
            return 2
        webhook_server = _listening_webhook_server(kopf)(
            addr=args.webhook_addr, port=args.webhook_port, certfile=cert_dir / "tls.crt", pkeyfile=cert_dir / "tls.key",
            # The context stays the listener's for the process's life: a renewal is loaded into it.
            context=ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH), file_check_interval=check,
        )
    leadership = None
    if args.leader_elect:
        try:
            leadership = _leadership(args)
        except (DurationError, ValueError) as exc:
            print(f"passthrough operator: --leader-elect-*: {exc}", file=sys.stderr)
            return 2
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # Kopf's own client logs in from it
    try:
        asyncio.run(_preflight(args.kubeconfig))
    except CannotStart as exc:
        print(f"passthrough operator: {exc}", file=sys.stderr)
        return 1

    from passthrough.controller import handlers  # noqa: F401  (registers the handlers)

    if args.dra:
        handlers.register_device_classes()
        handlers.register_claims()

    if webhook_server is not None:
        # Registered only with a server to answer them: Kopf will not start otherwise.
        from passthrough.admission import webhook  # noqa: F401

    memo = kopf.Memo(
        kubeconfig=args.kubeconfig, grace=datetime.timedelta(seconds=grace), workers=args.workers, webhook_server=webhook_server
    )
    if leadership is not None:
        memo.leadership = leadership  # handlers.startup gates the reconciler on it
    OPERATOR_STATE.reconciler = lambda: memo.get("reconciler")  # made by handlers.startup
    smaller_tls_buffers()
    return asyncio.run(_operate(memo, args))


async def _operate(memo: kopf.Memo, args: argparse.Namespace) -> int:
    # The metrics' reviews go on a session of their own: Kopf's startup makes the reconciler's.
    reviews = await session(args.kubeconfig, connections=2) if args.metrics_auth and args.metrics_port else None
    try:
        return await _serve_and_operate(memo, args, MetricsReviewer(reviews) if reviews is not None else None)
    finally:
        if reviews is not None:
            await reviews.close()


async def _serve_and_operate(memo: kopf.Memo, args: argparse.Namespace, authorize: MetricsReviewer | None) -> int:
    import kopf

    try:
        endpoint = await metrics.serve(OPERATOR, args.metrics_port, args.metrics_addr, authorize)
    except OSError as exc:
        print(f"passthrough operator: --metrics-port {args.metrics_port}: {exc}", file=sys.stderr)
        return 1
    readiness = None
    try:
        readiness = await _serve_readiness(args.readiness, lambda: _not_ready(memo))
    except (OSError, ValueError) as exc:
        print(f"passthrough operator: --readiness {args.readiness}: {exc}", file=sys.stderr)
        if endpoint is not None:
            await endpoint.cleanup()
        return 1
    try:
        # standalone: no Kopf peering (see handlers.startup); --leader-elect is what lets replicas run side by side.
        stop = asyncio.Event()
        if memo.webhook_server is not None:
            memo.webhook_server.stop = stop
        await kopf.operator(clusterwide=True, standalone=True, memo=memo, liveness_endpoint=args.liveness or None,
                            stop_flag=stop)  # fmt: skip
    finally:
        for runner in (endpoint, readiness):
            if runner is not None:
                await runner.cleanup()
    return 0


# -- high availability: leader election and readiness --------------------------------------------


def _leadership(args: argparse.Namespace) -> Any:
    from passthrough.controller.leader import Leadership, Timing

    timing = Timing(
        lease_duration=parse_duration(args.leader_elect_lease_duration),
        renew_deadline=parse_duration(args.leader_elect_renew_deadline),
        retry_period=parse_duration(args.leader_elect_retry_period),
    )
    # A restarted container keeps its pod's name: the suffix keeps it from renewing, as if it had
    # never stopped, a Lease its previous self held (client-go's controllers do the same).
    identity = args.leader_elect_identity or f"{os.environ.get('POD_NAME') or socket.gethostname()}_{uuid.uuid4().hex[:8]}"
    namespace = args.leader_elect_resource_namespace or os.environ.get("POD_NAMESPACE") or "default"
    return Leadership(identity, args.leader_elect_resource_name, namespace, timing)


# Seconds a replica keeps answering admission calls after SIGTERM, each answer closing its
# connection (`Connection: close`), before it stops. The API server keeps idle HTTP/1.1
# connections to the webhook alive, and one the replica closes just as the API server sends a
# call on it fails that call (EOF; a POST is not retried): HTTP/1.1 cannot announce the close.
# Calls in the drain take the connections they use out of the API server's pool by the
# protocol, so few idle ones are left for the close. (In a pod, the preStop sleep keeps the
# replica answering while it leaves the endpoints; this drain follows it.)
DRAIN = 2.0


def _listening_webhook_server(kopf: Any) -> Any:
    """Kopf's WebhookServer, saying when it listens (for the readiness probe), and draining its
    connections on SIGTERM (`DRAIN`) before the operator stops."""

    class WebhookServer(kopf.WebhookServer):
        listening = False
        draining = False
        stop = None  # the operator's stop flag (an asyncio.Event), set once the drain is over

        async def __call__(self, fn):  # type: ignore[override]
            async for config in super().__call__(fn):
                self.listening = True
                # From here SIGTERM drains first. Installed after Kopf's own handler (it installs
                # it as it starts, long before the webhook server listens), so it replaces it.
                if self.stop is not None:
                    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, self._drain_then_stop)
                yield config

        def _drain_then_stop(self) -> None:
            if not WebhookServer.draining:
                WebhookServer.draining = True
                log.info("SIGTERM: answering admission calls for %.0fs more, closing each connection after its "
                         "answer, then stopping", DRAIN)  # fmt: skip
                asyncio.get_running_loop().call_later(DRAIN, self.stop.set)

        async def _reload_renewed_certificate(self) -> None:
            """Load a renewed certificate into the live listener's context, forever.

            Kopf returns from this wait when the files change and restarts its server with them:
            every open connection closed without the drain, and the port briefly not listening,
            so the API server's calls in flight or just then fail on every replica at once. A
            context loaded anew serves the renewed pair from the next handshake on and closes
            nothing. A pair caught half-written (the key not yet the certificate's) is tried in a
            context of its own first and the live one is left as it was until the next look."""
            loaded = _digest(self.certfile, self.pkeyfile)
            while True:
                await asyncio.sleep(self.file_check_interval)
                try:
                    seen = _digest(self.certfile, self.pkeyfile)
                    if seen == loaded:
                        continue
                    ssl.create_default_context(purpose=ssl.Purpose.CLIENT_AUTH).load_cert_chain(self.certfile, self.pkeyfile)
                    self.context.load_cert_chain(self.certfile, self.pkeyfile)
                except (OSError, ssl.SSLError) as exc:
                    log.warning("the renewed webhook certificate in %s does not load yet (%s); serving the one before "
                                "it, looking again in %gs", Path(self.certfile).parent, exc, self.file_check_interval)  # fmt: skip
                    continue
                loaded = seen
                log.info("serving the renewed webhook certificate from %s", Path(self.certfile).parent)

        # Kopf's name for the wait its __call__ restarts the server after (name-mangled there);
        # test_webhook_renewal fails if a Kopf release renames it and the restarts come back.
        _WebhookServer__sleep_forever_or_until_ssl_files_change = _reload_renewed_certificate

        @staticmethod
        async def _serve(fn, request):  # type: ignore[override]
            response = await kopf.WebhookServer._serve(fn, request)
            if WebhookServer.draining:
                response.force_close()  # Connection: close, and the connection closes after this answer
            return response

    return WebhookServer


def _digest(*paths: Any) -> str:
    """One hash of the files' contents (the secrets themselves are not kept)."""
    hasher = hashlib.sha256()
    for path in paths:
        hasher.update(Path(path).read_bytes())
    return hasher.hexdigest()


def _not_ready(memo: Any) -> list[str]:
    """What keeps this replica from answering admission requests right (empty: ready). Leadership
    is not among them: every replica serves the webhooks from its own caches."""
    missing = []
    server = memo.get("webhook_server")
    if server is not None and not server.listening:
        missing.append("the webhook server does not listen yet")
    if "indexed" not in memo or not memo.indexed.is_set():
        missing.append("Kopf's indexes are not filled yet")
    for name in ("node_devices", "devices"):
        informer = memo.get(name)
        if informer is None or not informer.synced.is_set():
            missing.append(f"the {name.replace('_', ' ')} cache has no listing yet")
    return missing


async def _serve_readiness(url: str, not_ready: Any) -> Any:
    """Serve GET `url`: 200 when `not_ready()` is empty, else 503 with its reasons; None without a URL."""
    if not url:
        return None
    from urllib.parse import urlsplit

    from aiohttp import web

    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.port:
        raise ValueError("an http://ADDR:PORT/PATH URL is needed")

    async def probe(_: web.Request) -> web.Response:
        missing = not_ready()
        return web.Response(status=503 if missing else 200, text="; ".join(missing) + "\n" if missing else "ok\n")

    app = web.Application()
    app.router.add_get(parts.path or "/", probe)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, parts.hostname, parts.port).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
