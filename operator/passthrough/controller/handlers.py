"""Kopf handlers of the operator: indexes for lookups, event handlers that only enqueue.

Only `on.event` and `index` handlers are used: Kopf writes nothing to objects for them (no
last-handled-configuration annotation, no progress annotations, no finalizer). The work is
done by `controller.reconciler`, which writes with server-side apply under one field manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from typing import Any

import kopf

from passthrough.admission.rules import PREFIX as EXCLUSIVE_PREFIX, referenced_device_names
from passthrough.api.models import CONFIG_NAME, GROUP, NODE_PCI_DEVICE, PASSTHROUGH_CONFIG, PCI_DEVICE, VERSION
from passthrough.controller import reconciler as rec
from passthrough.controller.kubevirt_sync import ConfigView, KubeVirtView
from passthrough.controller.lifecycle import Device, NodeDevice
from passthrough.k8s import connect

log = logging.getLogger(__name__)


# -- lifecycle of the operator ---------------------------------------------------------------


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    # Our own Events, written when a condition changes; Kopf must not turn logs into Events.
    settings.posting.enabled = False
    # One replica (Deployment strategy Recreate); no peering objects to keep.
    settings.peering.standalone = True
    # The batch window delays every reaction; ours are cheap and idempotent.
    settings.batching.batch_window = 0.02
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    memo.api = await connect(memo.get("kubeconfig"))
    indices = {
        name: kwargs[name]
        for name in (rec.NODE_DEVICES, rec.DEVICES, rec.VM_REFERENCES, rec.NAMESPACES, rec.CONFIGS, rec.KUBEVIRTS, rec.GROUPS,
                     rec.NODES)
    }
    memo.reconciler = rec.Reconciler(
        memo.api, indices, default_grace=memo.get("grace", datetime.timedelta(minutes=10)), workers=memo.get("workers", 64)
    )
    memo.vm_seen = {}
    memo.indexed = asyncio.Event()
    memo.tasks = [asyncio.create_task(_run_when_indexed(memo), name="reconciler")]


async def _run_when_indexed(memo: kopf.Memo) -> None:
    # Kopf calls resource handlers only once every index holds its initial listing; deciding
    # before that could, say, drop the finalizer of a device a VM still uses.
    await memo.indexed.wait()
    await memo.reconciler.run()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    for task in memo.get("tasks", []):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if "reconciler" in memo:
        memo.reconciler.queue.close()
        await memo.reconciler.events.drain()
    if "api" in memo:
        await memo.api.close()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


# -- indexes: small values, no bodies ------------------------------------------------------------
# All async: Kopf runs a plain function in a thread pool, one hop per object and event.


@kopf.index(GROUP, VERSION, NODE_PCI_DEVICE.plural, id=rec.NODE_DEVICES)
async def node_devices_index(name: str, body: kopf.Body, **_: Any) -> dict[str, NodeDevice]:
    return {name: NodeDevice.of(body)}


@kopf.index(GROUP, VERSION, NODE_PCI_DEVICE.plural, id=rec.GROUPS)
async def iommu_groups_index(name: str, status: kopf.Status, **_: Any) -> dict[tuple[str, int], str] | None:
    attributes = status.get("attributes") or {}
    group = attributes.get("iommuGroup", -1)
    return {(attributes.get("nodeName", ""), group): name} if isinstance(group, int) and group >= 0 else None


@kopf.index(GROUP, VERSION, NODE_PCI_DEVICE.plural, id="devices_by_namespace")
async def devices_by_namespace_index(name: str, spec: kopf.Spec, **_: Any) -> dict[str, str] | None:
    namespace = spec.get("assignedNamespace")
    return {namespace: name} if namespace else None


@kopf.index(GROUP, VERSION, NODE_PCI_DEVICE.plural, id="devices_by_node")
async def devices_by_node_index(name: str, body: kopf.Body, **_: Any) -> dict[str, str] | None:
    node = NodeDevice.of(body).node_name
    return {node: name} if node else None


@kopf.index("", "v1", "nodes", id=rec.NODES)
async def nodes_index(name: str, uid: str, **_: Any) -> dict[str, str]:
    return {name: uid}


@kopf.index(GROUP, VERSION, PCI_DEVICE.plural, id=rec.DEVICES)
async def devices_index(name: str, body: kopf.Body, **_: Any) -> dict[str, Device]:
    return {name: Device.of(body)}


@kopf.index("kubevirt.io", "v1", "virtualmachines", id=rec.VM_REFERENCES)
async def vm_references_index(name: str, namespace: str, spec: kopf.Spec, **_: Any) -> dict[tuple[str, str], str]:
    return {(namespace, EXCLUSIVE_PREFIX + device): name for device in referenced_device_names(dict(spec))}


@kopf.index("", "v1", "namespaces", id=rec.NAMESPACES)
async def namespaces_index(name: str, uid: str, status: kopf.Status, **_: Any) -> dict[str, tuple[str, str]]:
    return {name: (status.get("phase") or "Active", uid)}


@kopf.index(GROUP, VERSION, PASSTHROUGH_CONFIG.plural, id=rec.CONFIGS)
async def configs_index(name: str, body: kopf.Body, **_: Any) -> dict[str, ConfigView]:
    return {name: ConfigView.of(body)}


@kopf.index("kubevirt.io", "v1", "kubevirts", id=rec.KUBEVIRTS)
async def kubevirts_index(name: str, namespace: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], KubeVirtView]:
    return {(namespace, name): KubeVirtView.of(body)}


# -- events: enqueue the affected device names ---------------------------------------------------


async def _enqueue(memo: kopf.Memo, names) -> None:
    memo.indexed.set()
    for name in names:
        memo.reconciler.enqueue(name)
    await memo.reconciler.observed()


@kopf.on.event(GROUP, VERSION, NODE_PCI_DEVICE.plural)
async def node_device_event(name: str, status: kopf.Status, memo: kopf.Memo, iommu_groups: kopf.Index, **_: Any) -> None:
    # Its group's other functions decide with it: an assignment of one may unblock another.
    attributes = status.get("attributes") or {}
    siblings = iommu_groups.get((attributes.get("nodeName", ""), attributes.get("iommuGroup", -1)), [])
    await _enqueue(memo, {name, *siblings})
    memo.reconciler.sync_kubevirt_soon()  # what nodes advertise feeds the mismatch report


@kopf.on.event(GROUP, VERSION, PCI_DEVICE.plural)
async def device_event(name: str, memo: kopf.Memo, **_: Any) -> None:
    await _enqueue(memo, [name])
    memo.reconciler.sync_kubevirt_soon()  # each assigned device has its exclusive entry


@kopf.on.event("kubevirt.io", "v1", "kubevirts")
async def kubevirt_event(memo: kopf.Memo, **_: Any) -> None:
    await _enqueue(memo, [])
    memo.reconciler.sync_kubevirt_soon()  # it appeared, or someone edited our fields


@kopf.on.event("kubevirt.io", "v1", "virtualmachines")
async def vm_event(name: str, namespace: str, spec: kopf.Spec, type: str | None, memo: kopf.Memo, **_: Any) -> None:
    # A VM that drops a device must wake that device too, so remember what each VM listed.
    key = (namespace, name)
    now = set() if type == "DELETED" else referenced_device_names(dict(spec))
    before = memo.vm_seen.get(key, set())
    if now:
        memo.vm_seen[key] = now
    else:
        memo.vm_seen.pop(key, None)
    await _enqueue(memo, before | now)


@kopf.on.event("", "v1", "namespaces")
async def namespace_event(name: str, memo: kopf.Memo, devices_by_namespace: kopf.Index, **_: Any) -> None:
    await _enqueue(memo, list(devices_by_namespace.get(name, [])))


@kopf.on.event("", "v1", "nodes")
async def node_event(name: str, type: str | None, memo: kopf.Memo, devices_by_node: kopf.Index, **_: Any) -> None:
    # Only a Node's coming and going matters here; its status heartbeats do not.
    if type in ("ADDED", "DELETED"):
        await _enqueue(memo, list(devices_by_node.get(name, [])))


@kopf.on.event(GROUP, VERSION, PASSTHROUGH_CONFIG.plural)
async def config_event(name: str, memo: kopf.Memo, node_devices: kopf.Index, **_: Any) -> None:
    if name != CONFIG_NAME:
        return
    # The grace period may have changed: devices waiting on it decide again.
    await _enqueue(memo, [key for key, store in node_devices.items()
                          if any(d.missing_since or (d.ready and d.ready.reason == "NotFound") for d in store)])
    memo.reconciler.sync_kubevirt_soon()
