"""Objects that pass everything the API server enforces (the CRD schema, its CEL rules) but carry
odd values, written while a good assignment is in place, against the real API server and the
operator as its own process.

Each odd NodePCIDevice is written as an agent or an admin could write it (server-side apply of
raw JSON, bypassing our models); the PassthroughConfig gets values valid by schema but wrong by
meaning. Through all of them: the operator stays up and logs no traceback, the good device keeps
its PCIDevice and its KubeVirt entry (nothing already applied is torn down), and each odd object
gets a condition whose message says what is wrong and what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from dataclasses import dataclass
from typing import Any

import pytest
from kubernetes_asyncio import client

from e2e import support
from passthrough.api.models import MAX_GRACE_SECONDS
from passthrough.api.labels import NODE_LABEL
from passthrough.kube.custom import AGENT_MANAGER, Custom
from passthrough.kube.client import ApiError
from passthrough.pci.naming import node_pci_device_name

pytestmark = pytest.mark.cluster
MERGE = "application/merge-patch+json"
GOOD_ADDRESS = "0000:3b:00.0"


@dataclass
class Scene:
    namespace: str
    other_namespace: str
    node: Any
    good: str  # the good NodePCIDevice (and PCIDevice) name
    group: int
    unique: str


def conditions(obj: dict | None) -> dict[str, dict]:
    return {c.get("type"): c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def ready(status: str = "True", reason: str = "Ready", message: str = "Bound to vfio-pci.") -> dict:
    return {"type": "Ready", "status": status, "reason": reason, "message": message, "lastTransitionTime": now()}


def attributes(address: str, node: str, **odd: Any) -> dict:
    """A GPU in an IOMMU group of its own (numbered from its address), with `odd` values put in."""
    group = 7000 + int(address.split(":")[1], 16)
    return {"name": "GA102GL [A10]", "vendorName": "NVIDIA Corporation", "pciAddress": address, "vendorID": "10de",
            "deviceID": "2236", "subsystemVendorID": "10de", "subsystemDeviceID": "1482", "class": "030200",
            "driver": "vfio-pci", "iommuGroup": group, "numaNode": 0, "nodeName": node, **odd}  # fmt: skip


@pytest.fixture(scope="module")
def kinds(api):
    return (Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True), Custom(api, "passthroughconfigs"),
            Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1"))  # fmt: skip


@pytest.fixture(scope="module")
async def scene(api, kinds, operator):
    """A KubeVirt CR, the `cluster` PassthroughConfig aimed at it, and one good GPU assigned and applied."""
    npci, pcidev, configs, kubevirts = kinds
    unique = datetime.datetime.now().strftime("%H%M%S%f")[-8:]
    namespace, other = f"bad-{unique}", f"bad-{unique}-b"
    for name in (namespace, other):
        await support.create_namespace(api, name)
    await support.create_kubevirt(api, namespace)
    await configs.apply(config_body({"kubevirt": {"name": "kubevirt", "namespace": namespace}}), "admin")
    node = await support.ensure_node(api, f"bad-node-{unique}")
    good = await support.report_device(api, node, support.gpu(GOOD_ADDRESS))
    await support.assign(api, good, namespace)
    await support.wait_for(lambda: pcidev.get(good, namespace), what="the good PCIDevice")
    await support.wait_for(kubevirt_has(kubevirts, namespace, good), what="the good device's KubeVirt entry")
    group = (await npci.get(good))["status"]["attributes"]["iommuGroup"]
    yield Scene(namespace, other, node, good, group, unique)
    core = client.CoreV1Api(api)
    with contextlib.suppress(client.exceptions.ApiException):
        await configs.delete("cluster")
    for name in (namespace, other):
        with contextlib.suppress(client.exceptions.ApiException):
            await core.delete_namespace(name)
    with contextlib.suppress(client.exceptions.ApiException):
        await core.delete_node(node.name)
    for obj in (await npci.list(label_selector=f"{NODE_LABEL}")).get("items", []):
        named = obj["metadata"]["name"], obj["metadata"]["labels"].get(NODE_LABEL, "")
        if any(unique in n for n in named) or obj["metadata"]["name"] == good:
            with contextlib.suppress(client.exceptions.ApiException):
                await npci.delete(obj["metadata"]["name"])


def config_body(spec: dict) -> dict:
    return {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"}, "spec": spec}


def kubevirt_has(kubevirts: Custom, namespace: str, device: str):
    async def check():
        kv = await kubevirts.get("kubevirt", namespace)
        entries = (((kv or {}).get("spec", {}).get("configuration", {}).get("permittedHostDevices") or {})
                   .get("pciHostDevices") or [])  # fmt: skip
        return kv if any(e.get("resourceName") == f"passthrough.io/{device}" for e in entries) else None

    return check


async def put(api, npci: Custom, name: str, node_label: str, status: dict | None, assigned: str | None = None) -> None:
    """Write a NodePCIDevice as raw JSON: identity and spec as an admin would, status as a JSON merge
    patch (as `kubectl patch --subresource=status` would: any string JSON can carry)."""
    body: dict[str, Any] = {"apiVersion": "passthrough.io/v1alpha1", "kind": "NodePCIDevice",
                            "metadata": {"name": name, "labels": {NODE_LABEL: node_label}}}  # fmt: skip
    await npci.apply(body, AGENT_MANAGER)
    if assigned is not None:
        await npci.apply({**body, "spec": {"assignedNamespace": assigned}}, "admin")
    if status is not None:
        await client.CustomObjectsApi(api).patch_cluster_custom_object_status(
            "passthrough.io", "v1alpha1", "nodepcidevices", name, {"status": status}, _content_type=MERGE)


async def assert_nothing_torn_down(scene: Scene, kinds, operator) -> None:
    npci, pcidev, _, kubevirts = kinds
    assert operator.proc.poll() is None, f"the operator exited:\n{operator.output()[-5000:]}"
    assert "Traceback" not in operator.output(), operator.output()[-5000:]
    device = await pcidev.get(scene.good, scene.namespace)
    assert device is not None and not device["metadata"].get("deletionTimestamp"), "the good PCIDevice went"
    assigned = conditions(await npci.get(scene.good)).get("Assigned", {})
    assert (assigned.get("status"), assigned.get("reason")) == ("True", "Assigned"), assigned
    assert await kubevirt_has(kubevirts, scene.namespace, scene.good)(), "the good device's KubeVirt entry went"


async def wait_assigned(npci: Custom, name: str, reasons: tuple[str, ...], timeout: float = 20) -> dict:
    seen: list[dict | None] = [None]

    async def check():
        seen[0] = got = conditions(await npci.get(name)).get("Assigned")
        return got if got and got.get("reason") in reasons else None

    try:
        return await support.wait_for(check, timeout, what=f"Assigned in {reasons} on {name}")
    except AssertionError:
        raise AssertionError(f"{name}: Assigned is {seen[0]}, wanted one of {reasons}") from None


def says_what_to_do(message: str) -> bool:
    """A sentence for an admin: names a next step or says what it waits for, and is no exception's text."""
    if any(word in message for word in ("Traceback", "Error(", "KeyError", "TypeError", "None")):
        return False
    steps = ("create", "clear", "set ", "assign", "waiting", "once", "until", "fix", "by itself", "use deviceName",
             "goes to", "free", "bring", "check")  # fmt: skip
    return any(step in message.lower() for step in steps)


async def test_odd_node_devices_are_judged_one_by_one_and_the_good_assignment_stays(api, kinds, scene, operator):
    npci, pcidev, _, _ = kinds
    node, u, ns = scene.node.name, scene.unique, scene.namespace
    ghost = f"ghost-{u}"
    odd = {
        # name: (label, status, assignedNamespace, the Assigned reasons it may end in, text its message must hold)
        "no-iommu-group": (node, {"attributes": attributes("0000:40:00.0", node, iommuGroup=-1), "eligible": True,
                                  "conditions": [ready()]}, ns, ("Assigned", "DeviceNotReady"), ""),
        "huge-iommu-group": (node, {"attributes": attributes("0000:41:00.0", node, iommuGroup=2**63 - 1),
                                    "eligible": True, "conditions": [ready()]}, ns, ("Assigned",), ""),
        "node-nobody-has": (ghost, {"attributes": attributes("0000:42:00.0", ghost), "eligible": True,
                                    "conditions": [ready()]}, ns, ("NodeGone",), ghost),
        "unknown-conditions": (node, {"attributes": attributes("0000:43:00.0", node), "conditions": [
            {"type": "Frobnicated", "status": "True", "reason": "Whatever", "message": "", "lastTransitionTime": now()},
            ready("Unknown", "Mystery", "")]}, ns, ("DeviceNotReady",), "Mystery"),
        "empty-strings": (node, {"attributes": attributes("0000:44:00.0", node, name="", vendorName="", driver="",
                                                         subsystemVendorID="", subsystemDeviceID=""),
                                 "resourceName": "", "mode": "", "conditions": []}, ns, ("DeviceNotReady",), ""),
        "unicode": (node, {"attributes": attributes("0000:45:00.0", node, name="GA102GL [A10] \u2713 \u00f1 \u4e2d\u6587 \U0001f680",
                                                   vendorName="\u202eNVIDIA", driver="nvidi\u00e4"),
                           "eligible": True, "conditions": [ready(message="\u2603")]}, ns, ("Assigned",), ""),
        "no-status": (node, None, ns, ("DeviceNotReady",), ""),
        "namespace-nobody-has": (node, {"attributes": attributes("0000:46:00.0", node), "eligible": True,
                                        "conditions": [ready()]}, f"nowhere-{u}", ("NamespaceNotFound",), f"nowhere-{u}"),
        # The good device's IOMMU group, handed to another namespace: this one waits, the good one stays.
        "same-group-elsewhere": (node, {"attributes": attributes("0000:3b:00.1", node, iommuGroup=scene.group,
                                                                deviceID="1aef", **{"class": "040300"}),
                                        "eligible": True, "conditions": [ready()]},
                                 scene.other_namespace, ("IOMMUGroupConflict",), scene.good),
        # The good device's address and resource name, claimed by another object of the same node.
        "same-address-and-resource": (node, {"attributes": attributes(GOOD_ADDRESS, node, deviceID="2237"),
                                             "resourceName": f"passthrough.io/{scene.good}", "mode": "Exclusive",
                                             "eligible": True, "conditions": [ready()]}, "", ("Available",), ""),
        # A name that is not the hash of its attributes (an agent taking the name another node's device
        # will have, or anyone's hand-made object): ignored and flagged, with the name it should have.
        "name-not-its-hash": (node, {"attributes": attributes("0000:48:00.0", node), "eligible": True,
                                     "conditions": [ready()]}, ns, ("NameMismatch",),
                              node_pci_device_name("0000:48:00.0", "10de", "2236", node)),
    }
    # Every other object is named as its node's agent names it (pci/naming.py), or the operator
    # would judge its name before anything else.
    names = {case: node_pci_device_name(s["attributes"]["pciAddress"], s["attributes"]["vendorID"], s["attributes"]["deviceID"],
                                        s["attributes"]["nodeName"]) if s and case != "name-not-its-hash" else f"pci-odd-{u}-{case}"
             for case, (_, s, *_) in odd.items()}  # fmt: skip
    for case, (label, status, assigned, _, _) in odd.items():
        await put(api, npci, names[case], label, status, assigned)

    async def judged(case: str) -> str:
        reasons, holds = odd[case][3], odd[case][4]
        try:
            got = await wait_assigned(npci, names[case], reasons)
        except AssertionError as e:
            return f"{case}: {e}"
        message = got.get("message", "")
        if holds not in message or not says_what_to_do(message):
            return f"{case}: Assigned={got.get('status')}/{got.get('reason')}: {message!r} does not say what to do"
        if got.get("status") == "True":  # what it says is so: the PCIDevice is there, with the device's attributes
            try:
                made = await support.wait_for(lambda: pcidev.get(names[case], odd[case][2]), 10, what="its PCIDevice")
            except AssertionError:
                return f"{case}: Assigned=True ({message!r}), but there is no PCIDevice {odd[case][2]}/{names[case]}"
            wanted = ((await npci.get(names[case])) or {}).get("status", {}).get("attributes")
            if (made.get("status") or {}).get("attributes") != wanted:
                return f"{case}: PCIDevice attributes {(made.get('status') or {}).get('attributes')} are not {wanted}"
        return ""

    # All at once: the device of a node nobody has is collected after the operator's grace period.
    failures = [f for f in await asyncio.gather(*(judged(case) for case in odd)) if f]
    await assert_nothing_torn_down(scene, kinds, operator)
    # A device waiting on its group must not have taken the group's PCIDevice away from the good one.
    assert await pcidev.get(names["same-group-elsewhere"], scene.other_namespace) is None
    # The misnamed one: no PCIDevice, a Warning Event that says why, and no allow-list entry.
    misnamed = names["name-not-its-hash"]
    assert await pcidev.get(misnamed, ns) is None

    async def flagged():
        events = await client.CoreV1Api(api).list_namespaced_event("default", field_selector=f"involvedObject.name={misnamed}")
        return any(e.type == "Warning" and e.reason == "NameMismatch" for e in events.items)

    await support.wait_for(flagged, 20, what=f"a Warning Event NameMismatch on {misnamed}")
    kubevirt = await kinds[3].get("kubevirt", ns)
    assert misnamed not in str(kubevirt["spec"]), kubevirt["spec"]
    assert not failures, "\n".join(failures)


async def test_values_valid_by_schema_but_wrong_are_refused_and_the_last_good_config_stays(api, kinds, scene, operator):
    _, _, configs, kubevirts = kinds
    # The earlier tests' devices settled, and their allow-list entries applied (a sync folds
    # changes over a moment): what is there now is the last good configuration.
    await support.quiet(api, ("kubevirts", "pcidevices", "nodepcidevices"), settle=2, timeout=60)
    before = await kubevirts.get("kubevirt", scene.namespace)
    wrong = {
        "kubevirt": {"name": "kubevirt", "namespace": scene.namespace, "extraFeatureGates": ["", "Host Devices"]},
        "gpu": {"variant": "default", "permittedHostDevices": {
            "pciHostDevices": [{"pciVendorSelector": "10de:2236", "resourceName": "kubernetes.io/gpu"},
                               {"pciVendorSelector": "1AF4:1041", "resourceName": "example.com/" + "x" * 90}],
            "mediatedDevices": [{"mdevNameSelector": " ", "resourceName": "nvidia.com/T4_1Q"}]}},
    }  # fmt: skip
    await configs.apply(config_body(wrong), "admin")

    async def refused():
        valid = conditions(await configs.get("cluster")).get("Valid", {})
        return valid if valid.get("status") == "False" else None

    valid = await support.wait_for(refused, 20, what="Valid=False")
    message = valid["message"]
    for where in ("kubevirt.extraFeatureGates[0]", "kubevirt.extraFeatureGates[1]",
                  "gpu.permittedHostDevices.pciHostDevices[0].resourceName",
                  "gpu.permittedHostDevices.pciHostDevices[1].resourceName",
                  "gpu.permittedHostDevices.mediatedDevices[0].mdevNameSelector"):  # fmt: skip
        assert where in message, f"{where} not named in {message!r}"
    assert "last good configuration stays applied" in message
    await asyncio.sleep(1)
    after = await kubevirts.get("kubevirt", scene.namespace)
    assert after["spec"]["configuration"] == before["spec"]["configuration"], "KubeVirt changed under invalid values"
    await assert_nothing_torn_down(scene, kinds, operator)
    async def warned():  # Events follow once the operator's work queue has settled (10 s at most)
        events = await client.CoreV1Api(api).list_namespaced_event("default", field_selector="involvedObject.name=cluster")
        return any(e.type == "Warning" and e.reason == "InvalidValues" for e in events.items)

    await support.wait_for(warned, 15, what="a Warning InvalidValues on the config")
    # Put the good values back for the next test.
    await configs.apply(config_body({"kubevirt": {"name": "kubevirt", "namespace": scene.namespace}}), "admin")
    await support.wait_for(lambda: _valid(configs), 20, what="Valid=True again")


async def _valid(configs: Custom):
    return conditions(await configs.get("cluster")).get("Valid", {}).get("status") == "True"


# The schema's largest (ten years), past the year 9999 from now, past what a timedelta holds,
# int64's largest: in that order, as a value that breaks the operator can hold back the devices
# the next one reconciles.
@pytest.mark.parametrize(("seconds", "address"), [(MAX_GRACE_SECONDS, "0000:5c:00.0"), (10**12, "0000:5d:00.0"),
                                                  (10**14, "0000:5e:00.0"), (2**63 - 1, "0000:5f:00.0")])  # fmt: skip
async def test_a_grace_period_no_clock_can_count_is_refused_or_used_without_a_crash(api, kinds, scene, operator, seconds, address):
    """The operator turns the grace period into a timedelta (at most 999999999 days) and adds it
    to now (at most the year 9999): the CRD refuses more than ten years, naming the field."""
    npci, _, configs, _ = kinds
    spec = {"kubevirt": {"name": "kubevirt", "namespace": scene.namespace}, "devices": {"notFoundGracePeriodSeconds": seconds}}
    missing = await support.report_device(api, scene.node, support.gpu(address))
    try:
        refused = False
        try:
            await configs.apply(config_body(spec), "admin")
        except ApiError as e:
            assert seconds > MAX_GRACE_SECONDS and e.status == 422, (seconds, e.status, e.body)
            assert "spec.devices.notFoundGracePeriodSeconds" in e.body and "less than or equal to" in e.body, e.body
            refused = True
        # A device that goes missing makes the operator count its grace period.
        await support.assign(api, missing, scene.namespace)
        await wait_assigned(npci, missing, ("Assigned",))
        await support.report_device(api, scene.node, support.gpu(address), missing=True)
        await asyncio.sleep(3)
        await assert_nothing_torn_down(scene, kinds, operator)
        valid = conditions(await configs.get("cluster")).get("Valid", {})
        if valid.get("status") == "False":
            assert "notFoundGracePeriodSeconds" in valid["message"], valid
        elif not refused:  # taken: the missing device keeps its PCIDevice, and says until when
            got = conditions(await npci.get(missing)).get("Assigned", {})
            assert got.get("status") == "True", got
    finally:
        await configs.apply(config_body({"kubevirt": {"name": "kubevirt", "namespace": scene.namespace}}), "admin")
        await npci.delete(missing)


async def test_objects_of_any_size_are_refused_by_the_api_server(api, kinds, scene, operator):
    """Every string and list of the CRDs is bounded: an agent (or anyone who may write one) cannot
    store a name of 100,000 characters or a thousand conditions, and the good assignment stays."""
    from kubernetes_asyncio.client.exceptions import ApiException

    npci, pcidev = kinds[0], kinds[1]
    node, name = scene.node.name, f"pci-huge-{scene.unique}"
    cases = {
        "status.attributes.name": {"attributes": attributes("0000:47:00.0", node, name="x" * 100_000), "conditions": [ready()]},
        "status.conditions": {"attributes": attributes("0000:47:00.0", node),
                              "conditions": [{**ready(), "type": f"T{i}"} for i in range(1000)]},
        "status.conditions[0].message": {"attributes": attributes("0000:47:00.0", node), "conditions": [ready(message="m" * 100_000)]},
    }  # fmt: skip
    for field, status in cases.items():
        with pytest.raises((ApiException, ApiError)) as caught:
            await put(api, npci, name, node, status)
        assert caught.value.status == 422, (field, caught.value.body)
        assert field in caught.value.body and ("Too long" in caught.value.body or "Too many" in caught.value.body), caught.value.body
    # A PCIDevice (written by someone allowed to write one) is bounded alike.
    # (Named as no NodePCIDevice is, so the operator leaves it alone meanwhile.)
    lone = f"pci-lone-{scene.unique}"
    body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PCIDevice", "metadata": {"name": lone, "namespace": scene.namespace}}
    await pcidev.apply(body, "someone")
    try:
        with pytest.raises(ApiError) as caught:
            await pcidev.apply({**body, "status": {"attachedTo": "v" * 100_000}}, "someone", status=True)
        assert caught.value.status == 422 and "status.attachedTo" in caught.value.body, caught.value.body
    finally:
        await pcidev.delete(lone, scene.namespace)
        with contextlib.suppress(ApiException, ApiError):
            await client.CustomObjectsApi(api).delete_cluster_custom_object("passthrough.io", "v1alpha1", "nodepcidevices", name)
    await assert_nothing_torn_down(scene, kinds, operator)
