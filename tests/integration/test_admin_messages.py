"""What an admin and a tenant read, against the real control plane, in both of the operator's
modes: each condition a user can meet has a reason of its own (on the condition and on its
Event), advice names the way of the node's mode (a device name for device plugins, a DeviceClass
in DRA mode), and Attached names the pods that hold a device.

NodePCIDevices are written as the node agent writes them (`e2e.support.report_device`, and its
`status.holders` as the agent reports the kubelet's PodResources), the admin's assignment as
`kubectl patch` would.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from e2e import support
from e2e.processes import OperatorProcess
from passthrough.agent import report
from passthrough.api import reasons
from passthrough.kube.custom import AGENT_MANAGER, Custom
from passthrough.pci.naming import exclusive_resource_name
from tests.integration.test_chart import explained
from tests.integration.test_operator_lifecycle import wait_condition

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module", params=["device-plugin", "dra"])
def mode(request):
    return request.param


@pytest.fixture(scope="module")
def operator(cluster, tmp_path_factory, mode):
    flags = ["--dra"] if mode == "dra" else []
    proc = OperatorProcess(cluster, tmp_path_factory.mktemp("operator") / "operator.log", "--not-found-grace=4s", *flags)
    proc.start()
    yield proc
    proc.stop()
    assert "Traceback" not in proc.output(), proc.output()[-5000:]


@pytest.fixture
async def gpu_device(api, unique, operator):
    node = await support.ensure_node(api, f"msg-{unique}")
    device = support.gpu("0000:3b:00.0")
    name = await support.report_device(api, node, device)
    yield node, device, name
    await support.remove_node(api, node.name)


@pytest.fixture
def kinds(api):
    return Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True)


async def events_of(api, namespace: str, name: str, reason: str) -> list[client.CoreV1Event]:
    async def found():
        listed = await client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
        return [e for e in listed.items if e.reason == reason] or None

    return await support.wait_for(found, 20, 0.2, what=f"a {reason} Event of {namespace}/{name}")


async def test_an_assignment_to_a_missing_namespace_says_so_in_its_reason_and_its_warning(api, kinds, gpu_device, unique):
    npci, _ = kinds
    _, _, name = gpu_device
    missing = f"nowhere-{unique}"
    await support.assign(api, name, missing)
    got = await wait_condition(npci, name, "Assigned", "NamespaceNotFound")
    assert (got["status"], got["message"]) == ("False", f"Namespace {missing} does not exist; create it or clear spec.assignedNamespace.")
    [event, *_] = await events_of(api, "default", name, "NamespaceNotFound")
    assert (event.type, event.message) == ("Warning", got["message"])


async def test_the_way_to_use_a_device_fits_the_operators_mode(api, kinds, gpu_device, namespace, mode):
    npci, _ = kinds
    _, _, name = gpu_device
    await support.assign(api, name, namespace)
    got = await wait_condition(npci, name, "Assigned", "Assigned")
    [event, *_] = await events_of(api, namespace, name, "Assigned")
    for said in (got["message"], event.message):
        if mode == "dra":
            assert f"claim it with a ResourceClaim request of deviceClassName passthrough-{namespace}" in said, said
            assert "deviceName" not in said, said
        else:
            assert f"set deviceName {exclusive_resource_name(name)} in a VM's hostDevices" in said, said
            assert "deviceClassName" not in said, said


async def test_attached_names_the_pod_that_holds_the_device(api, kinds, gpu_device, namespace):
    npci, pcidev = kinds
    node, device, name = gpu_device
    await support.assign(api, name, namespace)
    await wait_condition(npci, name, "Assigned", "Assigned")
    await wait_condition(npci, name, "Attached", "Available", contains="No VirtualMachine, claim or pod uses this device")
    # The agent's report while a plain pod of the namespace holds the device.
    held = {"namespace": namespace, "pod": "cuda", "resource": exclusive_resource_name(name)}
    live = await npci.get(name)
    desired = report.present_status(device, name, node.name, namespace)
    desired["holders"] = [held]
    await npci.apply(report.status_body(name, desired, live), AGENT_MANAGER, status=True)
    said = f"Held by pod {namespace}/cuda (no VirtualMachine lists it)."
    got = await wait_condition(npci, name, "Attached", "HeldByPod", contains=said)
    assert got["status"] == "True"
    await wait_condition(pcidev, name, "Attached", "HeldByPod", namespace, contains=said)


@pytest.mark.parametrize(("kind", "types"), [
    ("NodePCIDevice", ("Ready", "Assigned", "Attached")),
    ("PCIDevice", ("Ready", "Attached")),
    ("PassthroughConfig", ("Valid", "Applied", "AssignedDevicesPermitted", "NodesMatchAllowList")),
])  # fmt: skip
def test_kubectl_explain_lists_the_reasons_each_condition_can_have(cluster, kind, types):
    said = explained(cluster, f"{kind.lower()}.status.conditions.reason")
    for type_ in types:
        assert f"{type_}: {', '.join(reasons.of_condition(kind, type_))}." in said, said
    assert "NamespaceNotFound" in said or kind != "NodePCIDevice"
