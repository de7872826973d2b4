"""Installed before KubeVirt: the operator starts, assigns devices, and waits for KubeVirt."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from e2e import kubevirt, support
from e2e.cluster import REPO, LocalCluster, install_crds
from e2e.processes import OperatorProcess
from passthrough.kube.connect import connect
from passthrough.kube.custom import Custom

pytestmark = pytest.mark.cluster


async def test_the_operator_works_before_kubevirt_is_installed(cluster, tmp_path: Path):
    bare = LocalCluster(workdir=tmp_path / "cluster", bin_dir=cluster.bin_dir)
    bare.start(before_controllers=lambda c: install_crds(c, [REPO / "crds"]))  # ours only
    operator = OperatorProcess(bare, tmp_path / "operator.log")
    api = await connect(str(bare.kubeconfig))
    try:
        operator.start()
        bare.kubectl("create", "namespace", "team-a")
        node = await support.ensure_node(api, "early-node")
        name = await support.report_device(api, node, support.gpu("0000:3b:00.0"))
        bare.kubectl("patch", "npci", name, "--type=merge", "-p", json.dumps({"spec": {"assignedNamespace": "team-a"}}))
        pcidev = Custom(api, "pcidevices", namespaced=True)
        await support.wait_for(lambda: pcidev.get(name, "team-a"), what="PCIDevice without KubeVirt installed")

        bare.kubectl("apply", "-f", "-", input=json.dumps(
            {"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"}, "spec": {}}))
        configs = Custom(api, "passthroughconfigs")

        async def waiting():
            status = ((await configs.get("cluster")) or {}).get("status") or {}
            return any(c["type"] == "Applied" and c["reason"] == "WaitingForKubeVirt" for c in status.get("conditions", []))

        await support.wait_for(waiting, what="WaitingForKubeVirt")

        # KubeVirt arrives: its CRDs, then its CR. The operator picks both up as they come.
        install_crds(bare, kubevirt.write_crds(tmp_path / "kubevirt-crds"))
        bare.kubectl("create", "namespace", "kubevirt")
        bare.kubectl("apply", "-f", "-", input=json.dumps(
            {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {"name": "kubevirt", "namespace": "kubevirt"}, "spec": {}}))
        kubevirts = Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")

        async def configured():
            kv = await kubevirts.get("kubevirt", "kubevirt")
            permitted = (((kv or {}).get("spec") or {}).get("configuration") or {}).get("permittedHostDevices") or {}
            return any(e["resourceName"] == f"passthrough.io/{name}" for e in permitted.get("pciHostDevices", []))

        await support.wait_for(configured, 60, what="KubeVirt configured once it is installed")
        assert "Traceback" not in operator.output()
    finally:
        operator.stop()
        await api.close()
        bare.stop()
