"""The kubelet's question before it hands an exclusive device to a pod: may this pod have it?"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

from passthrough.agent import report
from passthrough.kube.client import ApiError
from passthrough.pci.naming import EXCLUSIVE_DOMAIN


async def admit(session: Any, node_name: str, assignments: Mapping[str, str], resource: str) -> str:
    """Only a pod of the namespace the device is handed out to may have it. The kubelet does not
    say which pod asks; it admits a node's pods oldest first, so the one asking is the oldest
    pending pod here that requests the resource. A pod of the namespace the device left (pending
    since then) is refused, and the kubelet fails it. "" allows; a pool is any namespace's."""
    prefix = f"{EXCLUSIVE_DOMAIN}/"
    if not resource.startswith(prefix):
        return ""
    namespace = assignments.get(resource[len(prefix):], "")
    if not namespace:
        return f"{resource} is handed out to no namespace now, so no pod may have it"
    try:
        pods = await session.request("GET", "/api/v1/pods", query={
            "fieldSelector": f"spec.nodeName={node_name},status.phase=Pending"})  # fmt: skip
    except (ApiError, OSError, aiohttp.ClientError) as exc:
        return f"cannot tell which pod asks for {resource} ({exc}); refused rather than risk another namespace's pod"
    asking = sorted((p for p in pods.get("items", []) if report.requests(p, resource)),
                    key=lambda p: (p["metadata"].get("creationTimestamp", ""), p["metadata"]["name"]))  # fmt: skip
    if not asking or asking[0]["metadata"]["namespace"] == namespace:
        return ""
    pod = asking[0]["metadata"]
    return (f"pod {pod['namespace']}/{pod['name']} asks for {resource}, which belongs to namespace {namespace} now: "
            f"a pod of {pod['namespace']} never gets it")  # fmt: skip
