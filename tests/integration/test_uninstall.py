"""`passthrough uninstall` (the chart's post-delete hook) against the real control plane: once the
operator is gone it lets go of what the operator wrote on others' objects (the KubeVirt CR's
allow-list and feature gates, the in-use finalizers, its DeviceClasses) and leaves the CRDs, the
devices, their assignments and whatever else others wrote. It runs as the hook's Job would: its
command line and its ServiceAccount, ClusterRole and binding as the chart renders them (the Job's
pod itself needs the image and a container runtime, which the local control plane has not)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import pytest
from kubernetes_asyncio import client

from e2e import chart, identities, support
from e2e.processes import OperatorProcess
from passthrough.controller.world import FINALIZER
from passthrough.kube.custom import Custom
from tests.integration.test_kubevirt_config import configuration, pci_list, wait_kubevirt
from tests.integration.test_operator_lifecycle import put_vm, wait_condition

pytestmark = pytest.mark.cluster


def uninstall(kubeconfig, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "passthrough", "uninstall", f"--kubeconfig={kubeconfig}", *args],
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.fixture
def hook(cluster, helm, namespace, unique, tmp_path):
    """The chart's post-delete hook for a release in `namespace`: its objects created, the Job's
    command line, and a kubeconfig of its ServiceAccount."""
    objects = chart.template(helm, f"un-{unique}", namespace, "--show-only=templates/uninstall-hook.yaml")
    [job] = [o for o in objects if o["kind"] == "Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-delete"
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    account = job["spec"]["template"]["spec"]["serviceAccountName"]
    with chart.installed(cluster, [o for o in objects if o["kind"] != "Job"]):
        yield command, identities.identity(cluster, namespace, account, tmp_path).kubeconfig


async def test_uninstall_lets_go_of_what_the_operator_wrote_and_leaves_the_crds_and_the_devices(
    api, cluster, namespace, unique, tmp_path, hook
):  # fmt: skip
    command, kubeconfig = hook
    assert command[:2] == ["passthrough", "uninstall"]
    operator_pods = next(a for a in command if a.startswith("--wait-for-pods=")).split("=", 1)[1]
    as_hook = [*command[2:], f"--kubeconfig={kubeconfig}"]
    assert f"--namespace={namespace}" in as_hook
    configs = Custom(api, "passthroughconfigs")
    kubevirts = Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")
    npci, pcidev = Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True)
    operator = OperatorProcess(cluster, tmp_path / "operator.log", "--not-found-grace=4s")
    operator.start()
    node = await support.ensure_node(api, f"un-{unique}")
    try:
        await support.create_kubevirt(api, namespace)
        await configs.apply({"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
                             "spec": {"kubevirt": {"name": "kubevirt", "namespace": namespace}}}, "admin")  # fmt: skip
        name = await support.report_device(api, node, support.gpu("0000:3b:00.0"))
        await support.assign(api, name, namespace)
        await wait_condition(npci, name, "Assigned", "Assigned")
        await put_vm(api, namespace, "vm-a", [f"passthrough.io/{name}"])
        await wait_condition(npci, name, "Attached", "AttachedToVirtualMachine")
        await wait_kubevirt(kubevirts, namespace, lambda kv: any(e["resourceName"] == f"passthrough.io/{name}" for e in pci_list(kv)),
                            "the device's allow-list entry")  # fmt: skip
        assert FINALIZER in (await pcidev.get(name, namespace))["metadata"]["finalizers"]
        # Still running, the operator would write them all back: it is told to wait for its pods.
        labels = dict(pair.split("=") for pair in operator_pods.split(","))
        labelled = await support.create_pod(api, namespace, client.V1Pod(
            metadata=client.V1ObjectMeta(name="operator", labels=labels),
            spec=client.V1PodSpec(node_name=node.name, containers=[client.V1Container(name="c", image="x")])))  # fmt: skip
        waited = subprocess.run([sys.executable, "-m", "passthrough", "uninstall", *as_hook, "--timeout=2"],
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        assert waited.returncode == 1 and "still there after 2s" in waited.stderr and waited.stdout == "", waited
        assert FINALIZER in (await pcidev.get(name, namespace))["metadata"]["finalizers"]  # nothing changed
        await client.CoreV1Api(api).delete_namespaced_pod(labelled.metadata.name, namespace, grace_period_seconds=0)
        operator.stop()

        done = subprocess.run([sys.executable, "-m", "passthrough", "uninstall", *as_hook], capture_output=True, text=True,
                              timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"KubeVirt {namespace}/kubevirt: let go of the operator's allow-list entries and feature gates" in done.stdout
        assert f"PCIDevice {namespace}/{name}: finalizer {FINALIZER} removed" in done.stdout
        assert f"NodePCIDevice {name}: finalizer {FINALIZER} removed" in done.stdout
        # KubeVirt: the operator's entries and gate gone, what the install wrote as it was.
        kv = await kubevirts.get("kubevirt", namespace)
        assert pci_list(kv) == [] and configuration(kv)["developerConfiguration"]["featureGates"] == ["Snapshot"]
        assert configuration(kv)["developerConfiguration"]["logVerbosity"] == {"virtLauncher": 2}
        # The devices stay, assigned, without the finalizer; the PCIDevice keeps its node label and owner.
        device = await pcidev.get(name, namespace)
        assert not device["metadata"].get("finalizers") and device["metadata"]["ownerReferences"][0]["kind"] == "NodePCIDevice"
        assert device["metadata"]["labels"]["passthrough.io/node"] == node.name
        node_device = await npci.get(name)
        assert not node_device["metadata"].get("finalizers") and node_device["spec"]["assignedNamespace"] == namespace
        for crd in ("nodepcidevices", "pcidevices", "passthroughconfigs"):
            cluster.kubectl("get", "crd", f"{crd}.passthrough.io")
        assert "Left as Helm leaves them: the CRDs" in done.stdout
        # Run again: nothing left to let go of, nothing written.
        again = uninstall(cluster.kubeconfig)
        assert again.returncode == 0 and "removed" not in again.stdout and "let go" not in again.stdout, again.stdout
    finally:
        operator.stop()
        with contextlib.suppress(Exception):
            await configs.delete("cluster")
        await support.remove_node(api, node.name)


async def test_uninstall_deletes_the_operators_device_classes_and_no_other(api, cluster, namespace, unique, tmp_path, hook):
    command, kubeconfig = hook
    classes = Custom(api, "deviceclasses", group="resource.k8s.io", version="v1")
    theirs = f"gpus-{unique}"
    await classes.apply({"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": theirs},
                         "spec": {"selectors": [{"cel": {"expression": "true"}}]}}, "admin")  # fmt: skip
    operator = OperatorProcess(cluster, tmp_path / "operator.log", "--dra")
    operator.start()
    node = await support.ensure_node(api, f"und-{unique}")
    try:
        name = await support.report_device(api, node, support.gpu("0000:3b:00.0"))
        await support.assign(api, name, namespace)
        await wait_condition(Custom(api, "nodepcidevices"), name, "Assigned", "Assigned")
        ours = [f"passthrough-{namespace}", "passthrough-pool.gpu"]
        for made in ours:
            await support.wait_for(lambda made=made: classes.get(made), 30, what=f"DeviceClass {made}")
        operator.stop()
        done = subprocess.run([sys.executable, "-m", "passthrough", "uninstall", *command[2:], f"--kubeconfig={kubeconfig}"],
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, done.stderr
        for made in ours:
            assert f"DeviceClass {made}: deleted" in done.stdout, done.stdout
            await support.wait_for(lambda made=made: _gone(classes, made), 30, what=f"DeviceClass {made} deleted")
        assert await classes.get(theirs) is not None
    finally:
        operator.stop()
        await classes.delete(theirs)
        await support.remove_node(api, node.name)


async def _gone(kind: Custom, name: str) -> bool:
    return await kind.get(name) is None
