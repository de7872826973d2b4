"""`helm uninstall` in DRA mode: the pre-delete hook's give-back is carried out by the agent's DRA
driver (it offers nothing more and gives back the groups it bound that no prepared claim holds)
and answered on the Node, as in device-plugin mode, instead of waiting out the hook's timeout.

The hook runs as its own account and command line as the chart renders them; the agent runs
`--dra` over a fixture GPU node with its simulated kernel beside the real kubelet and scheduler.
"""

from __future__ import annotations

import pytest
from kubernetes_asyncio import client

from e2e import chart, identities, support
from passthrough.api.labels import GIVE_BACK_LABEL, GIVEN_BACK_LABEL
from passthrough.kube.client import session_of
from tests.integration.test_dra import (  # noqa: F401 (fixtures: a DRA agent over a GPU node)
    AUDIO, GPU, RESOURCE, agent, claim_files, claimed_pod, create_namespace_class, delete_claim, gpu_host, kubelet,
    published,
)
from tests.integration.test_uninstall_give_back import hook_objects, node_labels, run

pytestmark = pytest.mark.cluster


async def test_the_pre_delete_hook_has_the_dra_driver_give_back_what_it_bound_and_the_agent_answer(
    api, cluster, helm, kubelet, agent, gpu_host, namespace, unique, tmp_path
):  # fmt: skip
    host, _ = gpu_host
    session, core = session_of(api), client.CoreV1Api(api)
    names = await support.reported(api, kubelet.node_name, (GPU, AUDIO))
    default = {GPU: host.driver(GPU), AUDIO: host.driver(AUDIO)}
    await support.assign(api, names[GPU], namespace)
    await published(api, kubelet, agent, {"pci-0000-af-00-0": namespace})
    device_class = f"passthrough-{unique}"
    await create_namespace_class(api, device_class, namespace)
    try:
        # A VM ran with the GPU and ended: its group stays on vfio-pci while the GPU is handed out.
        uid = await claimed_pod(api, kubelet, namespace, device_class, "vm-gpu")
        await support.delete_pod(api, namespace, "vm-gpu-launcher")
        await support.wait_for(lambda: _true(not claim_files(kubelet, uid)), 30, 0.2, what="the claim unprepared")
        assert (host.driver(GPU), host.driver(AUDIO)) == ("vfio-pci", "vfio-pci")

        objects = hook_objects(helm, namespace, "--set=agent.devicePlugin.dra=true", "--show-only=templates/give-back-hook.yaml")
        [job] = [o for o in objects if o["kind"] == "Job"]
        command = job["spec"]["template"]["spec"]["containers"][0]["command"]
        with chart.installed(cluster, [o for o in objects if o["kind"] != "Job"]):
            account = identities.identity(cluster, namespace, job["spec"]["template"]["spec"]["serviceAccountName"], tmp_path)
            done = run(command, account.kubeconfig)
        assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\nagent log:\n{agent.output()[-3000:]}"
        assert f"Node {kubelet.node_name}: gave back {GPU}, {AUDIO}" in done.stdout, f"{done.stdout}\n{agent.output()[-3000:]}"
        assert {GPU: host.driver(GPU), AUDIO: host.driver(AUDIO)} == default
        labels = await node_labels(core, kubelet.node_name)
        assert labels[GIVEN_BACK_LABEL] == labels[GIVE_BACK_LABEL], labels
        await published(api, kubelet, agent, {})  # nothing offered while Helm deletes the agents
    finally:
        cluster.kubectl("label", "node", kubelet.node_name, f"{GIVE_BACK_LABEL}-", f"{GIVEN_BACK_LABEL}-", check=False)
        await delete_claim(session, namespace, "vm-gpu")
        await session.request("DELETE", f"{RESOURCE}/deviceclasses/{device_class}")
        await support.assign(api, names[GPU], "")
    await published(api, kubelet, agent, {})


async def _true(value: bool) -> bool:
    return value
