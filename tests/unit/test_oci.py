"""A pod template's container as the OCI config a runtime gives runc (e2e/oci.py), on a small template."""

from __future__ import annotations

import json

import pytest

from e2e import oci

TEMPLATE = {
    "spec": {
        "securityContext": {"runAsUser": 0},
        "containers": [{
            "name": "binder",
            "command": ["passthrough", "binder"],
            "securityContext": {"privileged": False, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"}},
            "volumeMounts": [
                {"name": "sock", "mountPath": "/run/sock"},
                {"name": "sys", "mountPath": "/host/sys", "readOnly": True, "recursiveReadOnly": "Enabled"},
                {"name": "sys-bus-pci", "mountPath": "/host/sys/bus/pci"},
                {"name": "dev-vfio", "mountPath": "/host/dev/vfio", "readOnly": True},
            ],
        }],  # fmt: skip
        "volumes": [
            {"name": "sock", "emptyDir": {"medium": "Memory"}},
            {"name": "sys", "hostPath": {"path": "/sys", "type": "Directory"}},
            {"name": "sys-bus-pci", "hostPath": {"path": "/sys/bus/pci", "type": "Directory"}},
            {"name": "dev-vfio", "hostPath": {"path": "/dev/vfio", "type": "DirectoryOrCreate"}},
        ],
    }
}


def test_a_container_path_leads_to_the_node_path_of_its_deepest_host_mount():
    assert oci.host_path(TEMPLATE, "binder", "/host/sys/bus/pci/devices/0000:01:00.0/enable") == (
        "/sys/bus/pci/devices/0000:01:00.0/enable")  # fmt: skip
    assert oci.host_path(TEMPLATE, "binder", "/host/sys/class/misc/iommu") == "/sys/class/misc/iommu"
    assert oci.host_path(TEMPLATE, "binder", "/host/dev/iommu") is None  # no mount covers it
    assert oci.host_path(TEMPLATE, "binder", "/run/sock/binder.sock") is None  # an emptyDir is no node path
    assert oci.host_path(TEMPLATE, "binder", "/host/sysfs") is None  # a prefix of a name is not a parent


def on_this_machine(tmp_path) -> dict:
    """TEMPLATE with its DirectoryOrCreate volume in `tmp_path`: a bundle creates that path."""
    template = json.loads(json.dumps(TEMPLATE))
    template["spec"]["volumes"][3]["hostPath"]["path"] = str(tmp_path / "dev-vfio")
    return template


def test_the_bundle_carries_the_containers_shape(tmp_path):
    oci.bundle(on_this_machine(tmp_path), "binder", tmp_path / "bundle", ["/bin/true"])
    config = json.loads((tmp_path / "bundle" / "config.json").read_text())
    process = config["process"]
    assert process["user"] == {"uid": 0, "gid": 0} and process["noNewPrivileges"] is True
    assert all(caps == [] for caps in process["capabilities"].values())
    assert config["root"]["readonly"] is True
    assert config["linux"]["resources"]["devices"] == [{"allow": False, "access": "rwm"}]
    assert "mount" in config["linux"]["seccomp"]["syscalls"][0]["names"]
    mounts = {m["destination"]: m for m in config["mounts"]}
    assert mounts["/host/sys"]["source"] == "/sys" and "rro" in mounts["/host/sys"]["options"]
    assert mounts["/host/dev/vfio"]["source"] == str(tmp_path / "dev-vfio") and "ro" in mounts["/host/dev/vfio"]["options"]
    assert (tmp_path / "dev-vfio").is_dir()
    assert "ro" not in mounts["/host/sys/bus/pci"]["options"] and "rro" not in mounts["/host/sys/bus/pci"]["options"]
    assert mounts["/run/sock"]["source"] == str(tmp_path / "bundle" / "volumes" / "sock")
    order = [m["destination"] for m in config["mounts"]]
    assert order.index("/host/sys") < order.index("/host/sys/bus/pci"), "a mount below another comes after it"


def test_a_container_with_capabilities_is_not_shaped(tmp_path):
    template = on_this_machine(tmp_path)
    template["spec"]["containers"][0]["securityContext"]["capabilities"] = {"add": ["SYS_ADMIN"]}
    with pytest.raises(ValueError, match="drop ALL capabilities"):
        oci.bundle(template, "binder", tmp_path, ["/bin/true"])
