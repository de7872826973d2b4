"""DRA mode: one DeviceClass per namespace that has devices handed out, `passthrough-<namespace>`,
whose CEL selector matches exactly the devices the agents publish for that namespace. A tenant
asks for a device of its namespace by that class; the claim webhook keeps other namespaces off it
and the allocation webhook (admission/claims.py) holds whatever class a claim uses.

And one for the pool, `passthrough-pool.gpu` (the dot keeps it from ever being a namespace's
class: a namespace name has none): the unassigned GPUs of nodes in GPU passthrough mode, which any
namespace may claim by model with a selector of its own on `passthrough.io/resourceName` or
`passthrough.io/model`. It is there whenever DRA mode is, pool devices or not, so that a tenant's
claim template does not depend on which nodes are in GPU mode today.

Pure: what classes there should be, and which writes bring the live ones there (none when they
are as they should be). The reconciler carries the plan out.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from passthrough.admission.claims import CLASS_PREFIX, POOL_CLASS, handed_to
from passthrough.api.labels import DRA_MODE
from passthrough.api.views import NodeDevice
from passthrough.dra.slice import DOMAIN, DRIVER
from passthrough.kube.custom import OPERATOR_MANAGER

API_VERSION = "resource.k8s.io/v1"
PLURAL = "deviceclasses"
# Which namespace a class of ours is for; only classes with both labels are ours to change or delete.
NAMESPACE_LABEL = "passthrough.io/namespace"
MANAGED_BY = "app.kubernetes.io/managed-by"


@dataclass(frozen=True)
class Live:
    """A DeviceClass of ours as the index holds it: the namespace its label names, and its selectors."""

    namespace: str
    selectors: Any

    @classmethod
    def of(cls, labels: Mapping[str, str], spec: Mapping[str, Any]) -> Live:
        return cls(labels.get(NAMESPACE_LABEL, ""), spec.get("selectors"))


def live_classes(index: Mapping[str, Iterable[Live]] | None) -> dict[str, Live]:
    """The DeviceClasses of ours by name, from their index (each key a store of values)."""
    return {name: found for name, store in (index or {}).items() for found in list(store)[:1]}


POOL = ""  # the pool's "namespace": what its devices carry in passthrough.io/namespace


def class_name(namespace: str) -> str:
    return POOL_CLASS if namespace == POOL else CLASS_PREFIX + namespace


def selects(namespace: str) -> str:
    """What the class of `namespace` selects, for the log."""
    return "the unassigned GPUs of nodes in GPU passthrough mode" if namespace == POOL else f"the devices handed out to namespace {namespace}"


def selectors(namespace: str) -> list[dict[str, Any]]:
    # A namespace name is a DNS label: nothing in it needs quoting in CEL.
    expression = f'device.driver == "{DRIVER}" && device.attributes["{DOMAIN}"].namespace == "{namespace}"'
    return [{"cel": {"expression": expression}}]


def body(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": "DeviceClass",
        "metadata": {"name": class_name(namespace), "labels": {NAMESPACE_LABEL: namespace, MANAGED_BY: OPERATOR_MANAGER}},
        "spec": {"selectors": selectors(namespace)},
    }


def through_dra(serving: str, spec: Mapping[str, Any] | None) -> bool:
    """Whether a node serves its devices through DRA (a claim of a DeviceClass reaches them, and KubeVirt
    needs no allow-list entry for them): its agent's word, the Node's passthrough.io/serving label, or
    until it has said, the cluster's default (the PassthroughConfig's spec.dra.enabled)."""
    if serving:
        return serving == DRA_MODE
    dra = (spec or {}).get("dra")
    return isinstance(dra, Mapping) and dra.get("enabled") is True


def namespaces_with_devices(node_devices: Iterable[NodeDevice]) -> set[str]:
    """The namespaces the operator has handed at least one device to."""
    return {namespace for d in node_devices if (namespace := handed_to(d)[0])}


def plan(wanted: Collection[str], live: Mapping[str, Live]) -> tuple[list[str], list[str]]:
    """(namespaces whose class to apply, names of classes to delete): a class is applied when it is
    missing or differs from what it should be, deleted when its namespace has no device left. The
    pool's class (namespace POOL) is always wanted."""
    wanted = {*wanted, POOL}
    apply = [ns for ns in sorted(wanted) if live.get(class_name(ns)) != Live(ns, selectors(ns))]
    delete = sorted(name for name, found in live.items() if found.namespace not in wanted and name == class_name(found.namespace))
    return apply, delete
