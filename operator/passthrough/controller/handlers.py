"""Kopf handlers of the operator: indexes for lookups, event handlers that only enqueue.

Only `on.event` and `index` handlers are used: Kopf writes nothing to objects for them (no
last-handled-configuration annotation, no progress annotations, no finalizer). NodePCIDevices
and PCIDevices, thousands of them, come from the informers started here instead, whose
callbacks only enqueue too. The work is done by `controller.reconciler`, which writes with
server-side apply under one field manager.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import logging
from typing import Any

import kopf

from passthrough.admission.claims import handed_to
from passthrough.admission.rules import PREFIX as EXCLUSIVE_PREFIX, referenced_device_names
from passthrough.api.labels import SERVING_LABEL
from passthrough.api.models import CONFIG_NAME, GROUP, NODE_PCI_DEVICE, PASSTHROUGH_CONFIG, PCI_DEVICE, VERSION
from passthrough.api.views import Device, NodeDevice
from passthrough.controller import allocations, deviceclasses
from passthrough.controller import reconciler as rec
from passthrough.controller.kubevirt_sync import ConfigView, KubeVirtView, device_sync_inputs, node_device_sync_inputs
from passthrough.kube.cache import Informer
from passthrough.kube.connect import session

log = logging.getLogger(__name__)


# -- lifecycle of the operator ---------------------------------------------------------------


@kopf.on.startup()
async def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    # Our own Events, written when a condition changes; Kopf must not turn logs into Events.
    settings.posting.enabled = False
    # No Kopf peering: it is not a Lease, and our handlers write nothing. Which replica
    # reconciles is decided by the Lease (controller/leader.py); every replica serves the webhooks.
    settings.peering.standalone = True
    # The batch window delays every reaction; ours are cheap and idempotent.
    settings.batching.batch_window = 0.02
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    # As many connections as workers: in a burst no write waits for a connection, and the API
    # server gets the operator's whole backlog at once (with 16, a burst of 500 assignments took
    # 9.5 s to settle instead of 7; bench_operator.py). Their TLS buffers are small (kube/connect.py).
    workers = memo.get("workers", 64)
    memo.api = await session(memo.get("kubeconfig"), connections=workers)
    # The kinds that number in the thousands are cached by our own informers (see kube/cache.py);
    # the few namespaces, nodes, VMs, configs and KubeVirt CRs stay in Kopf's indexes.
    memo.node_devices = Informer(memo.api, NODE_PCI_DEVICE.plural, NodeDevice.of, NODE_DEVICE_INDEXES,
                                 lambda old, new: _node_device_changed(memo, old, new))
    memo.devices = Informer(memo.api, PCI_DEVICE.plural, Device.of, DEVICE_INDEXES, lambda old, new: _device_changed(memo, old, new))
    indices = {
        **{name: kwargs[name] for name in (rec.VM_REFERENCES, rec.NAMESPACES, rec.CONFIGS, rec.KUBEVIRTS, rec.NODES)},
        **{name: kwargs[name] for name in (rec.DEVICE_CLASSES, rec.CLAIMS) if name in kwargs},  # DRA mode only
        **memo.node_devices.indexes,
        **memo.devices.indexes,
    }
    memo.reconciler = rec.Reconciler(
        memo.api, indices, default_grace=memo.get("grace", datetime.timedelta(minutes=10)), workers=workers
    )
    memo.reconciler.sync_device_classes_soon()
    memo.vm_seen = {}
    memo.node_serving = {}  # Node name -> the mode its agent said it serves in, as last seen
    memo.claim_seen = {}
    memo.indexed = asyncio.Event()
    memo.tasks = [
        asyncio.create_task(memo.node_devices.run(), name="informer of nodepcidevices"),
        asyncio.create_task(memo.devices.run(), name="informer of pcidevices"),
        asyncio.create_task(_run_when_indexed(memo), name="reconciler"),
    ]


async def _run_when_indexed(memo: kopf.Memo) -> None:
    # Kopf calls resource handlers only once every index holds its initial listing, and the
    # informers say when theirs is in; deciding before that could, say, drop the finalizer of
    # a device a VM still uses.
    await memo.indexed.wait()
    await memo.node_devices.synced.wait()
    await memo.devices.synced.wait()
    leadership = memo.get("leadership")  # --leader-elect: reconcile only while holding the Lease
    if leadership is None:
        await memo.reconciler.run()
    else:
        await leadership.lead(memo.api, lambda: _reconcile_as_leader(memo))


async def _reconcile_as_leader(memo: kopf.Memo) -> None:
    # Standing by, the queue kept what changed, not what the last leader had scheduled (grace
    # periods, retries): a new leader decides every device once.
    for index in (rec.NODE_DEVICES, rec.DEVICES):
        for name in list(memo.reconciler.indices[index].keys()):
            memo.reconciler.enqueue(name)
    memo.reconciler.sync_kubevirt_soon()
    memo.reconciler.sync_device_classes_soon()
    await memo.reconciler.run()


@kopf.on.cleanup()
async def cleanup(memo: kopf.Memo, **_: Any) -> None:
    for task in memo.get("tasks", []):
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    if "reconciler" in memo:
        memo.reconciler.queue.close()
        await memo.reconciler.events.close()
    if "api" in memo:
        await memo.api.close()


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


# -- indexes: small values, no bodies ------------------------------------------------------------
# Those of the informers are functions of the views they keep (NodeDevice, Device).


def _group_key(d: NodeDevice) -> dict[tuple[str, int], str] | None:
    group = d.attributes.get("iommuGroup", -1)
    return {(d.node_name, group): d.name} if isinstance(group, int) and group >= 0 else None


NODE_DEVICE_INDEXES = {
    rec.NODE_DEVICES: lambda d: {d.name: d},
    rec.GROUPS: _group_key,
    rec.DEVICES_BY_NAMESPACE: lambda d: {d.assigned_namespace: d.name} if d.assigned_namespace else None,
    rec.DEVICES_BY_NODE: lambda d: {d.node_name: d.name} if d.node_name else None,
}
DEVICE_INDEXES = {rec.DEVICES: lambda d: {d.name: d}}

# Kopf's own: all async, or Kopf runs each in a thread pool, one hop per object and event.


@kopf.index("", "v1", "nodes", id=rec.NODES)
async def nodes_index(name: str, uid: str, labels: kopf.Labels, **_: Any) -> dict[str, tuple[str, str]]:
    # The mode its agent serves in: a claim or an allow-list entry reaches its devices.
    return {name: (uid, labels.get(SERVING_LABEL, ""))}


@kopf.index("kubevirt.io", "v1", "virtualmachines", id=rec.VM_REFERENCES)
async def vm_references_index(name: str, namespace: str, spec: kopf.Spec, **_: Any) -> dict[tuple[str, str], str]:
    return {(namespace, EXCLUSIVE_PREFIX + device): name for device in referenced_device_names(dict(spec))}


@kopf.index("", "v1", "namespaces", id=rec.NAMESPACES)
async def namespaces_index(name: str, uid: str, status: kopf.Status, meta: kopf.Meta, **_: Any) -> dict[str, tuple[str, str, str]]:
    # When it was created: with devices.confirmNewNamespaces, one made after an assignment waits.
    return {name: (status.get("phase") or "Active", uid, meta.get("creationTimestamp") or "")}


@kopf.index(GROUP, VERSION, PASSTHROUGH_CONFIG.plural, id=rec.CONFIGS)
async def configs_index(name: str, body: kopf.Body, **_: Any) -> dict[str, ConfigView]:
    return {name: ConfigView.of(body)}


@kopf.index("kubevirt.io", "v1", "kubevirts", id=rec.KUBEVIRTS)
async def kubevirts_index(name: str, namespace: str, body: kopf.Body, **_: Any) -> dict[tuple[str, str], KubeVirtView]:
    return {(namespace, name): KubeVirtView.of(body)}


# -- events: enqueue the affected device names ---------------------------------------------------


def _enqueue(memo: kopf.Memo, names) -> None:
    memo.indexed.set()
    for name in names:
        memo.reconciler.enqueue(name)


def _node_device_changed(memo: kopf.Memo, old: NodeDevice | None, new: NodeDevice | None) -> None:
    device = new or old
    # Its group's other functions decide with it: an assignment of one may unblock another.
    siblings = (_group_key(device) or {}).keys()
    groups = memo.reconciler.indices[rec.GROUPS]
    for name in {device.name, *(n for key in siblings for n in groups.get(key, ()))}:
        memo.reconciler.enqueue(name)
    memo.reconciler.changed(device.name)
    if node_device_sync_inputs(old) != node_device_sync_inputs(new):
        memo.reconciler.sync_kubevirt_soon()  # what nodes advertise feeds the mismatch report
    if (handed_to(old) if old else None) != (handed_to(new) if new else None):
        memo.reconciler.sync_device_classes_soon()  # a namespace may have gained its first device or lost its last


def _device_changed(memo: kopf.Memo, old: Device | None, new: Device | None) -> None:
    device = new or old
    memo.reconciler.enqueue(device.name)
    memo.reconciler.changed(device.name)
    if device_sync_inputs(old) != device_sync_inputs(new):
        memo.reconciler.sync_kubevirt_soon()  # each assigned device has its exclusive entry


@kopf.on.event("kubevirt.io", "v1", "kubevirts")
async def kubevirt_event(memo: kopf.Memo, **_: Any) -> None:
    _enqueue(memo, [])
    memo.reconciler.changed(rec.KUBEVIRT)
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
    _enqueue(memo, before | now)


@kopf.on.event("", "v1", "namespaces")
async def namespace_event(name: str, memo: kopf.Memo, **_: Any) -> None:
    _enqueue(memo, memo.reconciler.indices[rec.DEVICES_BY_NAMESPACE].get(name, ()))


@kopf.on.event("", "v1", "nodes")
async def node_event(name: str, type: str | None, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    # A Node's coming and going matters here, and a change of the mode its agent serves in (how a
    # tenant uses its devices, whether KubeVirt needs their entries); its status heartbeats do not.
    serving = "" if type == "DELETED" else labels.get(SERVING_LABEL, "")
    before = memo.node_serving.pop(name, None) if type == "DELETED" else memo.node_serving.get(name)
    if type != "DELETED":
        memo.node_serving[name] = serving
    if type in ("ADDED", "DELETED") or (before is not None and before != serving):
        _enqueue(memo, memo.reconciler.indices[rec.DEVICES_BY_NODE].get(name, ()))
    if before is not None and before != serving:
        memo.reconciler.sync_kubevirt_soon()


@kopf.on.event(GROUP, VERSION, PASSTHROUGH_CONFIG.plural)
async def config_event(name: str, memo: kopf.Memo, **_: Any) -> None:
    if name != CONFIG_NAME:
        return
    memo.reconciler.changed(rec.KUBEVIRT)
    memo.reconciler.settings_changed()
    # The grace period may have changed: devices waiting on it decide again.
    node_devices = memo.reconciler.indices[rec.NODE_DEVICES]
    _enqueue(memo, [key for key, store in node_devices.items()
                    if any(d.missing_since or (d.ready and d.ready.reason == "NotFound") for d in store)])
    memo.reconciler.sync_kubevirt_soon()


# -- DRA mode: the per-namespace DeviceClasses (controller/deviceclasses.py) ----------------------


def register_device_classes() -> None:
    """With `--dra`: index the DeviceClasses of ours (by their labels), and sync them again when
    someone changes or deletes one. Registered only then, as Kopf lists and watches every index's
    kind and the chart grants DeviceClasses only in DRA mode."""
    ours = {deviceclasses.MANAGED_BY: deviceclasses.OPERATOR_MANAGER, deviceclasses.NAMESPACE_LABEL: kopf.PRESENT}

    @kopf.index("resource.k8s.io", "v1", deviceclasses.PLURAL, id=rec.DEVICE_CLASSES, labels=ours)
    async def device_classes_index(name: str, labels: kopf.Labels, spec: kopf.Spec, **_: Any) -> dict[str, deviceclasses.Live]:
        return {name: deviceclasses.Live.of(dict(labels), dict(spec))}

    @kopf.on.event("resource.k8s.io", "v1", deviceclasses.PLURAL, labels=ours)
    async def device_class_event(memo: kopf.Memo, **_: Any) -> None:
        memo.reconciler.sync_device_classes_soon()


def register_claims() -> None:
    """With `--dra`: index the ResourceClaims allocated our devices, by (pool, device), and decide
    a device again when a claim's allocation or consumers change: its Attached condition names the
    claim and its pod, and a claim holds the device as a VM does (verdict.Users). Registered only
    then, as the chart grants ResourceClaims only in DRA mode."""

    @kopf.index("resource.k8s.io", "v1", allocations.PLURAL, id=rec.CLAIMS)
    async def claims_index(name: str, namespace: str, status: kopf.Status, **_: Any) -> dict[tuple[str, str], Any]:
        return allocations.allocated(namespace, name, dict(status))

    @kopf.on.event("resource.k8s.io", "v1", allocations.PLURAL)
    async def claim_event(
        name: str, namespace: str, status: kopf.Status, type: str | None, memo: kopf.Memo, **_: Any,
    ) -> None:  # fmt: skip
        # A claim that lets go of a device must wake that device too, so remember what each held.
        key = (namespace, name)
        now = {} if type == "DELETED" else allocations.allocated(namespace, name, dict(status))
        before = memo.claim_seen.get(key, {})
        if now:
            memo.claim_seen[key] = now
        else:
            memo.claim_seen.pop(key, None)
        changed = {where for where in {*before, *now} if before.get(where) != now.get(where)}
        _enqueue(memo, {device for where in changed for device in memo.reconciler.devices_at(*where)})
