"""Refuse to start without our CRDs: every write would fail, one object at a time."""

from __future__ import annotations

from typing import Any

import aiohttp

from passthrough.api.names import GROUP, VERSION
from passthrough.kube.client import ApiError, session_of
from passthrough.kube.connect import CannotStart


async def require_crds(api: Any, *plurals: str) -> None:
    """Refuse to start without our CRDs: every write would fail, one object at a time."""
    try:
        resources = await session_of(api).request("GET", f"/apis/{GROUP}/{VERSION}", timeout=30)
    except ApiError as exc:
        if exc.status == 404:
            raise CannotStart(
                f"the {GROUP} CRDs are not installed in this cluster: kubectl apply -f crds/ (or install the chart)"
            ) from None
        raise CannotStart(f"cannot read {GROUP}/{VERSION} from the API server: {exc.status} {exc.reason}") from None
    except (OSError, TimeoutError, aiohttp.ClientError) as exc:
        raise CannotStart(f"cannot reach the API server: {exc or type(exc).__name__}") from None
    names = {r.get("name") for r in resources.get("resources") or []}
    missing = [p for p in plurals if p not in names]
    if missing:
        raise CannotStart(f"CRDs missing from the cluster: {', '.join(f'{p}.{GROUP}' for p in missing)}; kubectl apply -f crds/")
