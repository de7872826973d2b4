"""`helm uninstall` gives back what the agents bound, never what a pod holds, and nothing with
`uninstall.keepDevices`.

The chart's pre-delete hook (`passthrough uninstall --give-back`) runs as its own account and
command line as the chart renders them, against the real control plane, while the agent (its own
process over a fixture GPU node with its simulated kernel) serves the real kubelet (fake CRI
runtime), which says through PodResources which pod holds which device.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from pathlib import Path

import pytest
from kubernetes_asyncio import client

from e2e import chart, identities, support
from e2e.processes import AgentProcess
from e2e.support import created, wait_resources
from passthrough.api.labels import GIVE_BACK_LABEL, GIVEN_BACK_LABEL
from passthrough.pci.naming import exclusive_resource_name, resource_env_name
from tests.integration.test_handover_order import gpu_host, kubelet  # noqa: F401 (fixtures: a GPU node in GPU mode)

pytestmark = pytest.mark.cluster
REPO = Path(__file__).resolve().parents[2]
PCI_IDS = REPO / "e2e/data/pci.ids.2025-07-11"
POOL = "nvidia.com/GA102GL_A10"
# Two A10s, each in an IOMMU group with its audio function: group 20 and group 21.
GROUPS = {"0000:3b:00.0": "0000:3b:00.1", "0000:af:00.0": "0000:af:00.1"}
DEFAULT = {"0000:3b:00.0": "nvidia", "0000:3b:00.1": "snd_hda_intel", "0000:af:00.0": "nvidia", "0000:af:00.1": "snd_hda_intel"}


@pytest.fixture(scope="module")
def agent(cluster, kubelet, gpu_host, tmp_path_factory):
    proc = AgentProcess(cluster, tmp_path_factory.mktemp("agent") / "agent.log", kubelet.node_name, gpu_host, PCI_IDS,
                        kubelet=kubelet).start()  # fmt: skip
    yield proc
    code = proc.stop()
    assert code == 0 and "Traceback" not in proc.output(), proc.output()[-5000:]


def hook_objects(helm, namespace: str, *flags: str) -> list[dict]:
    return chart.template(helm, "passthrough", namespace, *flags)


def run(command: list[str], kubeconfig) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "passthrough", *command[1:], f"--kubeconfig={kubeconfig}"],
                          capture_output=True, text=True, timeout=180)  # fmt: skip


def drivers(host) -> dict[str, str]:
    return {address: host.driver(address) for address in DEFAULT}


async def node_labels(core, node: str) -> dict[str, str]:
    return (await core.read_node(node)).metadata.labels or {}


async def test_with_keep_devices_nothing_asks_the_agents_and_every_bound_device_stays(
    api, cluster, helm, kubelet, agent, gpu_host, namespace
):  # fmt: skip
    core = client.CoreV1Api(api)
    await support.reported(api, kubelet.node_name, DEFAULT)
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
    assert set(drivers(gpu_host).values()) == {"vfio-pci"}
    kept = hook_objects(helm, namespace, "--set=uninstall.keepDevices=true")
    assert not [o for o in kept if (o["metadata"].get("annotations") or {}).get("helm.sh/hook") == "pre-delete"]
    [post] = [o for o in kept if o["kind"] == "Job"]
    assert post["metadata"]["annotations"]["helm.sh/hook"] == "post-delete"
    # Where the agents bind nothing at all, nothing asks them either; in DRA mode their driver
    # answers (test_uninstall_give_back_dra).
    assert [o["kind"] for o in hook_objects(helm, namespace, "--set=agent.devicePlugin.enabled=false") if o["kind"] == "Job"] == ["Job"]
    assert len([o for o in hook_objects(helm, namespace, "--set=agent.devicePlugin.dra=true") if o["kind"] == "Job"]) == 2
    # The post-delete hook, once the agents are gone, lists each device it leaves bound.
    done = run(post["spec"]["template"]["spec"]["containers"][0]["command"], cluster.kubeconfig)
    assert done.returncode == 0, done.stderr
    for address in DEFAULT:
        assert f"  {kubelet.node_name} {address}" in done.stdout, done.stdout
    assert set(drivers(gpu_host).values()) == {"vfio-pci"}
    assert GIVE_BACK_LABEL not in await node_labels(core, kubelet.node_name)


async def test_the_pre_delete_hook_has_the_agent_give_back_all_it_bound_but_a_device_a_pod_holds(
    api, cluster, helm, kubelet, agent, gpu_host, namespace, operator, tmp_path
):  # fmt: skip
    core = client.CoreV1Api(api)
    await support.reported(api, kubelet.node_name, DEFAULT)
    await wait_resources(core, kubelet.node_name, {POOL: "2"}, agent)
    # A VM's launcher pod holds one GPU of the pool; the other is assigned to the namespace, handed
    # out and served as its own resource, and nothing holds it.
    pod = support.launcher_pod(f"vm-{namespace}", POOL)
    pod.spec.node_name = kubelet.node_name
    await support.create_pod(api, namespace, pod)
    held = (await created(core, namespace, kubelet, pod.metadata.name))["envs"][resource_env_name(POOL)]
    free = next(a for a in GROUPS if a != held)
    assigned = (await support.device_names(api, kubelet.node_name))[free]
    await support.assign(api, assigned, namespace)
    await wait_resources(core, kubelet.node_name, {exclusive_resource_name(assigned): "1", POOL: "1"}, agent)

    objects = hook_objects(helm, namespace, "--show-only=templates/give-back-hook.yaml")
    [job] = [o for o in objects if o["kind"] == "Job"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "pre-delete"
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["passthrough", "uninstall", "--give-back"], command
    with chart.installed(cluster, [o for o in objects if o["kind"] != "Job"]):
        account = identities.identity(cluster, namespace, job["spec"]["template"]["spec"]["serviceAccountName"], tmp_path)
        done = run(command, account.kubeconfig)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\nagent log:\n{agent.output()[-3000:]}"

    # What nothing holds is back on its own driver; the held group stays, and the log says who holds it.
    now = drivers(gpu_host)
    assert now[free] == DEFAULT[free] and now[GROUPS[free]] == DEFAULT[GROUPS[free]], now
    assert now[held] == "vfio-pci" and now[GROUPS[held]] == "vfio-pci", now
    assert f"Node {kubelet.node_name}: gave back {', '.join(sorted([free, GROUPS[free]]))}" in done.stdout, done.stdout
    stays = [line for line in done.stdout.splitlines() if line.startswith(f"  {held} stays on vfio-pci: held (HeldByPod")]
    assert stays and pod.metadata.name in stays[0], done.stdout
    labels = await node_labels(core, kubelet.node_name)
    assert labels[GIVEN_BACK_LABEL] == labels[GIVE_BACK_LABEL], labels
    # Nothing is served from then on: no pod gets a device while Helm deletes the agents.
    await wait_resources(core, kubelet.node_name, {POOL: "0", exclusive_resource_name(assigned): "0"}, agent)

    # The pod ends: the agent, still running, gives its group back too.
    await core.delete_namespaced_pod(pod.metadata.name, namespace, grace_period_seconds=0)
    await support.wait_for(lambda: _on_defaults(gpu_host), 30, 0.2,
                           what=lambda: f"every device given back; agent log:\n{agent.output()[-3000:]}")  # fmt: skip

    # The post-delete hook takes the request and the answer off the Node.
    after = run(["passthrough", "uninstall"], cluster.kubeconfig)
    assert after.returncode == 0 and f"Node {kubelet.node_name}: labels" in after.stdout, after
    labels = await node_labels(core, kubelet.node_name)
    assert GIVE_BACK_LABEL not in labels and GIVEN_BACK_LABEL not in labels, labels
    with contextlib.suppress(client.exceptions.ApiException):
        await core.delete_namespace(namespace)


async def _on_defaults(host) -> bool:
    return drivers(host) == DEFAULT
