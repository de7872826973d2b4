"""DRA mode's pure parts and the driver's own gate: what a node publishes in its ResourceSlice,
when the slice is written, what a prepared claim hands its container (CDI, KEP-5304 metadata),
and that a device handed out to one namespace is never prepared for another's claim."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import pytest

from e2e import fakesysfs
from passthrough.agent.report import object_name
from passthrough.dra import cdi
from passthrough.dra import slice as dra_slice
from passthrough.dra.driver import Driver
from passthrough.dra.preparer import PrepareError
from passthrough.pci.discovery import discover
from passthrough.pci.pciids import PciIds

NODE = "gpu-1"
GPUS = ("0000:3b:00.0", "0000:af:00.0")


@pytest.fixture(scope="module")
def pci_ids():
    return PciIds.load(Path(__file__).resolve().parents[2] / "e2e" / "data" / "pci.ids.2025-07-11")


@pytest.fixture
def gpu_node(tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    devices = discover(host.sysfs, host.proc, pci_ids).devices
    names = {d.address: object_name(d, NODE) for d in devices if d.reported}
    return devices, names


def offered(published) -> dict[str, str]:
    return {p.device.address: p.namespace for p in published}


# -- what is published ------------------------------------------------------------------------


def test_outside_gpu_mode_only_handed_out_devices_are_published_with_their_namespace(gpu_node):
    devices, names = gpu_node
    assert dra_slice.publishable(devices, {}, names, in_gpu_mode=False) == []
    handed = {names[GPUS[1]]: "team-a"}
    assert offered(dra_slice.publishable(devices, handed, names, False, claimed={names[GPUS[1]]})) == {GPUS[1]: "team-a"}


def test_in_gpu_mode_every_gpu_is_a_pool_device_and_never_its_audio_function(gpu_node):
    devices, names = gpu_node
    assert offered(dra_slice.publishable(devices, {}, names, in_gpu_mode=True)) == {GPUS[0]: "", GPUS[1]: ""}


def test_a_group_an_admin_assigned_leaves_the_pool_before_its_hand_out(gpu_node):
    devices, names = gpu_node
    # Assigned (claimed) but not yet handed out: in nobody's offer, and out of the pool.
    assert offered(dra_slice.publishable(devices, {}, names, True, claimed={names[GPUS[1]]})) == {GPUS[0]: ""}


def test_an_ineligible_device_is_never_published_even_when_handed_out(gpu_node):
    devices, names = gpu_node
    devices = [dataclasses.replace(d, eligible=False, reason="x") if d.address == GPUS[1] else d for d in devices]
    assert dra_slice.publishable(devices, {names[GPUS[1]]: "team-a"}, names, False) == []


def test_device_attributes_carry_the_pci_bus_id_the_group_and_the_namespace(gpu_node):
    devices, names = gpu_node
    [item] = dra_slice.publishable(devices, {names[GPUS[1]]: "team-a"}, names, False)
    assert item.name == "pci-0000-af-00-0"
    attributes = dra_slice.attributes(item)
    assert attributes["resource.kubernetes.io/pciBusID"] == {"string": "0000:af:00.0"}
    assert attributes["passthrough.io/namespace"] == {"string": "team-a"}
    assert attributes["passthrough.io/iommuGroup"] == {"int": 21}
    assert attributes["passthrough.io/numaNode"] == {"int": 1}
    assert attributes["passthrough.io/resourceName"] == {"string": "nvidia.com/GA102GL_A10"}
    assert attributes["passthrough.io/nodePCIDevice"] == {"string": names[GPUS[1]]}
    assert all(len(v.get("string", "")) <= dra_slice.STRING_MAX for v in attributes.values())
    assert len(attributes) <= 32  # the API's bound on attributes and capacities of a device


def test_a_long_model_name_is_cut_to_what_the_api_accepts(gpu_node):
    devices, names = gpu_node
    devices = [dataclasses.replace(d, name="X" * 200) for d in devices]
    [item] = dra_slice.publishable(devices, {names[GPUS[1]]: "team-a"}, names, False)
    assert dra_slice.attributes(item)["passthrough.io/model"] == {"string": "X" * 64}


# -- when the slice is written ----------------------------------------------------------------


def test_the_slice_is_written_only_when_what_we_write_differs(gpu_node):
    devices, names = gpu_node
    desired = dra_slice.spec(NODE, dra_slice.publishable(devices, {}, names, True))
    assert dra_slice.changed(desired, None, "uid-1")
    [live] = dra_slice.pool_bodies(NODE, "uid-1", [desired], [None])
    assert live["spec"]["pool"]["generation"] == 1
    # What the API server returns holds more than we wrote (managedFields, a resourceVersion).
    live["metadata"].update(resourceVersion="7", managedFields=[{"manager": "passthrough-agent"}])
    assert not dra_slice.changed(desired, live, "uid-1")
    assert dra_slice.changed(desired, live, "uid-2")  # a Node of that name registered again
    fewer = dra_slice.spec(NODE, dra_slice.publishable(devices, {}, names, False))
    assert dra_slice.changed(fewer, live, "uid-1")
    assert dra_slice.pool_bodies(NODE, "uid-1", [fewer], [live])[0]["spec"]["pool"]["generation"] == 2


def test_names_are_what_the_api_accepts():
    assert dra_slice.device_name("0000:3B:00.7") == "pci-0000-3b-00-7"
    assert dra_slice.slice_name("gpu-1") == "gpu-1-pci.passthrough.io"
    long = dra_slice.slice_name("n" * 253)
    assert len(long) <= 253 and long.startswith("pci.passthrough.io-")


# -- what a prepared claim hands over ---------------------------------------------------------


def _prepared(request="gpu", name="pci-0000-af-00-0", group=21, cdev="") -> cdi.PreparedDevice:
    return cdi.PreparedDevice(request=request, pool=NODE, name=name, address="0000:af:00.0", iommu_group=group,
                              attributes={"resource.kubernetes.io/pciBusID": {"string": "0000:af:00.0"}}, cdev=cdev)  # fmt: skip


def test_the_cdi_spec_gives_the_vfio_nodes_and_iommufd_only_where_the_kernel_has_it():
    [plain] = cdi.vfio_spec("uid", [_prepared()])["devices"]
    assert [n["path"] for n in plain["containerEdits"]["deviceNodes"]] == ["/dev/vfio/vfio", "/dev/vfio/21"]
    [modern] = cdi.vfio_spec("uid", [_prepared(cdev="vfio3")])["devices"]
    assert [n["path"] for n in modern["containerEdits"]["deviceNodes"]][2:] == ["/dev/vfio/devices/vfio3", "/dev/iommu"]


def test_the_metadata_file_is_a_stream_kubernetes_and_kubevirt_both_read():
    claim = {"metadata": {"name": "vm-gpu", "namespace": "team-a", "uid": "u-1"}}
    text = cdi.metadata_stream("pci.passthrough.io", claim, "gpu", [_prepared()])
    objects = cdi.read_stream(text)
    assert [o["apiVersion"] for o in objects] == list(cdi.METADATA_VERSIONS)
    assert objects[0] == {**objects[1], "apiVersion": "metadata.resource.k8s.io/v1beta1"}
    [device] = objects[1]["requests"][0]["devices"]
    assert device["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:af:00.0"}
    assert "podClaimName" not in objects[0]


def test_a_subrequest_is_named_in_full_for_kubernetes_and_by_its_request_for_kubevirt():
    claim = {"metadata": {"name": "vm-gpu", "namespace": "team-a", "uid": "u-1"}}
    objects = cdi.read_stream(cdi.metadata_stream("d.io", claim, "gpu/large", [_prepared(request="gpu/large")]))
    names = {o["apiVersion"].rsplit("/", 1)[1]: o["requests"][0]["name"] for o in objects}
    assert names == {"v1beta1": "gpu/large", "v1alpha1": "gpu"}  # KubeVirt 1.9 reads v1alpha1, by the pod's name
    assert objects[0]["requests"][0]["devices"] == objects[1]["requests"][0]["devices"]


def test_a_claim_from_a_template_is_mounted_under_the_pods_name_for_it():
    claim = {"metadata": {"name": "vm-x7k2", "namespace": "team-a", "uid": "u-1",
                          "annotations": {cdi.POD_CLAIM_ANNOTATION: "gpu-claim"}}}  # fmt: skip
    assert '"podClaimName": "gpu-claim"' in cdi.metadata_stream("d.io", claim, "gpu", [_prepared()])
    assert cdi.metadata_container_path("d.io", "vm-x7k2", "gpu/large", "gpu-claim") == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/gpu-claim/gpu/d.io-metadata.json"
    )


def test_each_request_mounts_its_metadata_once_and_every_device_gets_its_vfio_nodes(tmp_path):
    devices = [_prepared(name="a"), _prepared(name="b"), _prepared(request="nic", name="c")]
    ids = cdi.cdi_ids("u", "d.io", devices)
    assert ids == {"a": ["passthrough.io/vfio=u-a", "d.io/metadata=u_gpu"], "b": ["passthrough.io/vfio=u-b"],
                   "c": ["passthrough.io/vfio=u-c", "d.io/metadata=u_nic"]}  # fmt: skip
    (tmp_path / "x.json").write_text(json.dumps(cdi.vfio_spec("u", devices)))
    assert [n["path"] for n in cdi.resolve(tmp_path, ids["a"][:1] + ids["b"])["deviceNodes"]] == ["/dev/vfio/vfio", "/dev/vfio/21"]
    with pytest.raises(KeyError, match="unresolvable"):
        cdi.resolve(tmp_path, ["d.io/metadata=u_gpu"])


# -- the driver's own gate --------------------------------------------------------------------


class FakeSession:
    """The API as the driver's prepare sees it: one claim."""

    def __init__(self, claim):
        self.claim = claim

    async def request(self, method, path, **_):
        assert method == "GET" and path.endswith(f"/resourceclaims/{self.claim['metadata']['name']}")
        return self.claim


def test_a_device_handed_out_to_one_namespace_is_never_prepared_for_another(gpu_node, tmp_path):
    devices, names = gpu_node
    claim = {"metadata": {"name": "steal", "namespace": "team-b", "uid": "u-9"},
             "status": {"allocation": {"devices": {"results": [
                 {"request": "gpu", "driver": dra_slice.DRIVER, "pool": NODE, "device": "pci-0000-af-00-0"}]}}}}  # fmt: skip
    driver = Driver(FakeSession(claim), NODE, kubelet_dir=tmp_path / "kubelet", cdi_dir=tmp_path / "cdi",
                    pci_ids=PciIds.load(Path(__file__).resolve().parents[2] / "e2e" / "data" / "pci.ids.2025-07-11"))  # fmt: skip
    driver.preparer.inventory = dra_slice.by_name(dra_slice.publishable(devices, {names[GPUS[1]]: "team-a"}, names, False))
    with pytest.raises(PrepareError, match="belongs to namespace team-a: a claim of team-b never gets it"):
        asyncio.run(driver.preparer.prepare("team-b", "steal", "u-9"))
    assert driver.preparer.prepared == {} and not (tmp_path / "cdi").exists()  # nothing bound, nothing written
