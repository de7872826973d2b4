"""The validating webhooks: Kopf `on.validate` handlers that judge with `admission.rules`.

Imported only when the operator runs with `--webhook-port` (Kopf refuses to start with
admission handlers and no server). The chart owns the ValidatingWebhookConfiguration, so
`settings.admission.managed` stays None; its `matchConditions` send only objects that use a
`passthrough.io/` device, and each webhook's path is the id of its handler here.
Everything is read from the operator's indexes (Kopf's and its informer's): an admission costs no API call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, Mapping
from typing import Any

import kopf

from passthrough.controller import metrics
from passthrough.admission import rules
from passthrough.controller.lifecycle import Device
from passthrough.controller.reconciler import DEVICES

log = logging.getLogger(__name__)

# Handler ids are the URL paths the chart's webhook configuration calls.
POD = "validate-pod"
VM = "validate-vm"
VMI = "validate-vmi"
# Kopf fills its indexes before the first event handler runs, which sets `memo.indexed`; a
# request that comes earlier waits for them a little (the webhook's timeout is 10 s), since
# judging from half a listing would refuse devices that exist.
INDEX_WAIT = 5.0
DENIED = 403


class _RefusalsAreNotErrors(logging.Filter):
    """Kopf logs every AdmissionError as an ERROR ("Webhook 'validate-vm' failed permanently");
    a refusal is the webhook doing its job, logged at INFO here with who asked. Real failures
    (exceptions) still reach the log."""

    PREFIXES = tuple(f"Webhook {id!r} failed permanently:" for id in (POD, VM, VMI))

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.exc_info is None and str(record.msg).startswith(self.PREFIXES))


logging.getLogger("kopf.objects").addFilter(_RefusalsAreNotErrors())


@kopf.on.startup()
async def serve(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.admission.server = memo.webhook_server
    settings.admission.managed = None  # the chart's webhook configuration, not Kopf's


async def _indexed(memo: kopf.Memo, kind: str) -> Mapping[str, tuple[Device, ...]]:
    """The PCIDevices by name, once listed: the operator's own informer keeps them
    (controller/informer.py), not Kopf, so Kopf cannot hand that index over."""
    try:
        async with asyncio.timeout(INDEX_WAIT):
            await memo.indexed.wait()
            await memo.devices.synced.wait()
    except TimeoutError:
        metrics.ADMISSION_DECISIONS.labels(kind, "unavailable").inc()
        raise kopf.AdmissionError(
            "the passthrough operator is starting and cannot check devices yet; retry in a few seconds", code=503
        ) from None
    return memo.devices.indexes[DEVICES]


def _devices(index: Mapping[str, tuple[Device, ...]], namespace: str, names: Iterable[str]) -> dict[str, Device]:
    found = {}
    for name in names:
        for device in index.get(name, ()):
            if device.namespace == namespace:
                found[name] = device
    return found


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
    memo: kopf.Memo, vm_references: kopf.Index, warnings: list[str], userinfo: dict[str, Any], **_: Any,
) -> None:  # fmt: skip
    if not listed:
        return
    devices = await _indexed(memo, kind)
    verdict = rules.judge_vm(
        kind, namespace, name, listed, before,
        devices=_devices(devices, namespace, listed), users=_users(vm_references, namespace, listed), exempt=exempt,
    )  # fmt: skip
    _answer(kind, verdict, warnings, userinfo)


# Kopf passes every kwarg: namespace, name, memo, warnings, userinfo, and each of its indexes by
# its id (controller/handlers.py: `vm_references` is rec.VM_REFERENCES); the PCIDevices come
# from the informer in memo.


@kopf.on.validate("kubevirt.io", "v1", "virtualmachines", id=VM, operations=["CREATE", "UPDATE"])
async def validate_vm(spec: kopf.Spec, old: kopf.Body | None, operation: str, **kwargs: Any) -> None:
    before = rules.vm_device_references(old.get("spec")) if operation == "UPDATE" and old else None
    await _judge_vm("VirtualMachine", rules.vm_device_references(dict(spec)), before, [], **kwargs)


@kopf.on.validate("kubevirt.io", "v1", "virtualmachineinstances", id=VMI, operations=["CREATE", "UPDATE"])
async def validate_vmi(spec: kopf.Spec, meta: kopf.Meta, old: kopf.Body | None, operation: str, **kwargs: Any) -> None:
    before = rules.vmi_device_references(old.get("spec")) if operation == "UPDATE" and old else None
    # A VMI made from a VM lists that VM's devices: that VM is not "another" user.
    owners = [o.get("name", "") for o in meta.get("ownerReferences") or [] if o.get("kind") == "VirtualMachine"]
    await _judge_vm("VirtualMachineInstance", rules.vmi_device_references(dict(spec)), before, owners, **kwargs)


@kopf.on.validate("", "v1", "pods", id=POD, operations=["CREATE"])
async def validate_pod(
    spec: kopf.Spec, namespace: str, name: str, meta: kopf.Meta, memo: kopf.Memo, userinfo: dict[str, Any], **_: Any,
) -> None:  # fmt: skip
    requested = rules.pod_device_requests(dict(spec))
    if not requested:
        return
    devices = await _indexed(memo, "Pod")
    # A pod made by a controller has no name yet, only generateName.
    verdict = rules.judge_pod(namespace, name or meta.get("generateName", ""), requested, _devices(devices, namespace, requested))
    _answer("Pod", verdict, [], userinfo)
