"""A session to the API server for a process that is starting: CannotStart says what to do
when there is none."""

from __future__ import annotations

import os
from typing import Any

from passthrough.kube.client import KubeconfigError, Session, open_session, session_of


class CannotStart(RuntimeError):
    """No kubeconfig, no API server, no CRDs: the message says what to do."""


async def session(kubeconfig: str | None = None, connections: int = 64) -> Session:
    """A session to the API server from the in-cluster service account, else from a kubeconfig.

    `connections`: how many requests may be in flight at once. Each open TLS connection holds
    a 256 KiB buffer in asyncio, so a long-running process keeps this to what it needs.
    """
    try:
        return await open_session(kubeconfig, connections)
    except KubeconfigError as exc:
        where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise CannotStart(f"no usable kubeconfig at {where} ({exc}); pass --kubeconfig, set KUBECONFIG, or run in a pod") from None


async def connect(kubeconfig: str | None = None, connections: int = 64) -> Any:
    """A kubernetes_asyncio ApiClient, for tests and tools that use its typed API (the
    operator and the agent use `session`); every helper here takes either."""
    from kubernetes_asyncio import client, config

    configuration = client.Configuration()
    if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST") and not os.environ.get("KUBECONFIG"):
        config.load_incluster_config(client_configuration=configuration)
    else:
        try:
            await config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        except (config.ConfigException, OSError) as exc:
            where = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"
            raise CannotStart(
                f"no usable kubeconfig at {where} ({exc}); pass --kubeconfig, set KUBECONFIG, or run in a pod"
            ) from None
    configuration.connection_pool_maxsize = connections
    api = client.ApiClient(configuration)
    api.rest_client.pool_manager._trust_env = False  # noqa: SLF001 (see Session._resolve_proxy_once)
    session_of(api)._resolve_proxy_once()  # noqa: SLF001
    return api


# asyncio gives every TLS connection a buffer of SSLProtocol.max_size (256 KiB) for the bytes it
# decrypts, zeroed when made, so all of it resident: 192 KiB more per connection than the
# 64 KiB (four TLS records a read) that the answers need, 12 MiB for the operator's 64.
# (Class-wide: the agent's and the operator's processes set it, at their start.)
TLS_READ_BUFFER = 64 * 1024


def smaller_tls_buffers() -> None:
    """Every TLS connection made from now on in this process reads into TLS_READ_BUFFER bytes."""
    from asyncio import sslproto

    sslproto.SSLProtocol.max_size = TLS_READ_BUFFER
