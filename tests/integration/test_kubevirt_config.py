"""The KubeVirt CR kept in line with the PassthroughConfig, against KubeVirt's real CRD."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import yaml
from kubernetes_asyncio import client

from e2e import fakesysfs, support
from passthrough.agent.loop import Agent
from passthrough.kube.custom import Custom
from passthrough.pci.pciids import PciIds
from tests.integration.test_metrics import scrape, scrape_when

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
DEFAULTS = yaml.safe_load((REPO / "tests/data/cozystack-gpu-passthrough-defaults.yaml").read_text())["pciHostDevices"]
MERGE = "application/merge-patch+json"
SYNCS = "passthrough_operator_reconcile_duration_seconds_count"


@pytest.fixture
def kinds(api):
    return Custom(api, "passthroughconfigs"), Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")


@pytest.fixture
def kubevirt_ns(namespace):
    """The namespace of this test's KubeVirt CR (each test names its own target)."""
    return namespace


@pytest.fixture
async def config(api, kinds, operator):
    """Writes the `cluster` PassthroughConfig; deleted after the test."""
    configs, _ = kinds

    async def put(spec: dict) -> None:
        body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"}, "spec": spec}
        await configs.apply(body, "admin")

    yield put
    with contextlib.suppress(client.exceptions.ApiException):
        await configs.delete("cluster")
    await support.wait_for(lambda: _absent(configs), what="config deleted")


async def _absent(configs):
    return await configs.get("cluster") is None


def configuration(kv: dict) -> dict:
    return kv["spec"]["configuration"]


def condition(obj: dict, type_: str) -> dict:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == type_), {})


async def wait_config(configs, check, what, timeout=20):
    async def ok():
        obj = await configs.get("cluster")
        return obj if obj and check(obj) else None

    return await support.wait_for(ok, timeout, what=what)


async def wait_kubevirt(kubevirts, namespace, check, what, timeout=20):
    async def ok():
        obj = await kubevirts.get("kubevirt", namespace)
        return obj if obj and check(obj) else None

    return await support.wait_for(ok, timeout, what=what)


def pci_list(kv: dict) -> list[dict]:
    return (configuration(kv).get("permittedHostDevices") or {}).get("pciHostDevices") or []


async def test_first_apply_writes_our_fields_and_leaves_everything_else(api, kinds, config, kubevirt_ns):
    configs, kubevirts = kinds
    before = await support.create_kubevirt(api, kubevirt_ns)
    await config({"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}})
    kv = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o), "permittedHostDevices applied")
    assert pci_list(kv) == DEFAULTS  # Cozystack's table, in its order
    assert configuration(kv)["developerConfiguration"]["featureGates"] == ["HostDevices", "Snapshot"]
    # Everything else is exactly as it was.
    assert configuration(kv)["developerConfiguration"]["logVerbosity"] == {"virtLauncher": 2}
    assert configuration(kv)["network"] == configuration(before)["network"]
    for key in ("certificateRotateStrategy", "imagePullPolicy", "workloadUpdateStrategy"):
        assert kv["spec"][key] == before["spec"][key]
    status = (await wait_config(configs, lambda o: condition(o, "Applied").get("status") == "True", "Applied=True"))["status"]
    assert status["featureGates"] == ["HostDevices"] and status["pciHostDevices"] == len(DEFAULTS)


async def test_an_event_that_changes_nothing_writes_nothing(api, kinds, config, kubevirt_ns, operator):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    await config({"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}})
    await wait_config(configs, lambda o: condition(o, "Applied").get("status") == "True", "Applied=True")
    await support.quiet(api, ("kubevirts", "passthroughconfigs"), settle=1)
    before = await support.write_counts(api)

    async def synced_after(patch) -> None:
        """`patch`, then until the operator has synced the CR since (its kubevirt reconciles, in its metrics)."""
        syncs = (await scrape(operator.metrics_port))(SYNCS, kind="kubevirt")
        await patch
        await scrape_when(operator.metrics_port, lambda s: s(SYNCS, kind="kubevirt") > syncs, "a sync of the KubeVirt CR")

    # Events without news: an annotation on the config, a label on the CR.
    await synced_after(client.CustomObjectsApi(api).patch_cluster_custom_object(
        "passthrough.io", "v1alpha1", "passthroughconfigs", "cluster", {"metadata": {"annotations": {"touched": "1"}}}, _content_type=MERGE))
    await synced_after(client.CustomObjectsApi(api).patch_namespaced_custom_object(
        "kubevirt.io", "v1", kubevirt_ns, "kubevirts", "kubevirt", {"metadata": {"labels": {"touched": "1"}}}, _content_type=MERGE))
    after = await support.write_counts(api)
    # Our two patches are the only writes (deletions are earlier tests' namespaces being emptied).
    changes = support.writes_between(before, after, "kubevirts", "passthroughconfigs", verbs=support.CHANGE_VERBS)
    assert changes == 2, support.diff(before, after)


async def test_a_hand_edit_of_our_fields_is_reverted(api, kinds, config, kubevirt_ns, cluster):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    await config({"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}})
    await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o), "applied")
    cluster.kubectl("patch", "kubevirt", "kubevirt", "-n", kubevirt_ns, "--type=merge", "-p",
                    '{"spec":{"configuration":{"permittedHostDevices":{"pciHostDevices":[{"pciVendorSelector":"10DE:2236","resourceName":"nvidia.com/mine"}]},'
                    '"developerConfiguration":{"featureGates":["Snapshot"]}}}}')
    kv = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o) == DEFAULTS, "hand edit reverted")
    assert configuration(kv)["developerConfiguration"]["featureGates"] == ["HostDevices", "Snapshot"]


async def test_a_kubevirt_cr_created_later_is_configured_as_it_appears(api, kinds, config, kubevirt_ns):
    configs, kubevirts = kinds
    await config({"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}})
    waiting = await wait_config(configs, lambda o: condition(o, "Applied").get("reason") == "WaitingForKubeVirt", "waiting")
    assert f"Waiting for KubeVirt {kubevirt_ns}/kubevirt" in condition(waiting, "Applied")["message"]
    await support.create_kubevirt(api, kubevirt_ns, gates=())
    kv = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o), "applied once it exists")
    assert configuration(kv)["developerConfiguration"]["featureGates"] == ["HostDevices"]
    await wait_config(configs, lambda o: condition(o, "Applied").get("reason") == "Applied", "Applied")


async def test_a_conflicting_duplicate_is_refused_and_the_last_good_config_stays(api, kinds, config, kubevirt_ns):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    user = {"pciVendorSelector": "10DE:1B80", "resourceName": "nvidia.com/GP104_GEFORCE_GTX_1080", "externalResourceProvider": True}
    spec = {"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}, "gpu": {"permittedHostDevices": {"pciHostDevices": [user]}}}
    await config(spec)
    good = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: len(pci_list(o)) == len(DEFAULTS) + 1, "good config applied")
    bad = {"pciVendorSelector": "10de:2236", "resourceName": "nvidia.com/A10"}
    spec["gpu"]["permittedHostDevices"]["pciHostDevices"] = [user, bad]
    await config(spec)
    refused = await wait_config(configs, lambda o: condition(o, "Valid").get("status") == "False", "refused")
    message = condition(refused, "Valid")["message"]
    assert "nvidia.com/GA102GL_A10" in message and "nvidia.com/A10" in message  # both entries named
    assert "last good configuration stays applied" in message

    async def warned():  # Events follow once the operator's work queue has settled (10 s at most)
        events = await client.CoreV1Api(api).list_namespaced_event("default", field_selector="involvedObject.name=cluster")
        return any(e.type == "Warning" and e.reason == "InvalidValues" for e in events.items)

    await support.wait_for(warned, 15, what="a Warning InvalidValues on the config")
    # The sync that refused the values is done (its Event came after it): nothing was torn down.
    kv = await kubevirts.get("kubevirt", kubevirt_ns)
    assert pci_list(kv) == pci_list(good)


async def test_replacing_the_defaults_with_nothing_removes_the_block_and_warns(api, kinds, config, kubevirt_ns):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    spec = {"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}}
    await config(spec)
    await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o), "applied")
    await config({**spec, "gpu": {"replaceDefaults": True}})
    kv = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: "permittedHostDevices" not in configuration(o), "block removed")
    assert configuration(kv)["developerConfiguration"]["featureGates"] == ["HostDevices", "Snapshot"]
    status = await wait_config(configs, lambda o: condition(o, "NodesMatchAllowList").get("reason") == "NoAllowList", "warned")
    assert any("checks no device names" in w for w in status["status"]["warnings"])


async def test_an_empty_allow_list_removes_a_block_written_by_hand(api, kinds, config, kubevirt_ns, cluster):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    await config({"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}, "gpu": {"replaceDefaults": True}})
    await wait_config(configs, lambda o: condition(o, "NodesMatchAllowList").get("reason") == "NoAllowList", "no allow-list")
    # An admin adds a block by hand (another field manager): the values say there is none.
    cluster.kubectl("patch", "kubevirt", "kubevirt", "-n", kubevirt_ns, "--type=merge", "-p",
                    '{"spec":{"configuration":{"permittedHostDevices":{"pciHostDevices":[{"pciVendorSelector":"10DE:2236","resourceName":"nvidia.com/mine"}]}}}}')  # fmt: skip
    kv = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: "permittedHostDevices" not in configuration(o), "hand-added block removed")
    assert configuration(kv)["developerConfiguration"]["featureGates"] == ["HostDevices", "Snapshot"]  # nothing else touched
    status = await wait_config(configs, lambda o: "was removed" in condition(o, "NodesMatchAllowList").get("message", ""), "said so")
    assert condition(status, "NodesMatchAllowList")["reason"] == "NoAllowList"

    async def warned():
        events = await client.CoreV1Api(api).list_namespaced_event("default", field_selector="involvedObject.name=cluster")
        return any(e.type == "Warning" and e.reason == "AllowListRemoved" and "1 pciHostDevices" in e.message for e in events.items)

    await support.wait_for(warned, 15, what="a Warning AllowListRemoved on the config")


async def test_extra_feature_gates_come_and_go_while_hand_added_ones_stay(api, kinds, config, kubevirt_ns):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns, gates=("Snapshot",))
    spec = {"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns, "extraFeatureGates": ["GPU", "HostDevices", "VMExport"]}}
    await config(spec)
    kv = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: "VMExport" in configuration(o)["developerConfiguration"]["featureGates"], "gates")
    assert configuration(kv)["developerConfiguration"]["featureGates"] == ["HostDevices", "GPU", "VMExport", "Snapshot"]
    await wait_config(configs, lambda o: (o.get("status") or {}).get("featureGates") == ["HostDevices", "GPU", "VMExport"], "recorded")
    spec["kubevirt"]["extraFeatureGates"] = ["GPU"]
    await config(spec)
    kv = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: "VMExport" not in configuration(o)["developerConfiguration"]["featureGates"], "dropped")
    assert configuration(kv)["developerConfiguration"]["featureGates"] == ["HostDevices", "GPU", "Snapshot"]


async def test_assigned_devices_get_their_exclusive_entry(api, kinds, config, kubevirt_ns, unique):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    await config({"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}})
    await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o), "applied")
    node = await support.ensure_node(api, f"kvnode-{unique}")
    try:
        name = await support.report_device(api, node, support.gpu("0000:5e:00.0"))
        await support.assign(api, name, kubevirt_ns)
        wanted = {"pciVendorSelector": "10DE:2236", "resourceName": f"passthrough.io/{name}", "externalResourceProvider": True}
        await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: wanted in pci_list(o), "exclusive entry")
    finally:
        await support.remove_node(api, node.name)
    await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: wanted not in pci_list(o), "exclusive entry gone with the device", 60)


async def test_a_stray_pcidevice_adds_no_entry_and_cannot_freeze_the_sync(api, kinds, config, kubevirt_ns, unique):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    await config({"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}})
    await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o), "applied")
    # Written by hand, not by the operator: no owner, and IDs that would make the render invalid.
    pcidevices = Custom(api, "pcidevices", namespaced=True)
    stray = f"pci-stray{unique}"
    body = {"apiVersion": "passthrough.io/v1alpha1", "kind": "PCIDevice", "metadata": {"name": stray, "namespace": kubevirt_ns}}
    await pcidevices.apply(body, "someone")
    await pcidevices.apply({**body, "status": {"resourceName": "passthrough.io/x", "attributes": {
        "pciAddress": "0000:01:00.0", "vendorID": "10de", "deviceID": "2236", "class": "030200", "nodeName": "n"}}},
        "someone", status=True)  # fmt: skip
    node = await support.ensure_node(api, f"kvnode-{unique}")
    try:
        # A real assignment after it still reaches KubeVirt: the sync is not frozen.
        name = await support.report_device(api, node, support.gpu("0000:5f:00.0"))
        await support.assign(api, name, kubevirt_ns)
        wanted = {"pciVendorSelector": "10DE:2236", "resourceName": f"passthrough.io/{name}", "externalResourceProvider": True}
        kv = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: wanted in pci_list(o), "the real device's entry")
        assert not [e for e in pci_list(kv) if stray in e["resourceName"]], pci_list(kv)
        config_obj = await configs.get("cluster")
        assert condition(config_obj, "Valid").get("status") != "False", config_obj["status"]
    finally:
        await support.remove_node(api, node.name)


async def test_a_device_assigned_while_the_values_are_invalid_says_its_entry_is_not_applied(
    api, kinds, config, kubevirt_ns, unique, cluster
):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    spec = {"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}}
    await config(spec)
    await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o), "applied")
    bad = {"pciVendorSelector": "10de:2236", "resourceName": "nvidia.com/A10"}  # conflicts with the default A10 entry
    await config({**spec, "gpu": {"permittedHostDevices": {"pciHostDevices": [bad]}}})
    await wait_config(configs, lambda o: condition(o, "Valid").get("status") == "False", "refused")
    # `kubectl get ptconfig` shows it in a column of its own.
    assert "False" in cluster.kubectl("get", "ptconfig", "cluster", "-o", "custom-columns=V:.status.conditions[?(@.type=='Valid')].status").stdout
    assert "VALID" in cluster.kubectl("get", "ptconfig", "cluster").stdout.splitlines()[0]
    node = await support.ensure_node(api, f"kvnode-{unique}")
    node_devices = Custom(api, "nodepcidevices")
    try:
        name = await support.report_device(api, node, support.gpu("0000:60:00.0"))
        await support.assign(api, name, kubevirt_ns)

        async def assigned_reason(reason):
            got = condition(await node_devices.get(name) or {}, "Assigned")
            return got if got.get("reason") == reason else None

        got = await support.wait_for(lambda: assigned_reason("AllowListNotApplied"), 20, what="AllowListNotApplied")
        assert got["status"] == "False" and f"passthrough.io/{name}" in got["message"] and "invalid" in got["message"]
        # Fixed values: the entry is applied and the device says Assigned.
        await config(spec)
        wanted = {"pciVendorSelector": "10DE:2236", "resourceName": f"passthrough.io/{name}", "externalResourceProvider": True}
        await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: wanted in pci_list(o), "the entry applied")
        await support.wait_for(lambda: assigned_reason("Assigned"), 20, what="Assigned once the values are fixed")
    finally:
        await support.remove_node(api, node.name)


async def test_an_assignment_of_a_model_kubevirt_serves_itself_is_refused(api, kinds, config, kubevirt_ns, unique):
    """KubeVirt's own device plugin serves every device of a model listed with externalResourceProvider:
    false, to VMs of any namespace: one of them cannot be a namespace's own. The operator refuses it
    (no PCIDevice, no allow-list entry) and says which entry and what to change; the rest goes on."""
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    served = {"pciVendorSelector": "10DE:2236", "resourceName": "nvidia.com/A10", "externalResourceProvider": False}
    user = {"pciVendorSelector": "1AF4:1000", "resourceName": "example.com/virtio", "externalResourceProvider": True}
    spec = {"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns},
            "gpu": {"replaceDefaults": True, "permittedHostDevices": {"pciHostDevices": [served, user]}}}  # fmt: skip
    await config(spec)
    await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o) == [served, user], "the values applied")
    node = await support.ensure_node(api, f"kvnode-{unique}")
    node_devices, pcidevices = Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True)
    try:
        a10 = await support.report_device(api, node, support.gpu("0000:61:00.0"))  # the model KubeVirt serves itself
        l40s = await support.report_device(api, node, support.gpu("0000:62:00.0", device="26b9", name="AD102GL [L40S]",
                                                                   resource="nvidia.com/AD102GL_L40S"))  # fmt: skip
        await support.assign(api, a10, kubevirt_ns)
        await support.assign(api, l40s, kubevirt_ns)
        other = {"pciVendorSelector": "10DE:26B9", "resourceName": f"passthrough.io/{l40s}", "externalResourceProvider": True}
        kv = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: other in pci_list(o), "the other device's entry")
        assert pci_list(kv) == [served, user, other]

        async def assigned(reason):
            got = condition(await node_devices.get(a10) or {}, "Assigned")
            return got if got.get("reason") == reason else None

        got = await support.wait_for(lambda: assigned("ServedByKubeVirt"), 20, what="ServedByKubeVirt on the device")
        assert got["status"] == "False" and "nvidia.com/A10" in got["message"] and "externalResourceProvider: true" in got["message"]
        assert await pcidevices.get(a10, kubevirt_ns) is None
        status = (await configs.get("cluster"))["status"]
        assert status.get("leftOut", []) == [] and condition({"status": status}, "Valid")["status"] == "True"

        async def warned():
            events = await client.CoreV1Api(api).list_namespaced_event("default", field_selector=f"involvedObject.name={a10}")
            return [e for e in events.items if e.type == "Warning" and e.reason == "ServedByKubeVirt"]

        await support.wait_for(warned, 20, what="a Warning Event on the device")
        # The admin lets the external plugin serve the model: the device is handed out, with its entry.
        spec["gpu"]["permittedHostDevices"]["pciHostDevices"] = [{**served, "externalResourceProvider": True}, user]
        await config(spec)
        wanted = {"pciVendorSelector": "10DE:2236", "resourceName": f"passthrough.io/{a10}", "externalResourceProvider": True}
        await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: wanted in pci_list(o), "the entry once the values allow it")
        await support.wait_for(lambda: assigned("Assigned"), 20, what="Assigned once the values allow it")
        assert await pcidevices.get(a10, kubevirt_ns) is not None
    finally:
        await support.remove_node(api, node.name)


async def test_a_node_with_an_older_pci_ids_is_reported_before_a_vm_fails(api, kinds, config, kubevirt_ns, unique, tmp_path):
    configs, kubevirts = kinds
    await support.create_kubevirt(api, kubevirt_ns)
    await config({"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns}})
    new, old = await support.ensure_node(api, f"new-{unique}"), await support.ensure_node(api, f"old-{unique}")
    try:
        for node, edition in ((new, "2025-07-11"), (old, "2023-04-10")):
            host = fakesysfs.FakeHost(tmp_path / node.name)
            host.add_root_port("0000:00:03.0", "3b", iommu_group=10)
            host.add_device("0000:3b:00.0", "10de", "2321", "030200", driver="vfio-pci", iommu_group=20)  # H100 NVL
            await Agent(api, node.name, host.sysfs, host.proc, PciIds.load(REPO / f"e2e/data/pci.ids.{edition}")).scan()

        def reported(o):
            listed = (o.get("status") or {}).get("notPermitted") or []
            return any(m.get("nodeName") == old.name for m in listed)

        status = (await wait_config(configs, reported, "the old node's name reported"))["status"]
        [mismatch] = [m for m in status["notPermitted"] if m.get("nodeName") in (old.name, new.name)]
        assert mismatch == {"resourceName": "nvidia.com/GH100", "pciVendorSelector": "10DE:2321", "nodeName": old.name,
                            "pciAddress": "0000:3b:00.0", "expected": "nvidia.com/GH100_H100L_94GB"}
        cond = condition((await configs.get("cluster")), "NodesMatchAllowList")
        assert cond["status"] == "False" and old.name in cond["message"]
    finally:
        for node in (new, old):
            await support.remove_node(api, node.name)


async def test_the_cr_records_our_gates_and_the_old_cr_is_let_go_of_when_the_values_name_another(api, kinds, config, kubevirt_ns):
    from passthrough.controller.kubevirt_sync import KubeVirtView

    configs, kubevirts = kinds
    other_ns = await support.create_namespace(api, f"{kubevirt_ns}-b")
    try:
        await support.create_kubevirt(api, kubevirt_ns, gates=("Snapshot",))
        await support.create_kubevirt(api, other_ns, gates=("Snapshot",))
        spec = {"kubevirt": {"name": "kubevirt", "namespace": kubevirt_ns, "extraFeatureGates": ["VMExport"]}}
        await config(spec)
        old = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: pci_list(o), "applied to the first CR")
        # Which gates are ours is on the CR itself, written with them, and its managedFields say the record is ours.
        assert old["metadata"]["annotations"]["passthrough.io/feature-gates"] == "HostDevices,VMExport"
        view = KubeVirtView.of(old)
        assert view.our_gates == ("HostDevices", "VMExport")
        assert view.owned == {"pciHostDevices", "featureGates", "passthrough.io/feature-gates"}
        await config({"kubevirt": {**spec["kubevirt"], "namespace": other_ns}})
        await wait_kubevirt(kubevirts, other_ns, lambda o: pci_list(o), "applied to the second CR")
        left = await wait_kubevirt(kubevirts, kubevirt_ns, lambda o: "permittedHostDevices" not in configuration(o),
                                   "the first CR let go of")  # fmt: skip
        assert configuration(left)["developerConfiguration"]["featureGates"] == ["Snapshot"]  # its own gate stays, ours go
        assert "passthrough.io/feature-gates" not in (left["metadata"].get("annotations") or {})
        assert configuration(left)["network"] == {"defaultNetworkInterface": "bridge"}  # the rest untouched
    finally:
        await client.CoreV1Api(api).delete_namespace(other_ns)
