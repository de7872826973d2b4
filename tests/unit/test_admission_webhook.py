"""The Kopf handlers of the webhooks, called as Kopf calls them: what they read from the indexes."""

from __future__ import annotations

import asyncio
import logging
import types

import kopf
import pytest

from passthrough.admission import webhook
from passthrough.controller import reconciler as rec
from passthrough.controller.lifecycle import Device

NS = "team-a"


def device(name: str, namespace: str = NS, node: str = "gpu-1") -> Device:
    ready = {"type": "Ready", "status": "True", "reason": "Ready", "message": ""}
    return Device(name=name, namespace=namespace, uid="u", resource_version="1", deleting=False, metadata={},
                  status={"nodeName": node, "conditions": [ready]})  # fmt: skip


def indexed_memo() -> kopf.Memo:
    memo = kopf.Memo()
    memo.indexed = asyncio.Event()
    memo.indexed.set()
    return memo


def kwargs(devices=(), vms=None, memo=None, name="vm1", **extra):
    # Indexes as Kopf and the informer hold them: key -> a store of values (several for a device
    # being reassigned). The PCIDevices are the informer's, in memo; the VM references Kopf's.
    index: dict[str, list[Device]] = {}
    for d in devices:
        index.setdefault(d.name, []).append(d)
    memo = memo or indexed_memo()
    listed = asyncio.Event()
    listed.set()
    memo.devices = types.SimpleNamespace(indexes={rec.DEVICES: index}, synced=listed)
    return {
        "namespace": NS, "name": name, "memo": memo,
        "vm_references": {(NS, f"passthrough.io/{d}"): list(names) for d, names in (vms or {}).items()},
        "warnings": [], "userinfo": {"username": "system:serviceaccount:team-a:tenant"}, **extra,
    }  # fmt: skip


def vm_spec(*names: str) -> dict:
    return {"template": {"spec": {"domain": {"devices": {"hostDevices": [{"name": n, "deviceName": f"passthrough.io/{n}"} for n in names]}}}}}


def vmi_spec(*names: str) -> dict:
    return {"domain": {"devices": {"gpus": [{"name": n, "deviceName": f"passthrough.io/{n}"} for n in names]}}}


async def test_the_device_of_the_objects_own_namespace_is_found_among_several_namespaces():
    # Being reassigned: the old namespace's PCIDevice and the new one's share the name.
    args = kwargs(devices=[device("pci-a", namespace="team-b"), device("pci-a")])
    await webhook.validate_vm(spec=vm_spec("pci-a"), old=None, operation="CREATE", **args)


async def test_a_refusal_is_an_admission_error_with_the_rules_message():
    with pytest.raises(kopf.AdmissionError) as refused:
        await webhook.validate_vm(spec=vm_spec("pci-a"), old=None, operation="CREATE", **kwargs(devices=[device("pci-a", "team-b")]))
    assert refused.value.code == 403
    assert str(refused.value).startswith("VirtualMachine team-a/vm1: passthrough.io/pci-a is not a PCIDevice of namespace team-a")


async def test_another_vm_is_read_from_the_vm_references_index():
    with pytest.raises(kopf.AdmissionError, match="already used by VirtualMachine team-a/vm0"):
        await webhook.validate_vm(spec=vm_spec("pci-a"), old=None, operation="CREATE", **kwargs([device("pci-a")], {"pci-a": ["vm0"]}))


async def test_an_update_passes_the_old_list_so_a_held_device_is_not_judged_again():
    args = kwargs(vms={"pci-a": ["vm0", "vm1"]})  # pci-a is already gone from the namespace
    await webhook.validate_vm(spec=vm_spec("pci-a"), old={"spec": vm_spec("pci-a")}, operation="UPDATE", **args)


async def test_a_vmi_owned_by_the_vm_listing_the_device_is_admitted_a_stray_one_is_not():
    owned = {"ownerReferences": [{"kind": "VirtualMachine", "name": "vm0", "controller": True}]}
    args = kwargs([device("pci-a")], {"pci-a": ["vm0"]}, name="vm0-abcde")
    await webhook.validate_vmi(spec=vmi_spec("pci-a"), meta=owned, old=None, operation="CREATE", **args)
    with pytest.raises(kopf.AdmissionError, match="already used by VirtualMachine team-a/vm0"):
        await webhook.validate_vmi(spec=vmi_spec("pci-a"), meta={}, old=None, operation="CREATE", **args)


async def test_a_warning_goes_to_kopfs_warnings_list():
    not_ready = Device(name="pci-a", namespace=NS, uid="u", resource_version="1", deleting=False, metadata={},
                       status={"conditions": [{"type": "Ready", "status": "False", "reason": "NotFound", "message": "gone"}]})  # fmt: skip
    args = kwargs([not_ready])
    await webhook.validate_vm(spec=vm_spec("pci-a"), old=None, operation="CREATE", **args)
    assert args["warnings"] == ["PCIDevice pci-a is not Ready (NotFound: gone); the VM will not start on it until it is"]


async def test_a_pod_made_by_a_controller_is_named_by_its_generate_name():
    with pytest.raises(kopf.AdmissionError, match="^Pod team-a/launcher-: "):
        await webhook.validate_pod(
            spec={"containers": [{"name": "c", "resources": {"limits": {"passthrough.io/pci-a": "1"}}}]},
            meta={"generateName": "launcher-"}, **kwargs(name=None),
        )  # fmt: skip


async def test_objects_without_devices_are_admitted_even_before_the_indexes_are_filled():
    memo = kopf.Memo()
    memo.indexed = asyncio.Event()
    await webhook.validate_pod(spec={"containers": [{"name": "c"}]}, meta={}, **kwargs(memo=memo))
    await webhook.validate_vm(spec=vm_spec(), old=None, operation="CREATE", **kwargs(memo=memo))


async def test_before_the_indexes_are_filled_a_device_user_is_told_to_retry(monkeypatch):
    monkeypatch.setattr(webhook, "INDEX_WAIT", 0.05)
    memo = kopf.Memo()
    memo.indexed = asyncio.Event()
    with pytest.raises(kopf.AdmissionError, match="starting and cannot check devices yet; retry") as refused:
        await webhook.validate_vm(spec=vm_spec("pci-a"), old=None, operation="CREATE", **kwargs([device("pci-a")], memo=memo))
    assert refused.value.code == 503


def test_kopfs_error_line_for_a_refusal_is_dropped_but_real_failures_are_kept():
    quiet = webhook._RefusalsAreNotErrors()

    def record(msg: str, exc_info=None) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", logging.ERROR, __file__, 1, msg, None, exc_info)

    assert not quiet.filter(record("Webhook 'validate-vm' failed permanently: VirtualMachine team-a/vm1: ..."))
    assert quiet.filter(record("Webhook 'validate-vm' failed with an exception and will stop now: boom"))
    assert quiet.filter(record("Handler 'something' failed permanently: x"))


def test_the_handlers_read_the_indexes_by_the_ids_the_controller_registers():
    assert (rec.DEVICES, rec.VM_REFERENCES) == ("devices", "vm_references")
