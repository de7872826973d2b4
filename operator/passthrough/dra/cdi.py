"""What a prepared claim hands its containers, as files the container runtime reads: a CDI spec
with the vfio device nodes, and the KEP-5304 device-metadata file (mounted through a second CDI
spec) from which KubeVirt's virt-launcher reads the PCI address. Pure functions building the
documents, and the paths they go to; `driver` writes them.

The metadata file is a JSON stream, the same object once per API version, newest first, as
k8s.io/dynamic-resource-allocation's kubeletplugin writes it (`metadataWriter`): Kubernetes 1.37
reads `metadata.resource.k8s.io/v1beta1`, KubeVirt 1.9 only `v1alpha1`; a stream decoder takes the
first version it knows. One difference, for KubeVirt: a subrequest's device is recorded under
`gpu/large` (KEP-5304) in v1beta1 but under its request `gpu` in v1alpha1, because KubeVirt 1.9's
virt-launcher looks the request up by the name the VMI and its pod give, which is never a
subrequest's (tests/integration/test_kubevirt_metadata.py runs KubeVirt's code on our files).
Host path `<plugin dir>/dra-device-metadata/<ns>_<claim>/<request>/metadata.json`,
container path `/var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim>/<request>/<driver>-metadata.json`
(`resourceclaimtemplates/<pod claim name>/...` for a claim made from a template).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# 0.5.0: device names may start with a digit (a claim's uid may); every runtime with DRA support reads it.
CDI_VERSION = "0.5.0"
VFIO_KIND = "passthrough.io/vfio"
METADATA_VERSIONS = ("metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1")
# The versions in which a subrequest's device is recorded under its request: KubeVirt 1.9, which
# reads only v1alpha1, looks a request up by the name the pod gives it, never a subrequest's.
BASE_REQUEST_VERSIONS = frozenset({"metadata.resource.k8s.io/v1alpha1"})
CONTAINER_METADATA_DIR = "/var/run/kubernetes.io/dra-device-attributes"
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"  # on a claim made from a pod's template
VFIO_DIR = "/dev/vfio"


@dataclass(frozen=True)
class PreparedDevice:
    """One allocated device of a claim, as the driver prepares it."""

    request: str  # the claim's request it was allocated for (a subrequest's "<request>/<sub>" kept)
    pool: str
    name: str  # its name in the ResourceSlice
    address: str
    iommu_group: int
    attributes: Mapping[str, Any]  # as in the slice (resource.kubernetes.io/pciBusID, ...)
    cdev: str = ""  # its iommufd node (`vfio3`) when the kernel has one and /dev/iommu exists


def base_request(request: str) -> str:
    """The top-level request of a subrequest reference (`gpu/large` -> `gpu`), as file paths use."""
    return request.split("/", 1)[0]


def vfio_device_name(claim_uid: str, device: str) -> str:
    return f"{claim_uid}-{device}"


def vfio_spec(claim_uid: str, devices: Iterable[PreparedDevice]) -> dict[str, Any]:
    """One CDI device per allocated device: the vfio container node and its group's (and its
    iommufd nodes where the kernel has them: KubeVirt's IOMMUFD gate)."""
    entries = []
    for device in devices:
        nodes = [f"{VFIO_DIR}/vfio", f"{VFIO_DIR}/{device.iommu_group}"]
        if device.cdev:
            nodes += [f"{VFIO_DIR}/devices/{device.cdev}", "/dev/iommu"]
        entries.append({
            "name": vfio_device_name(claim_uid, device.name),
            "containerEdits": {"deviceNodes": [{"path": path, "type": "c", "permissions": "rw"} for path in nodes]},
        })  # fmt: skip
    return {"cdiVersion": CDI_VERSION, "kind": VFIO_KIND, "devices": entries}


def metadata_kind(driver: str) -> str:
    return f"{driver}/metadata"


def metadata_device_name(claim_uid: str, request: str) -> str:
    return f"{claim_uid}_{base_request(request)}"


def metadata_host_path(plugin_dir: Path, namespace: str, claim: str, request: str) -> Path:
    return Path(plugin_dir) / "dra-device-metadata" / f"{namespace}_{claim}" / base_request(request) / "metadata.json"


def metadata_container_path(driver: str, claim: str, request: str, pod_claim_name: str = "") -> str:
    if pod_claim_name:
        return f"{CONTAINER_METADATA_DIR}/resourceclaimtemplates/{pod_claim_name}/{base_request(request)}/{driver}-metadata.json"
    return f"{CONTAINER_METADATA_DIR}/resourceclaims/{claim}/{base_request(request)}/{driver}-metadata.json"


def metadata_spec(driver: str, claim_uid: str, request: str, host_path: Path, container_path: str) -> dict[str, Any]:
    return {
        "cdiVersion": CDI_VERSION,
        "kind": metadata_kind(driver),
        "devices": [{
            "name": metadata_device_name(claim_uid, request),
            "containerEdits": {"mounts": [{"hostPath": str(host_path), "containerPath": container_path,
                                           "options": ["ro", "bind"]}]},
        }],
    }  # fmt: skip


def metadata_stream(
    driver: str, claim: Mapping[str, Any], request: str, devices: Iterable[PreparedDevice], generation: int = 1
) -> str:
    """The metadata file: one DeviceMetadata object per version in METADATA_VERSIONS, one per line
    (a subrequest named in full, or by its request in BASE_REQUEST_VERSIONS)."""
    meta = claim.get("metadata") or {}
    pod_claim = (meta.get("annotations") or {}).get(POD_CLAIM_ANNOTATION)
    body: dict[str, Any] = {
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid"),
                     "generation": generation},
    }  # fmt: skip
    if pod_claim:
        body["podClaimName"] = pod_claim
    entries = [{"driver": driver, "pool": d.pool, "name": d.name, "attributes": dict(d.attributes)} for d in devices]

    def document(version: str) -> str:
        name = base_request(request) if version in BASE_REQUEST_VERSIONS else request
        return json.dumps({"kind": "DeviceMetadata", "apiVersion": version, **body,
                           "requests": [{"name": name, "devices": entries}]}, indent=2) + "\n"  # fmt: skip

    return "".join(document(version) for version in METADATA_VERSIONS)


def read_stream(text: str) -> list[dict[str, Any]]:
    """The objects of a metadata stream, in order (what a consumer's stream decoder walks)."""
    decoder, objects, index = json.JSONDecoder(), [], 0
    while text[index:].strip():
        index += len(text[index:]) - len(text[index:].lstrip())
        obj, index = decoder.raw_decode(text, index)
        objects.append(obj)
    return objects


def cdi_ids(claim_uid: str, driver: str, devices: Iterable[PreparedDevice]) -> dict[str, list[str]]:
    """Device name -> the CDI IDs the kubelet passes to the runtime for it: its vfio device, and
    on the first device of each request the metadata mount (once per request suffices)."""
    ids: dict[str, list[str]] = {}
    seen: set[str] = set()
    for device in devices:
        found = ids.setdefault(device.name, [f"{VFIO_KIND}={vfio_device_name(claim_uid, device.name)}"])
        request = base_request(device.request)
        if request not in seen:
            seen.add(request)
            found.append(f"{metadata_kind(driver)}={metadata_device_name(claim_uid, request)}")
    return ids


def vfio_spec_file(cdi_dir: Path, claim_uid: str) -> Path:
    return Path(cdi_dir) / f"passthrough.io-vfio_{claim_uid}.json"


def metadata_spec_file(cdi_dir: Path, driver: str, claim_uid: str, request: str) -> Path:
    return Path(cdi_dir) / f"{driver}_metadata_{claim_uid}_{base_request(request)}.json"


def resolve(cdi_dir: Path, names: Iterable[str]) -> dict[str, Any]:
    """What a CDI-enabled runtime would do with the CDI device names of one container: the device
    nodes, mounts and env its specs in `cdi_dir` add. Raises KeyError for a name no spec defines
    (a runtime fails the container). For tests and `passthrough` tooling; the runtime does it for real."""
    known: dict[str, dict[str, Any]] = {}
    for path in sorted(Path(cdi_dir).glob("*.json")):
        spec = json.loads(path.read_text())
        for device in spec.get("devices") or []:
            known[f"{spec['kind']}={device['name']}"] = device.get("containerEdits") or {}
    edits: dict[str, Any] = {"deviceNodes": [], "mounts": [], "env": []}
    for name in names:
        if name not in known:
            raise KeyError(f"unresolvable CDI device {name!r}: no spec in {cdi_dir} defines it")
        for key in edits:
            edits[key] += [e for e in known[name].get(key) or [] if e not in edits[key]]
    return edits
