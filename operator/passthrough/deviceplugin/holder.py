"""A pod that holds a device, as the kubelet's PodResources API tells it (no gRPC here: the
agent's plan uses it without loading the API)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Holder:
    """A pod that holds a device, and under which resource."""

    namespace: str
    pod: str
    resource: str

    def __str__(self) -> str:
        return f"pod {self.namespace}/{self.pod} ({self.resource})"
