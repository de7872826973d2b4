"""The validating webhooks: Kopf `on.validate` handlers that judge with `admission.rules`.

Imported only when the operator runs with `--webhook-port` (Kopf refuses to start with
admission handlers and no server). The chart owns the ValidatingWebhookConfiguration, so
`settings.admission.managed` stays None; its `matchConditions` send only objects that use a
`passthrough.io/` device, and each webhook's path is the id of its handler here.
Everything is read from the operator's indexes (Kopf's and its informers'): an admission costs no API call.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from passthrough.controller import metrics
from passthrough.admission import claims, rules
from passthrough.agent.plan import gpu_mode
from passthrough.api.conditions import timestamp
from passthrough.api.models import GROUP, NODE_PCI_DEVICE, VERSION
from passthrough.api.views import ASSIGNED_AT, Device, NodeDevice
from passthrough.controller.reconciler import DEVICES, DEVICES_BY_NODE, NODE_DEVICES

log = logging.getLogger(__name__)

# Handler ids are the URL paths the chart's webhook configuration calls.
POD = "validate-pod"
VM = "validate-vm"
VMI = "validate-vmi"
CLAIM = "validate-resourceclaim"
CLAIM_TEMPLATE = "validate-resourceclaimtemplate"
CLAIM_ALLOCATION = "validate-resourceclaim-allocation"
# The mutating webhooks that steer a claim's (or template's) requests to the namespace's devices.
STEER_CLAIM = "steer-resourceclaim"
STEER_CLAIM_TEMPLATE = "steer-resourceclaimtemplate"
# The mutating webhook that dates a NodePCIDevice's assignment (its ASSIGNED_AT annotation).
ASSIGNMENT = "date-assignment"
# The Nodes in GPU passthrough mode, whose unassigned GPUs are the pool any claim may have.
GPU_NODES = "gpu_nodes"
STATUS = "ResourceClaim status"  # the metrics' kind of the allocation gate
# The uid of each VM that lists a device: a VMI's owner reference is checked against it.
VM_UIDS = "vm_uids"
# Kopf fills its indexes before the first event handler runs, which sets `memo.indexed`; a
# request that comes earlier waits for them a little (the webhook's timeout is 10 s), since
# judging from half a listing would refuse devices that exist.
INDEX_WAIT = 5.0
DENIED = 403


class _RefusalsAreNotErrors(logging.Filter):
    """Kopf logs every AdmissionError as an ERROR ("Webhook 'validate-vm' failed permanently");
    a refusal is the webhook doing its job, logged at INFO here with who asked. Real failures
    (exceptions) still reach the log."""

    PREFIXES = tuple(f"Webhook {id!r} failed permanently:" for id in (POD, VM, VMI, CLAIM, CLAIM_TEMPLATE, CLAIM_ALLOCATION, ASSIGNMENT, STEER_CLAIM, STEER_CLAIM_TEMPLATE))

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info is None and str(record.msg).startswith(self.PREFIXES))


logging.getLogger("kopf.objects").addFilter(_RefusalsAreNotErrors())


@kopf.on.startup()
async def serve(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.admission.server = memo.webhook_server
    settings.admission.managed = None  # the chart's webhook configuration, not Kopf's


async def _indexed(memo: kopf.Memo, kind: str) -> tuple[Mapping[str, tuple[Device, ...]], Mapping[str, tuple[NodeDevice, ...]]]:
    """The PCIDevices and NodePCIDevices by name, once listed: the operator's own informers
    keep them (controller/informer.py), not Kopf, so Kopf cannot hand those indexes over."""
    try:
        async with asyncio.timeout(INDEX_WAIT):
            await memo.indexed.wait()
            await memo.devices.synced.wait()
            await memo.node_devices.synced.wait()
    except TimeoutError:
        metrics.ADMISSION_DECISIONS.labels(kind, "unavailable").inc()
        raise kopf.AdmissionError(
            "the passthrough operator is starting and cannot check devices yet; retry in a few seconds", code=503
        ) from None
    return memo.devices.indexes[DEVICES], memo.node_devices.indexes[NODE_DEVICES]


def _first(index: Mapping[Any, Any] | None, key: Any) -> Any:
    for value in (index or {}).get(key, ()):
        return value
    return None


def _devices(
    indexes: tuple[Mapping[str, tuple[Device, ...]], Mapping[str, tuple[NodeDevice, ...]]],
    namespaces: Mapping[str, Any], namespace: str, names: Iterable[str],
) -> tuple[dict[str, Device], set[str]]:  # fmt: skip
    """The namespace's PCIDevices among `names` that the operator handed out, and the names of
    those it did not make (each logged with why, for the admin: the tenant is told less)."""
    devices, node_devices = indexes
    seen = _first(namespaces, namespace)  # (phase, uid, creationTimestamp)
    namespace_uid = seen[1] if seen else ""
    found, forged = {}, set()
    for name in names:
        for device in devices.get(name, ()):
            if device.namespace != namespace:
                continue
            why = rules.why_not_handed_out(device, _first(node_devices, name), namespace_uid)
            if why:
                log.info("PCIDevice %s/%s does not count as a device of its namespace: %s", namespace, name, why)
                forged.add(name)
            else:
                found[name] = device
    return found, forged


def _users(index: kopf.Index, namespace: str, names: Iterable[str]) -> dict[str, list[str]]:
    return {name: list(index.get((namespace, rules.PREFIX + name), ())) for name in names}


def _answer(kind: str, verdict: rules.Verdict, warnings: list[str], userinfo: dict[str, Any]) -> None:
    metrics.ADMISSION_DECISIONS.labels(kind, "allowed" if verdict.allowed else "denied").inc()
    warnings.extend(verdict.warnings)
    if not verdict.allowed:
        log.info("refused for %s: %s", userinfo.get("username", "?"), verdict.refusal)
        raise kopf.AdmissionError(verdict.refusal, code=DENIED)


async def _judge_vm(
    kind: str, listed: list[str], before: list[str] | None, exempt: list[str], *, namespace: str, name: str,
    memo: kopf.Memo, vm_references: kopf.Index, namespaces: kopf.Index, warnings: list[str], userinfo: dict[str, Any],
    **_: Any,
) -> None:  # fmt: skip
    if not listed:
        return
    found, forged = _devices(await _indexed(memo, kind), namespaces, namespace, listed)
    verdict = rules.judge_vm(
        kind, namespace, name, listed, before,
        devices=found, users=_users(vm_references, namespace, listed), exempt=exempt, forged=forged,
    )  # fmt: skip
    _answer(kind, verdict, warnings, userinfo)


# Kopf passes every kwarg: namespace, name, memo, warnings, userinfo, and each of its indexes by
# its id (controller/handlers.py: `vm_references` is rec.VM_REFERENCES, `namespaces`
# rec.NAMESPACES; `vm_uids` is ours, below); the PCIDevices and NodePCIDevices come from the
# informers in memo.


@kopf.index("kubevirt.io", "v1", "virtualmachines", id=VM_UIDS)
async def vm_uids_index(name: str, namespace: str, uid: str, spec: kopf.Spec, **_: Any) -> dict[tuple[str, str], str]:
    # Only VMs that list a device: the others are never a VMI's exemption. An empty result
    # (not None) drops a VM that stopped listing devices.
    return {(namespace, name): uid} if rules.referenced_device_names(dict(spec)) else {}


def made_by(meta: Mapping[str, Any], name: str, namespace: str, vm_uids: Mapping[Any, Any]) -> list[str]:
    """The VM a VMI was made from, as KubeVirt makes it: the controller owner reference names a
    VirtualMachine of the VMI's own name that exists with that uid (and lists a device). An
    owner reference anyone can write names no VM that exists with its uid, or another name."""
    for owner in meta.get("ownerReferences") or []:
        if owner.get("kind") != "VirtualMachine" or not owner.get("controller") or owner.get("name") != name:
            continue
        if owner.get("uid") and _first(vm_uids, (namespace, name)) == owner.get("uid"):
            return [name]
    return []


@kopf.on.validate("kubevirt.io", "v1", "virtualmachines", id=VM, operations=["CREATE", "UPDATE"])
async def validate_vm(spec: kopf.Spec, old: kopf.Body | None, operation: str, **kwargs: Any) -> None:
    before = rules.vm_device_references(old.get("spec")) if operation == "UPDATE" and old else None
    await _judge_vm("VirtualMachine", rules.vm_device_references(dict(spec)), before, [], **kwargs)


@kopf.on.validate("kubevirt.io", "v1", "virtualmachineinstances", id=VMI, operations=["CREATE", "UPDATE"])
async def validate_vmi(
    spec: kopf.Spec, meta: kopf.Meta, old: kopf.Body | None, operation: str, vm_uids: kopf.Index, **kwargs: Any,
) -> None:  # fmt: skip
    before = rules.vmi_device_references(old.get("spec")) if operation == "UPDATE" and old else None
    # A VMI made from a VM lists that VM's devices: that VM is not "another" user of them.
    owner = made_by(meta, kwargs.get("name") or "", kwargs.get("namespace") or "", vm_uids)
    await _judge_vm("VirtualMachineInstance", rules.vmi_device_references(dict(spec)), before, owner, **kwargs)


@kopf.on.mutate(GROUP, VERSION, NODE_PCI_DEVICE.plural, id=ASSIGNMENT, operations=["CREATE", "UPDATE"])
async def date_assignment(
    spec: kopf.Spec, meta: kopf.Meta, old: kopf.Body | None, patch: kopf.Patch, warnings: list[str],
    userinfo: dict[str, Any], **_: Any,
) -> None:  # fmt: skip
    """Records when spec.assignedNamespace is set, in the request that sets it: the operator's own
    status, written after, would date it later than a namespace a tenant made in between."""
    before = old or {}
    verdict, value = rules.date_assignment(
        str(spec.get("assignedNamespace") or ""), str((before.get("spec") or {}).get("assignedNamespace") or ""),
        str((meta.get("annotations") or {}).get(ASSIGNED_AT) or ""),
        str(((before.get("metadata") or {}).get("annotations") or {}).get(ASSIGNED_AT) or ""),
        timestamp(datetime.datetime.now(datetime.UTC)),
    )  # fmt: skip
    _answer(NODE_PCI_DEVICE.kind, verdict, warnings, userinfo)
    patch.metadata.annotations[ASSIGNED_AT] = value or None


@kopf.on.validate("", "v1", "pods", id=POD, operations=["CREATE"])
async def validate_pod(
    spec: kopf.Spec, namespace: str, name: str, meta: kopf.Meta, memo: kopf.Memo, namespaces: kopf.Index,
    userinfo: dict[str, Any], **_: Any,
) -> None:  # fmt: skip
    requested = rules.pod_device_requests(dict(spec))
    if not requested:
        return
    found, forged = _devices(await _indexed(memo, "Pod"), namespaces, namespace, requested)
    # A pod made by a controller has no name yet, only generateName.
    verdict = rules.judge_pod(namespace, name or meta.get("generateName", ""), requested, found, forged)
    _answer("Pod", verdict, [], userinfo)


# -- DRA: claims stay in their namespace (admission/claims.py) ------------------------------


@kopf.index("", "v1", "nodes", id=GPU_NODES)
async def gpu_nodes_index(name: str, labels: kopf.Labels, **_: Any) -> dict[str, bool]:
    return {name: True} if gpu_mode(dict(labels)) else {}


@kopf.on.validate("resource.k8s.io", "v1", "resourceclaims", id=CLAIM_ALLOCATION, subresource="status", operations=["UPDATE"])
async def validate_claim_allocation(
    status: kopf.Status, old: kopf.Body | None, namespace: str, name: str, memo: kopf.Memo, namespaces: kopf.Index,
    gpu_nodes: kopf.Index, warnings: list[str], userinfo: dict[str, Any], **_: Any,
) -> None:  # fmt: skip
    """The second gate: the allocation the scheduler (or anyone) writes into a claim's status."""
    added = claims.added_results((old or {}).get("status"), dict(status))
    if not added:
        return
    _, node_devices = await _indexed(memo, STATUS)
    by_node = memo.node_devices.indexes[DEVICES_BY_NODE]
    seen = _first(namespaces, namespace)  # (phase, uid, creationTimestamp)
    reasons = {}
    for result in added:
        pool, device = str(result.get("pool") or ""), str(result.get("device") or "")
        of_node = [d for key in by_node.get(pool, ()) for d in node_devices.get(key, ())]
        why = claims.why_not(namespace, seen[1] if seen else "", pool, device, of_node, _first(gpu_nodes, pool) is not None)
        if why:
            log.info("device %s of node %s is not for claim %s/%s: %s", device, pool, namespace, name, why)
            reasons[(pool, device)] = why
    _answer(STATUS, claims.judge_allocation(namespace, name, added, reasons), warnings, userinfo)


@kopf.on.validate("resource.k8s.io", "v1", "resourceclaims", id=CLAIM, operations=["CREATE", "UPDATE"])
async def validate_claim(
    spec: kopf.Spec, namespace: str, name: str, meta: kopf.Meta, warnings: list[str], userinfo: dict[str, Any], **_: Any,
) -> None:  # fmt: skip
    verdict = claims.judge_claim("ResourceClaim", namespace, name or meta.get("generateName", ""), dict(spec).get("devices"))
    _answer("ResourceClaim", verdict, warnings, userinfo)


@kopf.on.validate("resource.k8s.io", "v1", "resourceclaimtemplates", id=CLAIM_TEMPLATE, operations=["CREATE", "UPDATE"])
async def validate_claim_template(
    spec: kopf.Spec, namespace: str, name: str, warnings: list[str], userinfo: dict[str, Any], **_: Any,
) -> None:  # fmt: skip
    verdict = claims.judge_claim("ResourceClaimTemplate", namespace, name, claims.template_devices(dict(spec)))
    _answer("ResourceClaimTemplate", verdict, warnings, userinfo)


@kopf.on.mutate("resource.k8s.io", "v1", "resourceclaims", id=STEER_CLAIM, operations=["CREATE"])
async def steer_claim(spec: kopf.Spec, namespace: str, patch: kopf.Patch, **_: Any) -> None:
    """A claim's spec cannot change once made: it is steered as it is created (by a tenant, by
    kube-controller-manager from a template, by the scheduler for an extended resource)."""
    devices = dict(spec).get("devices")
    steered = claims.steer(namespace, devices)
    if steered != devices:
        patch.spec["devices"] = steered


@kopf.on.mutate("resource.k8s.io", "v1", "resourceclaimtemplates", id=STEER_CLAIM_TEMPLATE, operations=["CREATE"])
async def steer_claim_template(spec: kopf.Spec, namespace: str, patch: kopf.Patch, **_: Any) -> None:
    devices = claims.template_devices(dict(spec))
    steered = claims.steer(namespace, devices)
    if steered != devices:
        patch.spec["spec"] = {"devices": steered}
