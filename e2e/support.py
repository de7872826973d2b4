"""Helpers for tests and benchmarks against the local control plane.

`report_device` writes a NodePCIDevice exactly as a node agent does (same functions, same
field manager), for tests of the operator that need many devices without sysfs trees.
`write_counts` reads the API server's own request counters, so "no write" is measured where
it matters, not inside the code under test.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from passthrough.agent import report
from passthrough.api.models import GROUP, NODE_PCI_DEVICE, VERSION
from passthrough.api.labels import NODE_LABEL
from passthrough.kube.custom import AGENT_MANAGER, Custom
from passthrough.kube.client import MERGE_PATCH, session_of
from passthrough.pci.discovery import Device

WRITE_VERBS = ("APPLY", "PATCH", "POST", "PUT", "DELETE")
# Writes that create or change, not deletions: the controller-manager empties namespaces and
# collects orphans of earlier tests in the background, and those are not ours to count.
CHANGE_VERBS = ("APPLY", "PATCH", "POST", "PUT")
_METRIC = re.compile(r'^apiserver_request_total\{([^}]*)\} (\S+)$')


async def write_counts_by_subresource(api: client.ApiClient) -> Counter:
    """Writes the API server has served so far, by (resource, subresource, verb)."""
    text = await _raw(api, "/metrics")
    counts: Counter = Counter()
    for line in text.splitlines():
        match = _METRIC.match(line)
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1))) if match else {}
        if labels.get("verb") in WRITE_VERBS:
            counts[(labels.get("resource", ""), labels.get("subresource", ""), labels["verb"])] += int(float(match.group(2)))
    return counts


async def write_counts(api: client.ApiClient) -> Counter:
    """Writes the API server has served so far, by (resource, verb)."""
    counts: Counter = Counter()
    for (resource, _, verb), n in (await write_counts_by_subresource(api)).items():
        counts[(resource, verb)] += n
    return counts


def writes_between(before: Counter, after: Counter, *resources: str, verbs: tuple[str, ...] = WRITE_VERBS) -> int:
    return sum(v - before.get(k, 0) for k, v in after.items() if (not resources or k[0] in resources) and k[1] in verbs)


def diff(before: Counter, after: Counter) -> dict:
    """The writes between two counts, by (resource, verb): for assertion messages."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


async def quiet(api: client.ApiClient, resources: tuple[str, ...], settle: float = 3, timeout: float = 60,
                verbs: tuple[str, ...] = WRITE_VERBS) -> None:  # fmt: skip
    """Wait until no write to `resources` has happened for `settle` seconds."""
    deadline = time.monotonic() + timeout
    first = last = await write_counts(api)
    calm_since = time.monotonic()
    while time.monotonic() - calm_since < settle:
        if time.monotonic() > deadline:
            seen = {k: n for k, n in diff(first, last).items() if k[0] in resources and k[1] in verbs}
            raise AssertionError(f"writes to {resources} did not stop within {timeout:.0f}s: {seen}")
        await asyncio.sleep(0.5)
        now = await write_counts(api)
        if writes_between(last, now, *resources, verbs=verbs):
            calm_since = time.monotonic()
        last = now


async def events_from(api: client.ApiClient, component: str) -> dict[str, str]:
    """The core/v1 Events `component` has posted, by uid: their resourceVersions (counting one
    up moves it). The API server's counters cannot tell whose Event a write was; the controller-
    manager posts its own about earlier tests' nodes and workloads for minutes."""
    listed = await client.CoreV1Api(api).list_event_for_all_namespaces(field_selector=f"reportingComponent={component}")
    return {event.metadata.uid: event.metadata.resource_version for event in listed.items}


async def _raw(api: client.ApiClient, path: str) -> str:
    response = await api.call_api(path, "GET", auth_settings=["BearerToken"], _preload_content=False, _return_http_data_only=True)
    return (await response.read()).decode()


async def create_namespace(api: client.ApiClient, name: str) -> str:
    await client.CoreV1Api(api).create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=name)))
    return name


async def ensure_node(api: client.ApiClient, name: str) -> report.Node:
    core = client.CoreV1Api(api)
    try:
        node = await core.read_node(name)
    except ApiException as exc:
        if exc.status != 404:
            raise
        node = await core.create_node(client.V1Node(metadata=client.V1ObjectMeta(name=name)))
    return report.Node(name=name, uid=node.metadata.uid)


async def remove_node(api: client.ApiClient, name: str) -> None:
    """A test's teardown: delete the Node and its NodePCIDevices.

    Deleting a Node no longer takes its devices with it (the operator keeps them for the grace
    period, for a node that registers again), so a test that is done with a node removes them.
    """
    with contextlib.suppress(ApiException):
        await client.CoreV1Api(api).delete_node(name)
    with contextlib.suppress(ApiException):
        await client.CustomObjectsApi(api).delete_collection_cluster_custom_object(
            GROUP, VERSION, NODE_PCI_DEVICE.plural, label_selector=f"{NODE_LABEL}={name}"
        )


def gpu(address: str, vendor: str = "10de", device: str = "2236", name: str = "GA102GL [A10]", resource: str = "nvidia.com/GA102GL_A10",
        iommu_group: int | None = None) -> Device:  # fmt: skip
    """A GPU as discovery finds it; in an IOMMU group of its own unless `iommu_group` is given."""
    bus, slot_fn = address.split(":")[1:]
    slot, fn = slot_fn.split(".")
    own_group = int(bus, 16) * 256 + int(slot, 16) * 8 + int(fn)
    return Device(
        address=address, vendor_id=vendor, device_id=device, subsystem_vendor_id="10de", subsystem_device_id="1482",
        class_code="030200", driver="vfio-pci", iommu_group=own_group if iommu_group is None else iommu_group, numa_node=0,
        vendor_name="NVIDIA Corporation", name=name, resource_name=resource, eligible=True, reason="", reported=True,
    )


async def report_device(api: client.ApiClient, node: report.Node, device: Device, missing: bool = False) -> str:
    """Write the NodePCIDevice for `device` as the node's agent would; returns its name."""
    kind = Custom(api, NODE_PCI_DEVICE.plural)
    name = report.object_name(device, node.name)
    live = await kind.get(name)
    if live is None or not report.has_identity(live, node):
        live = await kind.apply(report.identity(name, node), AGENT_MANAGER)
    assigned = (live.get("spec") or {}).get("assignedNamespace", "")
    desired = report.missing_status(live, node.name) if missing else report.present_status(device, name, node.name, assigned)
    if report.changed(desired, live):
        await kind.apply(report.status_body(name, desired, live), AGENT_MANAGER, status=True)
    return name


async def assign(api: client.ApiClient, name: str, namespace: str) -> None:
    """What an admin does: set a NodePCIDevice's spec.assignedNamespace (a merge patch)."""
    await merge_node_device(api, name, {"spec": {"assignedNamespace": namespace}})


async def merge_node_device(api: client.ApiClient, name: str, patch: dict) -> None:
    """A merge patch of a NodePCIDevice, as `kubectl patch --type=merge` sends it, by a plain
    client (the generated client's models would make a benchmark its own bottleneck)."""
    path = f"/apis/{GROUP}/{VERSION}/{NODE_PCI_DEVICE.plural}/{name}"
    await session_of(api).request("PATCH", path, body=patch, content_type=MERGE_PATCH)


def launcher_pod(name: str, resource: str) -> client.V1Pod:
    """A pod asking for one device of `resource`, as KubeVirt's virt-launcher does.

    Its env `MARK=<name>` finds its container among a fake runtime's CreateContainer records.
    No service-account token: the local control plane runs no root-CA publisher.
    """
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name),
        spec=client.V1PodSpec(
            automount_service_account_token=False,
            termination_grace_period_seconds=0,
            containers=[client.V1Container(
                name="compute", image="virt-launcher:test", env=[client.V1EnvVar(name="MARK", value=name)],
                resources=client.V1ResourceRequirements(limits={resource: "1"}),
            )],  # fmt: skip
        ),
    )


async def create_pod(api: client.ApiClient, namespace: str, body: client.V1Pod, timeout: float = 30) -> client.V1Pod:
    """Create a pod, waiting out a namespace too new to have its `default` ServiceAccount yet."""
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await core.create_namespaced_pod(namespace, body)
        except ApiException as exc:
            if "serviceaccount" not in str(exc.body).lower() or time.monotonic() > deadline:
                raise
        await asyncio.sleep(0.2)


async def delete_pod(api: client.ApiClient, namespace: str, name: str, timeout: float = 60) -> None:
    """Delete a pod at once and wait until it is gone (its devices are free again)."""
    core = client.CoreV1Api(api)
    with contextlib.suppress(ApiException):
        await core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)

    async def gone():
        try:
            await core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            return exc.status == 404
        return False

    await wait_for(gone, timeout, 0.05, what=f"pod {namespace}/{name} deleted")


# -- a node with a real kubelet: what it advertises, and what its runtime was asked to create --


async def resources(core: client.CoreV1Api, node: str, field: str = "allocatable") -> dict[str, str]:
    """The node's extended resources (names with a /), from its `allocatable` or `capacity`."""
    status = (await core.read_node(node)).status
    return {k: v for k, v in (getattr(status, field) or {}).items() if "/" in k}


async def wait_resources(core: client.CoreV1Api, node: str, expected: dict[str, str], agent: Any, field: str = "allocatable",
                         timeout: float = 30) -> None:  # fmt: skip
    """Until the node shows `expected` (a resource absent counts as "0"); `agent`'s log in the failure."""

    async def matches():
        got = await resources(core, node, field)
        return all(got.get(k, "0") == v for k, v in expected.items())

    with_log = f"{field} {expected} on {node}; agent log:\n{agent.output()[-3000:]}"
    await wait_for(matches, timeout, interval=0.2, what=with_log)


async def reported(api: client.ApiClient, node: str, addresses: Iterable[str], timeout: float = 30) -> dict[str, str]:
    """device_names, once every one of `addresses` is in it: the agent's first scan creates its
    objects one by one, so an early look sees some and not others."""
    wanted = set(addresses)

    async def complete():
        names = await device_names(api, node)
        return names if wanted <= names.keys() else None

    return await wait_for(complete, timeout, 0.2, what=f"the agent's report of {sorted(wanted)}")


async def device_names(api: client.ApiClient, node: str) -> dict[str, str]:
    """PCI address -> NodePCIDevice name, of the devices the node's agent reported."""
    items = (await Custom(api, "nodepcidevices").list(f"{NODE_LABEL}={node}"))["items"]
    # The operator's first status write (its conditions) may land before the agent's attributes.
    return {o["status"]["attributes"]["pciAddress"]: o["metadata"]["name"] for o in items
            if (o.get("status") or {}).get("attributes")}  # fmt: skip


async def created(core: client.CoreV1Api, namespace: str, kubelet: Any, pod_name: str, timeout: float = 30) -> dict:
    """The fake runtime's record of the container of pod `pod_name` (its env MARK), once created."""

    async def find():
        return next((c for c in kubelet.created_containers() if c.get("envs", {}).get("MARK") == pod_name), None)

    try:
        return await wait_for(find, timeout, interval=0.2, what=f"CreateContainer of {pod_name}")
    except AssertionError as exc:
        status = (await core.read_namespaced_pod(pod_name, namespace)).status
        events = await core.list_namespaced_event(namespace)
        said = "\n".join(f"{e.reason}: {e.message}" for e in events.items)
        raise AssertionError(f"{exc}\npod status: {status}\nevents:\n{said}\nkubelet log:\n{kubelet.kubelet_log.read_text()[-4000:]}") from None


async def wait_for(
    predicate: Callable[[], Awaitable[Any]], timeout: float = 30, interval: float = 0.1, what: str | Callable[[], str] = ""
) -> Any:
    """Poll an async predicate until it returns something truthy; raise with `what` on timeout
    (a callable is asked then, so that a log it quotes is the log at the end, not at the start)."""
    deadline = time.monotonic() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {said or predicate}")
        await asyncio.sleep(interval)


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait at most `timeout` seconds for `event`; whether it is set. (`asyncio.timeout`: on
    Python 3.11 `asyncio.wait_for` loses a cancellation that comes with the result.)"""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


# --- For the benchmarks ---------------------------------------------------------------------


def p50_p99(samples: list[float]) -> tuple[float, float]:
    cuts = statistics.quantiles(samples, n=100, method="inclusive") if len(samples) > 1 else samples * 99
    return cuts[49], cuts[98]


async def create_kubevirt(api: client.ApiClient, namespace: str, gates=("Snapshot",)) -> dict:
    """A KubeVirt CR named `kubevirt` as an install leaves it: fields of its own beside the ones we manage."""
    body = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "KubeVirt",
        "metadata": {"name": "kubevirt", "namespace": namespace},
        "spec": {
            "certificateRotateStrategy": {},
            "imagePullPolicy": "IfNotPresent",
            "workloadUpdateStrategy": {"workloadUpdateMethods": ["LiveMigrate"]},
            "configuration": {
                "developerConfiguration": {"featureGates": list(gates), "logVerbosity": {"virtLauncher": 2}},
                "network": {"defaultNetworkInterface": "bridge"},
            },
        },
    }
    return await client.CustomObjectsApi(api).create_namespaced_custom_object("kubevirt.io", "v1", namespace, "kubevirts", body)


def under_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def cannot_run(request, what: str, reason: str, once_key: str = "") -> None:
    """A part of the suite that cannot run here: a loud skip (`skip_loudly`), or a failure
    under CI=true, where `make test` must have made everything it needs."""
    import pytest

    if under_ci():
        pytest.fail(f"the {what} tests are required under CI=true, and cannot run: {reason}", pytrace=False)
    skip_loudly(request, what, reason, once_key)


def skip_loudly(request, what: str, reason: str, once_key: str = "") -> None:
    """pytest.skip, with a yellow line in the terminal saying which tests and why (once per
    session for `once_key`): a skip that hides a whole part of the suite must not pass unseen."""
    import pytest

    config = request.config
    shown = config.__dict__.setdefault("_passthrough_loud_skips", set())
    if not once_key or once_key not in shown:
        shown.add(once_key)
        reporter = config.pluginmanager.get_plugin("terminalreporter")
        capture = config.pluginmanager.get_plugin("capturemanager")
        if reporter is not None:
            with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
                reporter.ensure_newline()
                reporter.write_line(f"SKIPPING every {what} test: {reason}", yellow=True, bold=True)
    pytest.skip(f"{what} cannot run here: {reason}")
