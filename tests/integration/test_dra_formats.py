"""The formats of what the DRA driver leaves on a node, judged by their owners' own Go code.

A real claim is allocated by the real scheduler and prepared through the real kubelet; the CDI
device names the kubelet hands the runtime (recorded by the fake runtime) are resolved by the CDI
library's cache against the spec directory the driver wrote, and their edits applied to an OCI
spec, as containerd does (`tags.cncf.io/container-device-interface`, the release the project's
containerd pins). The metadata file that lands in the container is then decoded, each object of
its stream and the stream as a consumer reads it, by Kubernetes' `devicemetadata` package with
upstream's validation (`k8s.io/dynamic-resource-allocation`, the control plane's release).
`e2e/dra_formats/` is that program; `dra.cdi.resolve` and `dra.cdi.read_stream`, the project's own
readers, judge nothing here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import build, dra_formats, support
from e2e.support import created
from passthrough.dra.slice import DRIVER, PCI_BUS_ID
from passthrough.kube.client import session_of
from tests.integration.test_dra import (  # noqa: F401  (fixtures: the GPU node, its kubelet and the agent in DRA mode)
    GPU, GROUP, RESOURCE, agent, cdi_dir, claim, claim_pod, create_claim, create_namespace_class, delete_claim,
    gpu_host, kubelet, published, read_claim,
)  # fmt: skip

# The numbers the program's /dev gives the nodes the fake kernel has (a vfio group's major is the
# kernel's choice; the container's is whatever the host node has, which is what is checked).
VFIO_MAJOR, VFIO_MINOR, GROUP_MAJOR = 10, 196, 511
DEVICE = "pci-0000-af-00-0"


@pytest.fixture(scope="module")
def owners(request) -> Path:
    """The built program; a loud skip where Go or the module proxy is missing (a failure under CI)."""
    try:
        return dra_formats.PROGRAM.ensure_binary()
    except build.BuildError as exc:
        support.cannot_run(request, "DRA-formats", str(exc), once_key="dra-formats")


def dev_nodes(host) -> dict[str, tuple[int, int]]:
    """The node's /dev/vfio as the fake kernel has it now: the container node, and a node per
    IOMMU group that is on vfio-pci."""
    nodes = {}
    for entry in sorted((host.root / "dev" / "vfio").iterdir()):
        if entry.name == "vfio":
            nodes["/dev/vfio/vfio"] = (VFIO_MAJOR, VFIO_MINOR)
        elif entry.name.isdigit():
            nodes[f"/dev/vfio/{entry.name}"] = (GROUP_MAJOR, int(entry.name))
    return nodes


@pytest.mark.cluster
async def test_a_prepared_claims_cdi_specs_and_metadata_file_are_read_by_the_cdi_library_and_kubernetes_decoder(
    api, kubelet, agent, gpu_host, owners, namespace, unique
):
    host, _ = gpu_host
    session = session_of(api)
    names = await support.reported(api, kubelet.node_name, (GPU,))
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {DEVICE: namespace})
    device_class = f"passthrough-formats-{unique}"
    await create_namespace_class(api, device_class, namespace)
    try:
        await create_claim(api, namespace, claim("vm-gpu", device_class))
        await support.create_pod(api, namespace, claim_pod("formats-launcher", "vm-gpu"))
        container = await created(client.CoreV1Api(api), namespace, kubelet, "formats-launcher", timeout=60)
        allocated = await read_claim(api, namespace, "vm-gpu")
        uid = allocated["metadata"]["uid"]

        # The CDI library loads every spec in the directory (one it refuses is reported, not
        # skipped), resolves the names the kubelet passed and edits an OCI spec with them.
        found = dra_formats.read(owners, cdi_dir(kubelet), container["cdi_devices"], dev_nodes=dev_nodes(host))["cdi"]
        assert found["specErrors"] == {} and "error" not in found, json.dumps(found, indent=1)
        assert found["unresolved"] == []
        assert sorted(found["devices"]) == sorted([f"passthrough.io/vfio={uid}-{DEVICE}", f"{DRIVER}/metadata={uid}_gpu"])
        devices = [(d["path"], d["type"], d["major"], d["minor"]) for d in found["linux"]["devices"]]
        assert devices == [("/dev/vfio/vfio", "c", VFIO_MAJOR, VFIO_MINOR), (f"/dev/vfio/{GROUP}", "c", GROUP_MAJOR, GROUP)]
        allowed = [(r["allow"], r["type"], r["major"], r["minor"], r["access"]) for r in found["linux"]["resources"]["devices"]]
        assert allowed == [(True, "c", VFIO_MAJOR, VFIO_MINOR, "rw"), (True, "c", GROUP_MAJOR, GROUP, "rw")]
        [mount] = found["mounts"]
        assert mount["destination"] == f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/vm-gpu/gpu/{DRIVER}-metadata.json"
        assert sorted(mount["options"]) == ["bind", "ro"]

        # The file that mount puts in the container, read by Kubernetes' decoder.
        [metadata] = dra_formats.read(owners, cdi_dir(kubelet), [], [Path(mount["source"])])["metadata"]
        assert "error" not in metadata, metadata
        versions = [o["apiVersion"] for o in metadata["objects"]]
        assert versions == ["metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"]
        for obj in metadata["objects"]:
            assert "error" not in obj and "invalid" not in obj, obj
        assert metadata["readAs"] == "metadata.resource.k8s.io/v1beta1"  # newest first, as a consumer reads it
        read = metadata["read"]
        assert (read["namespace"], read["name"], read["uid"]) == (namespace, "vm-gpu", uid)
        assert read["PodClaimName"] is None  # a claim the pod names, not one made from a template
        [request] = read["Requests"]
        [device] = request["Devices"]
        assert (request["Name"], device["Driver"], device["Pool"], device["Name"]) == ("gpu", DRIVER, kubelet.node_name, DEVICE)
        assert device["Attributes"][PCI_BUS_ID] == {"string": GPU}
        assert device["Attributes"]["passthrough.io/iommuGroup"] == {"int": GROUP}
        # Every version decodes to the same claim.
        assert all(obj["decoded"] == read for obj in metadata["objects"])
    finally:
        await support.delete_pod(api, namespace, "formats-launcher")
        await delete_claim(session, namespace, "vm-gpu")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
    await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


def test_the_owners_readers_refuse_what_their_formats_do_not_allow(owners, tmp_path):
    """The program reports what the libraries refuse, so the test above can fail: a CDI spec
    with a device name CDI does not allow, an unresolvable name, and a metadata object whose
    attribute has no value."""
    specs = tmp_path / "cdi"
    specs.mkdir()
    (specs / "bad.json").write_text(json.dumps({"cdiVersion": "0.6.0", "kind": "passthrough.io/vfio", "devices": [
        {"name": "no spaces allowed", "containerEdits": {"deviceNodes": [{"path": "/dev/vfio/vfio"}]}}]}))  # fmt: skip
    found = dra_formats.read(owners, specs, ["passthrough.io/vfio=missing"], dev_nodes={})["cdi"]
    assert list(found["specErrors"]) == [str(specs / "bad.json")], found
    assert found["unresolved"] == ["passthrough.io/vfio=missing"] and "unresolvable" in found["error"]

    stream = tmp_path / "metadata.json"
    stream.write_text(json.dumps({
        "apiVersion": "metadata.resource.k8s.io/v1beta1", "kind": "DeviceMetadata",
        "metadata": {"name": "c", "namespace": "n", "uid": "u", "generation": 1},
        "requests": [{"name": "gpu", "devices": [{"driver": DRIVER, "pool": "p", "name": "d",
                                                  "attributes": {PCI_BUS_ID: {}}}]}],
    }))  # fmt: skip
    [metadata] = dra_formats.read(owners, specs, [], [stream])["metadata"]
    [obj] = metadata["objects"]
    assert PCI_BUS_ID in obj.get("invalid", ""), obj
