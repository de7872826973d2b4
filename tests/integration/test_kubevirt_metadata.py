"""KubeVirt's own code reads the device-metadata files our DRA driver writes.

The driver writes a prepared claim's files (`dra.prepared.write_files`: the KEP-5304 metadata stream
and the CDI spec that mounts it); the mounts are resolved as a CDI runtime does, giving the files
at the paths the launcher pod sees; then virt-launcher's DRA host-device code of KubeVirt 1.9
(`e2e/kubevirt_metadata/`, built from the Go module proxy, unmodified) turns them and a VMI into
libvirt host devices. The PCI addresses in what it returns are KubeVirt's answer.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from e2e import build, fakesysfs, kubevirt_metadata, support
from passthrough.agent.report import object_name
from passthrough.dra import cdi
from passthrough.dra import slice as dra_slice
from passthrough.dra.prepared import write_files
from passthrough.dra.slice import DRIVER
from passthrough.pci.discovery import discover
from passthrough.pci.pciids import PciIds

REPO = Path(__file__).resolve().parents[2]
NODE = "gpu-1"
GPUS = ("0000:3b:00.0", "0000:af:00.0")  # e2e.fakesysfs.gpu_node's two A10s
NAMESPACE = "team-a"


@pytest.fixture(scope="module")
def kubevirt(request) -> Path:
    """The built program; a loud skip where Go or the module proxy is missing (a failure under CI)."""
    try:
        return kubevirt_metadata.ensure_binary()
    except build.BuildError as exc:
        support.cannot_run(request, "KubeVirt-metadata", str(exc), once_key="kubevirt-metadata")


@pytest.fixture(scope="module")
def pci_ids() -> PciIds:
    return PciIds.load(REPO / "e2e/data/pci.ids.2025-07-11")


@pytest.fixture(scope="module")
def node(tmp_path_factory, pci_ids) -> dict[str, dra_slice.Published]:
    """PCI address -> the device as the node's slice publishes it (real discovery of a fixture node)."""
    host = fakesysfs.gpu_node(tmp_path_factory.mktemp("gpu-node"))
    devices = discover(host.sysfs, host.proc, pci_ids).devices
    names = {d.address: object_name(d, NODE) for d in devices if d.reported}
    published = dra_slice.publishable(devices, {names[a]: NAMESPACE for a in GPUS}, names, False)
    return {item.device.address: item for item in published}


def _claim(name: str, pod_claim_name: str = "") -> dict:
    meta = {"name": name, "namespace": NAMESPACE, "uid": f"uid-{name}"}
    if pod_claim_name:
        meta["annotations"] = {cdi.POD_CLAIM_ANNOTATION: pod_claim_name}
    return {"metadata": meta}


def hand_over(tmp_path: Path, node, claim: dict, allocated: list[tuple[str, str]]) -> Path:
    """Prepare `claim` (its allocation: (request, PCI address) pairs) with the driver's own writer
    and lay its metadata files out as the launcher pod sees them; returns that pod's base dir."""
    devices = [
        cdi.PreparedDevice(request=request, pool=NODE, name=node[address].name, address=address,
                           iommu_group=node[address].device.iommu_group, attributes=dra_slice.attributes(node[address]))
        for request, address in allocated
    ]  # fmt: skip
    prepared = write_files(claim, devices, tmp_path / "cdi", tmp_path / "kubelet" / "plugins" / DRIVER)
    ids = [cdi_id for device in prepared.devices for cdi_id in device["cdi_ids"]]
    base = tmp_path / "launcher"
    for mount in cdi.resolve(tmp_path / "cdi", ids)["mounts"]:
        target = kubevirt_metadata.local_path(base, mount["containerPath"])
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(mount["hostPath"], target)
    return base


def vmi(claims: dict[str, dict], gpus=(), host_devices=()) -> dict:
    """A VMI: `claims` its spec.resourceClaims by name; gpus/host_devices (device, claim, request)."""
    def entries(devices):
        return [{"name": name, "claimName": claim, "requestName": request} for name, claim, request in devices]

    return {
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "vm", "namespace": NAMESPACE},
        "spec": {"resourceClaims": [{"name": name, **source} for name, source in claims.items()],
                 "domain": {"devices": {"gpus": entries(gpus), "hostDevices": entries(host_devices)}}},
    }  # fmt: skip


def addresses(found: dict) -> dict[str, str]:
    """Alias -> PCI address of the PCI host devices KubeVirt made, after checking their shape."""
    assert "error" not in found, found["error"]
    for device in found["hostDevices"]:
        assert device["type"] == "pci" and device["managed"] == "no", device
        domain, bus, rest = device["address"].split(":")
        slot, function = rest.split(".")
        assert (f'<source><address type="pci" domain="0x{domain}" bus="0x{bus}" slot="0x{slot}" function="0x{function}">'
                in device["xml"])
    return {device["alias"]: device["address"] for device in found["hostDevices"]}


def test_kubevirt_finds_the_address_of_a_claims_one_device(kubevirt, node, tmp_path):
    base = hand_over(tmp_path, node, _claim("vm-gpu"), [("gpu", GPUS[1])])
    found = kubevirt_metadata.read_as_kubevirt(kubevirt, base, vmi({"gpu": {"resourceClaimName": "vm-gpu"}},
                                                                   gpus=[("gpu1", "gpu", "gpu")]))  # fmt: skip
    assert addresses(found["gpus"]) == {"dra-gpu-gpu1": GPUS[1]}
    assert found["hostDevices"]["hostDevices"] == []


def test_kubevirt_finds_a_host_device_of_a_claim_made_from_a_template(kubevirt, node, tmp_path):
    # The generated claim's name is random; the launcher pod mounts it under the pod's name for it,
    # which KubeVirt takes from the VMI's resourceClaims entry.
    claim = _claim("virt-launcher-vm-x7k2-passthrough-9fq4d", pod_claim_name="passthrough")
    base = hand_over(tmp_path, node, claim, [("dev", GPUS[0])])
    found = kubevirt_metadata.read_as_kubevirt(kubevirt, base, vmi(
        {"passthrough": {"resourceClaimTemplateName": "one-gpu"}}, host_devices=[("hd", "passthrough", "dev")]))
    assert addresses(found["hostDevices"]) == {"dra-hostdevice-hd": GPUS[0]}


def test_kubevirt_finds_the_device_a_subrequest_chose_under_its_request(kubevirt, node, tmp_path):
    # The launcher pod names the request ("gpu"), never the subrequest the allocator chose.
    base = hand_over(tmp_path, node, _claim("vm-gpu"), [("gpu/large", GPUS[0])])
    found = kubevirt_metadata.read_as_kubevirt(kubevirt, base, vmi({"gpu": {"resourceClaimName": "vm-gpu"}},
                                                                   gpus=[("gpu1", "gpu", "gpu")]))  # fmt: skip
    assert addresses(found["gpus"]) == {"dra-gpu-gpu1": GPUS[0]}


def test_kubevirt_finds_each_request_of_a_claim(kubevirt, node, tmp_path):
    base = hand_over(tmp_path, node, _claim("vm-pair"), [("a", GPUS[0]), ("b", GPUS[1])])
    found = kubevirt_metadata.read_as_kubevirt(kubevirt, base, vmi(
        {"pair": {"resourceClaimName": "vm-pair"}}, gpus=[("first", "pair", "a")], host_devices=[("second", "pair", "b")]))
    assert addresses(found["gpus"]) == {"dra-gpu-first": GPUS[0]}
    assert addresses(found["hostDevices"]) == {"dra-hostdevice-second": GPUS[1]}


def test_kubevirt_reads_both_devices_of_one_request_and_refuses_a_request_of_two(kubevirt, node, tmp_path):
    # KubeVirt 1.9 maps one request to one VM device: a request with count 2 (both our devices in
    # the file, in order) is refused by name, not mistaken for one device.
    base = hand_over(tmp_path, node, _claim("vm-two"), [("gpus", GPUS[0]), ("gpus", GPUS[1])])
    [path] = base.rglob("*-metadata.json")
    [device_names] = {tuple(d["name"] for d in o["requests"][0]["devices"]) for o in cdi.read_stream(path.read_text())}
    assert device_names == (node[GPUS[0]].name, node[GPUS[1]].name)
    found = kubevirt_metadata.read_as_kubevirt(kubevirt, base, vmi({"two": {"resourceClaimName": "vm-two"}},
                                                                   gpus=[("gpu1", "two", "gpus")]))  # fmt: skip
    assert 'request "gpus" has 2 devices but KubeVirt only supports exactly one device per request' in found["gpus"]["error"]


# -- what KubeVirt would do with a file written otherwise: why ours is written as it is -------


def _rewrite(base: Path, keep) -> None:
    """Rewrite the one metadata file under `base` with the objects `keep` returns."""
    [path] = base.rglob("*-metadata.json")
    path.write_text("".join(json.dumps(o) + "\n" for o in keep(cdi.read_stream(path.read_text()))))


def test_kubevirt_cannot_read_a_file_with_only_the_v1beta1_object(kubevirt, node, tmp_path):
    base = hand_over(tmp_path, node, _claim("vm-gpu"), [("gpu", GPUS[1])])
    spec = vmi({"gpu": {"resourceClaimName": "vm-gpu"}}, gpus=[("gpu1", "gpu", "gpu")])
    _rewrite(base, lambda objects: [o for o in objects if o["apiVersion"].endswith("/v1beta1")])
    error = kubevirt_metadata.read_as_kubevirt(kubevirt, base, spec)["gpus"]["error"]
    assert "no compatible metadata version found in stream (unknown versions: metadata.resource.k8s.io/v1beta1)" in error
    [path] = base.rglob("*-metadata.json")  # the same one object, as v1alpha1 this time: read
    path.write_text(path.read_text().replace("/v1beta1", "/v1alpha1"))
    assert addresses(kubevirt_metadata.read_as_kubevirt(kubevirt, base, spec)["gpus"]) == {"dra-gpu-gpu1": GPUS[1]}


def test_kubevirt_cannot_find_a_subrequest_named_in_full_in_the_v1alpha1_object(kubevirt, node, tmp_path):
    # KEP-5304 records "gpu/large"; KubeVirt 1.9 looks for the request the pod names, "gpu".
    base = hand_over(tmp_path, node, _claim("vm-gpu"), [("gpu/large", GPUS[0])])
    _rewrite(base, lambda objects: [{**o, "requests": objects[0]["requests"]} for o in objects])
    found = kubevirt_metadata.read_as_kubevirt(kubevirt, base, vmi({"gpu": {"resourceClaimName": "vm-gpu"}},
                                                                   gpus=[("gpu1", "gpu", "gpu")]))  # fmt: skip
    assert 'request "gpu" not found in metadata for claim "vm-gpu" (available requests: [gpu/large])' in found["gpus"]["error"]
