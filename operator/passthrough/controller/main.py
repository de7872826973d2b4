"""`passthrough operator`: run the Kopf operator until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from passthrough import metrics
from passthrough.api.models import NODE_PCI_DEVICE, PASSTHROUGH_CONFIG, PCI_DEVICE
from passthrough.controller.metrics import OPERATOR, OPERATOR_STATE
from passthrough.durations import DurationError, parse_duration
from passthrough.kube.connect import CannotStart, session
from passthrough.kube.preflight import require_crds

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
        webhook_server = kopf.WebhookServer(
            addr=args.webhook_addr, port=args.webhook_port, certfile=cert_dir / "tls.crt", pkeyfile=cert_dir / "tls.key"
        )
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig  # Kopf's own client logs in from it
    try:
        asyncio.run(_preflight(args.kubeconfig))
    except CannotStart as exc:
        print(f"passthrough operator: {exc}", file=sys.stderr)
        return 1

    from passthrough.controller import handlers  # noqa: F401  (registers the handlers)

    if webhook_server is not None:
        # Registered only with a server to answer them: Kopf will not start otherwise.
        from passthrough.admission import webhook  # noqa: F401

    memo = kopf.Memo(
        kubeconfig=args.kubeconfig, grace=datetime.timedelta(seconds=grace), workers=args.workers, webhook_server=webhook_server
    )
    OPERATOR_STATE.reconciler = lambda: memo.get("reconciler")  # made by handlers.startup
    return asyncio.run(_operate(memo, args))


async def _operate(memo: kopf.Memo, args: argparse.Namespace) -> int:
    import kopf

    try:
        endpoint = await metrics.serve(OPERATOR, args.metrics_port, args.metrics_addr)
    except OSError as exc:
        print(f"passthrough operator: --metrics-port {args.metrics_port}: {exc}", file=sys.stderr)
        return 1
    try:
        await kopf.operator(clusterwide=True, standalone=True, memo=memo, liveness_endpoint=args.liveness or None)
    finally:
        if endpoint is not None:
            await endpoint.cleanup()
    return 0
