"""The Kopf handlers of the webhooks, called as Kopf calls them: what they read from the indexes."""

from __future__ import annotations

import asyncio
import logging
import types

import kopf
import pytest

from passthrough.admission import webhook
from passthrough.controller import reconciler as rec
from passthrough.api.views import Device, NodeDevice

NS = "team-a"
NAMESPACE_UIDS = {"team-a": "uid-team-a", "team-b": "uid-team-b"}


def owned_by(name: str, uid: str | None = None) -> dict:
    """The metadata the operator gives a PCIDevice: its NodePCIDevice as controller owner."""
    owner = {"apiVersion": "passthrough.io/v1alpha1", "kind": "NodePCIDevice", "name": name,
             "uid": uid or f"npci-{name}", "controller": True}  # fmt: skip
    return {"ownerReferences": [owner], "labels": {}, "finalizers": []}


def device(name: str, namespace: str = NS, node: str = "gpu-1", metadata: dict | None = None, deleting: bool = False) -> Device:
    ready = {"type": "Ready", "status": "True", "reason": "Ready", "message": ""}
    return Device(name=name, namespace=namespace, uid="u", resource_version="1", deleting=deleting,
                  metadata=owned_by(name) if metadata is None else metadata,
                  status={"nodeName": node, "conditions": [ready]})  # fmt: skip


def node_device(name: str, handed_to: str = NS, handed_uid: str | None = None) -> NodeDevice:
    status = {"assignedNamespaceRef": {"name": handed_to, "uid": handed_uid or NAMESPACE_UIDS[handed_to]}} if handed_to else {}
    return NodeDevice.of({"metadata": {"name": name, "uid": f"npci-{name}"}, "spec": {"assignedNamespace": handed_to},
                          "status": status})  # fmt: skip


def indexed_memo() -> kopf.Memo:
    memo = kopf.Memo()
    memo.indexed = asyncio.Event()
    memo.indexed.set()
    return memo


def kwargs(devices=(), vms=None, memo=None, name="vm1", node_devices=None, vm_uids=None, **extra):
    # Indexes as Kopf and the informers hold them: key -> a store of values (several for a device
    # being reassigned). The PCIDevices and NodePCIDevices are the informers', in memo; the VM
    # references, VM uids and namespaces Kopf's. Unless given, each device's NodePCIDevice
    # exists and was handed to team-a when team-a has the device, else to the device's namespace.
    index: dict[str, list[Device]] = {}
    for d in devices:
        index.setdefault(d.name, []).append(d)
    if node_devices is None:
        node_devices = [node_device(n, NS if any(d.namespace == NS for d in ds) else ds[0].namespace) for n, ds in index.items()]
    memo = memo or indexed_memo()
    listed = asyncio.Event()
    listed.set()
    memo.devices = types.SimpleNamespace(indexes={rec.DEVICES: index}, synced=listed)
    memo.node_devices = types.SimpleNamespace(indexes={rec.NODE_DEVICES: {n.name: [n] for n in node_devices}}, synced=listed)
    return {
        "namespace": NS, "name": name, "memo": memo,
        "vm_references": {(NS, f"passthrough.io/{d}"): list(names) for d, names in (vms or {}).items()},
        "namespaces": {ns: [("Active", uid)] for ns, uid in NAMESPACE_UIDS.items()},
        "vm_uids": {(NS, vm): [uid] for vm, uid in (vm_uids or {}).items()},
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


def owner_vm(name: str, uid: str) -> dict:
    return {"ownerReferences": [{"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine", "name": name, "uid": uid,
                                 "controller": True, "blockOwnerDeletion": True}]}  # fmt: skip


async def test_a_vmi_made_from_the_vm_listing_the_device_is_admitted_a_stray_one_is_not():
    # KubeVirt names a VMI after its VM and makes the VM its controller owner, by uid.
    args = kwargs([device("pci-a")], {"pci-a": ["vm0"]}, name="vm0", vm_uids={"vm0": "uid-vm0"})
    await webhook.validate_vmi(spec=vmi_spec("pci-a"), meta=owner_vm("vm0", "uid-vm0"), old=None, operation="CREATE", **args)
    with pytest.raises(kopf.AdmissionError, match="already used by VirtualMachine team-a/vm0"):
        await webhook.validate_vmi(spec=vmi_spec("pci-a"), meta={}, old=None, operation="CREATE", **args)


@pytest.mark.parametrize(
    "vmi_name, owner, why",
    [
        ("vmi-x", owner_vm("vm0", "uid-vm0"), "another name than the VM's"),
        ("vm0", owner_vm("vm0", "uid-of-an-earlier-vm0"), "a uid the VM does not have"),
        ("vm0", owner_vm("vm0", ""), "no uid"),
        ("vm0", {"ownerReferences": [{**owner_vm("vm0", "uid-vm0")["ownerReferences"][0], "controller": False}]}, "not its controller"),
    ],
)
async def test_a_vmi_with_a_hand_written_owner_reference_is_another_user(vmi_name, owner, why):
    args = kwargs([device("pci-a")], {"pci-a": ["vm0"]}, name=vmi_name, vm_uids={"vm0": "uid-vm0"})
    with pytest.raises(kopf.AdmissionError, match="already used by VirtualMachine team-a/vm0"):
        await webhook.validate_vmi(spec=vmi_spec("pci-a"), meta=owner, old=None, operation="CREATE", **args)


async def test_a_vmi_owned_by_a_vm_that_does_not_list_the_device_is_not_exempted_for_it():
    # vm0 lists pci-b only (so it is in the uid index); vm9 lists pci-a.
    args = kwargs([device("pci-a")], {"pci-a": ["vm9"], "pci-b": ["vm0"]}, name="vm0", vm_uids={"vm0": "uid-vm0"})
    with pytest.raises(kopf.AdmissionError, match="already used by VirtualMachine team-a/vm9"):
        await webhook.validate_vmi(spec=vmi_spec("pci-a"), meta=owner_vm("vm0", "uid-vm0"), old=None, operation="CREATE", **args)


async def test_the_vm_uid_index_holds_only_vms_that_list_a_device():
    spec = vm_spec("pci-a")
    assert await webhook.vm_uids_index(name="vm0", namespace=NS, uid="u0", spec=spec) == {(NS, "vm0"): "u0"}
    limits = {"template": {"spec": {"domain": {"resources": {"limits": {"passthrough.io/pci-a": "1"}}}}}}
    assert await webhook.vm_uids_index(name="vm0", namespace=NS, uid="u0", spec=limits) == {(NS, "vm0"): "u0"}
    # Not None: Kopf keeps an object's old value when its indexer returns None.
    assert await webhook.vm_uids_index(name="vm0", namespace=NS, uid="u0", spec=vm_spec()) == {}


# -- only the operator's PCIDevices count ----------------------------------------------------------


FORGED = "PCIDevice pci-a in namespace team-a is not one the passthrough operator handed to team-a"


@pytest.mark.parametrize(
    "pcidevice, node_devices",
    [
        (device("pci-a", metadata={}), None),  # no owner at all
        (device("pci-a", metadata=owned_by("pci-a", uid="uid-of-a-deleted-npci")), None),  # an owner that is not the live one
        (device("pci-a", metadata={**owned_by("pci-a"), "ownerReferences": [
            {**owned_by("pci-a")["ownerReferences"][0], "controller": False}]}), None),  # owner, not controller
        (device("pci-a"), []),  # no NodePCIDevice of that name
        (device("pci-a"), [node_device("pci-a", handed_to="team-b")]),  # handed to another namespace
        (device("pci-a"), [node_device("pci-a", handed_uid="uid-of-an-earlier-team-a")]),  # to an earlier team-a
        (device("pci-a"), [node_device("pci-a", handed_to="")]),  # to no namespace
    ],
)
async def test_a_pcidevice_the_operator_did_not_hand_to_the_namespace_gives_it_nothing(pcidevice, node_devices, caplog):
    caplog.set_level(logging.INFO, logger=webhook.__name__)
    args = kwargs([pcidevice], node_devices=node_devices)
    with pytest.raises(kopf.AdmissionError, match=f"^VirtualMachine team-a/vm1: {FORGED}, so it gives the namespace no device"):
        await webhook.validate_vm(spec=vm_spec("pci-a"), old=None, operation="CREATE", **args)
    pod = {"containers": [{"name": "c", "resources": {"limits": {"passthrough.io/pci-a": "1"}}}]}
    with pytest.raises(kopf.AdmissionError, match=f"^Pod team-a/launcher: {FORGED}"):
        await webhook.validate_pod(spec=pod, meta={}, **{**args, "name": "launcher"})
    # The admin's log says why; the tenant's message does not.
    assert "PCIDevice team-a/pci-a does not count as a device of its namespace: " in caplog.text


async def test_the_operators_pcidevice_being_removed_is_refused_as_being_removed():
    # Reassigned to team-b: the record names team-b, team-a's PCIDevice lingers for its VM.
    args = kwargs([device("pci-a", deleting=True)], node_devices=[node_device("pci-a", handed_to="team-b")])
    with pytest.raises(kopf.AdmissionError, match="PCIDevice pci-a is being removed from namespace team-a"):
        await webhook.validate_vm(spec=vm_spec("pci-a"), old=None, operation="CREATE", **args)


async def test_a_vm_asking_for_a_device_in_domain_resources_is_judged_like_one_listing_it():
    spec = {"template": {"spec": {"domain": {"resources": {"limits": {"passthrough.io/pci-a": "1"}}}}}}
    with pytest.raises(kopf.AdmissionError, match="passthrough.io/pci-a is not a PCIDevice of namespace team-a"):
        await webhook.validate_vm(spec=spec, old=None, operation="CREATE", **kwargs([device("pci-a", namespace="team-b")]))
    with pytest.raises(kopf.AdmissionError, match="already used by VirtualMachine team-a/vm0"):
        await webhook.validate_vm(spec=spec, old=None, operation="CREATE", **kwargs([device("pci-a")], {"pci-a": ["vm0"]}))
    await webhook.validate_vm(spec=spec, old=None, operation="CREATE", **kwargs([device("pci-a")]))
    vmi = {"domain": {"resources": {"requests": {"passthrough.io/pci-a": "1"}}}}
    with pytest.raises(kopf.AdmissionError, match="passthrough.io/pci-a is not a PCIDevice of namespace team-a"):
        await webhook.validate_vmi(spec=vmi, meta={}, old=None, operation="CREATE", **kwargs([device("pci-a", namespace="team-b")]))


async def test_a_warning_goes_to_kopfs_warnings_list():
    not_ready = Device(name="pci-a", namespace=NS, uid="u", resource_version="1", deleting=False, metadata=owned_by("pci-a"),
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


# -- DRA: the allocation a claim's status names ---------------------------------------------


def handed_gpu(namespace: str, address: str = "0000:af:00.0", node: str = "gpu-1") -> NodeDevice:
    """A NodePCIDevice the operator handed to `namespace` (Assigned=True, the ref with its uid)."""
    return NodeDevice.of({
        "metadata": {"name": f"npci-{address}", "uid": "u"}, "spec": {"assignedNamespace": namespace},
        "status": {"attributes": {"pciAddress": address, "nodeName": node, "iommuGroup": 21},
                   "assignedNamespaceRef": {"name": namespace, "uid": NAMESPACE_UIDS[namespace]},
                   "conditions": [{"type": "Assigned", "status": "True", "reason": "Assigned", "message": ""}]},
    })  # fmt: skip


def claim_kwargs(node_devices, status, old_status=None, gpu_nodes=()):
    args = kwargs(node_devices=node_devices, name="vm-gpu", gpu_nodes={n: [True] for n in gpu_nodes})
    args["memo"].node_devices.indexes[rec.DEVICES_BY_NODE] = {"gpu-1": [d.name for d in node_devices]}
    return {**args, "status": status, "old": kopf.Body({"status": old_status}) if old_status is not None else None}


def allocated(device: str = "pci-0000-af-00-0", driver: str = "pci.passthrough.io") -> dict:
    return {"allocation": {"devices": {"results": [{"request": "gpu", "driver": driver, "pool": "gpu-1", "device": device}]}}}


async def test_an_allocation_of_the_claims_own_device_is_admitted_and_another_namespaces_refused(caplog):
    await webhook.validate_claim_allocation(**claim_kwargs([handed_gpu(NS)], allocated(), old_status={}))
    with caplog.at_level(logging.INFO, logger="passthrough.admission.webhook"):
        with pytest.raises(kopf.AdmissionError) as refused:
            await webhook.validate_claim_allocation(**claim_kwargs([handed_gpu("team-b")], allocated(), old_status={}))
    assert refused.value.code == 403
    assert str(refused.value).startswith("ResourceClaim team-a/vm-gpu: device pci-0000-af-00-0 of node gpu-1 is not one")
    assert "team-b" not in str(refused.value)  # the tenant is not told whose it is; the admin's log is
    assert "handed out to team-b" in caplog.text


async def test_a_status_write_that_keeps_the_allocation_or_names_other_drivers_is_not_judged():
    # Not even the indexes are read: the kubelet's and the scheduler's other writes never wait.
    memo = kopf.Memo()
    memo.indexed = asyncio.Event()
    args = {**claim_kwargs([handed_gpu("team-b")], allocated(), old_status=allocated()), "memo": memo}
    await webhook.validate_claim_allocation(**args)
    await webhook.validate_claim_allocation(**{**args, "status": allocated(driver="gpu.example.com"), "old": None})


async def test_a_pool_gpu_is_admitted_only_on_a_node_in_gpu_mode():
    pooled = NodeDevice.of({
        "metadata": {"name": "npci-pool", "uid": "u"}, "spec": {},
        "status": {"attributes": {"pciAddress": "0000:af:00.0", "nodeName": "gpu-1", "iommuGroup": 21}, "mode": "Pool",
                   "resourceName": "nvidia.com/GA102GL_A10",
                   "conditions": [{"type": "Ready", "status": "True", "reason": "Ready", "message": ""}]},
    })  # fmt: skip
    await webhook.validate_claim_allocation(**claim_kwargs([pooled], allocated(), old_status={}, gpu_nodes=["gpu-1"]))
    with pytest.raises(kopf.AdmissionError):
        await webhook.validate_claim_allocation(**claim_kwargs([pooled], allocated(), old_status={}))


async def test_the_gpu_nodes_index_holds_only_nodes_in_gpu_mode():
    assert await webhook.gpu_nodes_index(name="n", labels={"passthrough.io/gpu-passthrough": "true"}) == {"n": True}
    assert await webhook.gpu_nodes_index(name="n", labels={"nvidia.com/gpu.workload.config": "vm-passthrough"}) == {"n": True}
    assert await webhook.gpu_nodes_index(name="n", labels={}) == {}


async def test_admin_access_on_a_claim_or_template_is_refused_and_a_malformed_one_is_not_a_traceback():
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "passthrough-team-a", "adminAccess": True}}]}}
    user = {"userinfo": {"username": "tenant"}, "meta": {}, "warnings": []}
    with pytest.raises(kopf.AdmissionError, match="asks for adminAccess to DeviceClass passthrough-team-a"):
        await webhook.validate_claim(spec=spec, namespace=NS, name="peek", **user)
    with pytest.raises(kopf.AdmissionError, match="ResourceClaimTemplate team-a/t"):
        await webhook.validate_claim_template(spec={"spec": spec}, namespace=NS, name="t", userinfo={}, warnings=[])
    await webhook.validate_claim(spec={"devices": "x"}, namespace=NS, name="odd", **user)
    await webhook.validate_claim_template(spec={"spec": 3}, namespace=NS, name="odd", userinfo={}, warnings=[])
    assert user["warnings"] == []


async def test_a_claim_of_several_passthrough_devices_in_one_request_is_admitted_with_a_warning_for_vms():
    several = {"devices": {"requests": [
        {"name": "gpus", "exactly": {"deviceClassName": "passthrough-team-a", "count": 2}},
        {"name": "all", "firstAvailable": [{"name": "every", "deviceClassName": "passthrough-pool.gpu", "allocationMode": "All"}]},
        {"name": "one", "exactly": {"deviceClassName": "passthrough-team-a", "count": 1}},
        {"name": "theirs", "exactly": {"deviceClassName": "gpu.example.com", "count": 4}},
    ]}}  # fmt: skip
    warnings: list[str] = []
    await webhook.validate_claim(spec=several, namespace=NS, name="vm", meta={}, userinfo={}, warnings=warnings)
    assert [w.split(";")[0] for w in warnings] == [
        "ResourceClaim team-a/vm: request gpus asks for more than one device of DeviceClass passthrough-team-a",
        "ResourceClaim team-a/vm: request all/every asks for more than one device of DeviceClass passthrough-pool.gpu",
    ]
    assert "for a VM, make one request per device" in warnings[0]
    template: list[str] = []
    await webhook.validate_claim_template(spec={"spec": several}, namespace=NS, name="t", userinfo={}, warnings=template)
    assert len(template) == 2 and template[0].startswith("ResourceClaimTemplate team-a/t: request gpus")
    assert webhook.STATUS == "ResourceClaim status"  # the metrics' kind the integration test reads


async def test_a_claim_naming_another_namespaces_device_class_is_refused_by_the_class_name_alone():
    # No class exists (the webhook is given no index of them): the name says whose it is.
    spec = {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "passthrough-team-b"}}]}}
    user = {"userinfo": {"username": "tenant"}, "meta": {}, "warnings": []}
    with pytest.raises(kopf.AdmissionError, match="names DeviceClass passthrough-team-b, which selects the devices of another"):
        await webhook.validate_claim(spec=spec, namespace=NS, name="stolen", **user)
    await webhook.validate_claim(spec=spec, namespace="team-b", name="own", **user)
