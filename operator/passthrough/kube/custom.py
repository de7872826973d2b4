"""One kind of custom object, with server-side apply as the only write verb, and the field
managers we apply under."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from passthrough.api.names import GROUP, VERSION
from passthrough.kube.client import APPLY_PATCH, ApiError, session_of
from passthrough.kube.watch import watch_events

AGENT_MANAGER = "passthrough-agent"
OPERATOR_MANAGER = "passthrough-operator"


class Custom:
    """One kind of custom object, cluster-scoped or namespaced, with apply as the only write verb."""

    def __init__(self, api: Any, plural: str, namespaced: bool = False, group: str = GROUP, version: str = VERSION) -> None:
        self.session = session_of(api)
        self.plural, self.namespaced, self.group, self.version = plural, namespaced, group, version

    def path(self, name: str = "", namespace: str | None = None, status: bool = False) -> str:
        path = f"/apis/{self.group}/{self.version}"
        if self.namespaced and namespace:
            path += f"/namespaces/{namespace}"
        path += f"/{self.plural}"
        if name:
            path += f"/{name}" + ("/status" if status else "")
        return path

    async def get(self, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return await self.session.request("GET", self.path(name, namespace))
        except ApiError as exc:
            if exc.status == 404:
                return None
            raise

    async def list(self, label_selector: str = "", namespace: str | None = None, **query: Any) -> dict[str, Any]:
        return await self.session.request("GET", self.path(namespace=namespace), query={"labelSelector": label_selector, **query})

    async def apply(self, body: dict[str, Any], manager: str, status: bool = False, force: bool = True) -> dict[str, Any]:
        """Server-side apply of `body` (its metadata names the object); `status` targets the subresource."""
        path = self.path(body["metadata"]["name"], body["metadata"].get("namespace"), status)
        query = {"fieldManager": manager, "force": force}
        return await self.session.request("PATCH", path, query=query, body=body, content_type=APPLY_PATCH)

    async def delete(
        self, name: str, namespace: str | None = None, uid: str | None = None, resource_version: str | None = None
    ) -> int:
        """Delete; the answer's status: 200 (deleted or being deleted), 404 (already gone) or 409
        (a precondition failed: `uid` guards against a newer object of that name, `resource_version`
        against one that changed since it was decided on)."""
        preconditions = {k: v for k, v in (("uid", uid), ("resourceVersion", resource_version)) if v}
        body = {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": preconditions} if preconditions else None
        try:
            await self.session.request("DELETE", self.path(name, namespace), body=body)
            return 200
        except ApiError as exc:
            if exc.status in (404, 409):
                return exc.status
            raise

    async def watch(self, label_selector: str = "", resource_version: str = "", timeout: int = 300) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Events after `resource_version` until the server ends the watch; raises ApiError(410) when too old."""
        async for event in watch_events(self.session, self.path(), labelSelector=label_selector,
                                        resourceVersion=resource_version, allowWatchBookmarks=True, timeoutSeconds=timeout):  # fmt: skip
            yield event
