"""What must hold after any fault: every assignment handed out once, nothing anywhere else.

`check` reads the cluster as it is and returns every violation as a sentence (empty: it
holds); `converge` polls it until it holds. The test says what it expects with an
`Expected` snapshot: which NodePCIDevice is assigned to which namespace, and which of those
assignments are kept without being handed out (their namespace was deleted, or the device
has been gone from its node longer than the grace period).

The rules, all read from the objects themselves:
- every assigned, Ready NodePCIDevice (namespace Active, not deleting, `Assigned=True`) has
  exactly one PCIDevice in its namespace, whose controller owner is that NodePCIDevice (uid);
- no PCIDevice anywhere else: each has a live controller owner, and sits in the namespace its
  owner is assigned to, unless it is Terminating and held by the VM finalizer of a VM that
  still lists it;
- no assignment lost: the snapshot's assignments are what the objects say, each one not
  withheld is handed out (`Assigned=True` and its PCIDevice), no withheld one is, and nothing
  is assigned that the snapshot does not list;
- the KubeVirt CR the PassthroughConfig names allows exactly the handed-out devices' exclusive
  resources (`passthrough.io/<name>`, the operator's entries), once each, with
  `externalResourceProvider: true` and the device's own IDs.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from passthrough.api.models import CONFIG_NAME
from passthrough.controller.world import FINALIZER
from passthrough.kube.custom import Custom
from passthrough.kube.client import ApiError
from passthrough.pci.naming import EXCLUSIVE_DOMAIN, exclusive_resource_name

EXCLUSIVE_PREFIX = EXCLUSIVE_DOMAIN + "/"
# What a read during a fault can raise: the server gone, a connection dropped mid-answer, a timeout.
UNREACHABLE = (aiohttp.ClientError, OSError, asyncio.TimeoutError)


@dataclass
class Expected:
    """The test's own record of what the admin asked for."""

    assignments: dict[str, str] = field(default_factory=dict)  # NodePCIDevice name -> assigned namespace
    withheld: set[str] = field(default_factory=set)  # of those, kept in spec but not handed out

    def handed_out(self) -> dict[str, str]:
        return {name: ns for name, ns in self.assignments.items() if name not in self.withheld}


def kubevirt_target(config_spec: dict[str, Any]) -> tuple[str, str]:
    """(namespace, name) of the KubeVirt CR the values name, as documented: kubevirt/kubevirt by default.

    Read here rather than from the operator's code, so the checker does not share its bugs.
    """
    target = config_spec.get("kubevirt") or {}
    return target.get("namespace") or "kubevirt", target.get("name") or "kubevirt"


def listed_resources(vm: dict[str, Any]) -> set[str]:
    """The resource names a VirtualMachine's spec lists: hostDevices[] and gpus[] by deviceName."""
    devices = ((((vm.get("spec") or {}).get("template") or {}).get("spec") or {}).get("domain") or {}).get("devices") or {}
    return {d.get("deviceName", "") for key in ("hostDevices", "gpus") for d in devices.get(key) or [] if isinstance(d, dict)}


def _conditions(obj: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}


def is_true(obj: dict[str, Any], type_: str) -> bool:
    return _conditions(obj).get(type_, {}).get("status") == "True"


def _controller_uid(obj: dict[str, Any]) -> str:
    return next((o.get("uid", "") for o in obj["metadata"].get("ownerReferences") or [] if o.get("controller")), "")


async def _world(api: client.ApiClient) -> dict[str, Any]:
    npci = Custom(api, "nodepcidevices")
    pcidev = Custom(api, "pcidevices", namespaced=True)
    vms = Custom(api, "virtualmachines", namespaced=True, group="kubevirt.io", version="v1")
    configs = Custom(api, "passthroughconfigs")
    nodes, devices, vm_list, namespaces, config = await asyncio.gather(
        npci.list(), pcidev.list(), vms.list(), client.CoreV1Api(api).list_namespace(), configs.get(CONFIG_NAME)
    )
    kubevirt = None
    if config is not None:
        namespace, name = kubevirt_target(config.get("spec") or {})
        kubevirt = await Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1").get(name, namespace)
    return {
        "nodes": {o["metadata"]["name"]: o for o in nodes["items"]},
        "devices": devices["items"],
        "vms": vm_list["items"],
        "namespaces": {n.metadata.name: n.status.phase for n in namespaces.items},
        "config": config,
        "kubevirt": kubevirt,
    }


async def check(api: client.ApiClient, expected: Expected) -> list[str]:
    """Every violation of the invariant, one sentence each; [] when it holds."""
    try:
        world = await _world(api)
    except (ApiException, ApiError, *UNREACHABLE) as exc:
        return [f"cannot read the cluster: {type(exc).__name__}: {exc}".strip()]
    return violations(world, expected)


def violations(world: dict[str, Any], expected: Expected) -> list[str]:
    nodes: dict[str, dict] = world["nodes"]
    namespaces: dict[str, str] = world["namespaces"]
    found: list[str] = []
    by_name: dict[str, list[dict]] = defaultdict(list)
    for device in world["devices"]:
        by_name[device["metadata"]["name"]].append(device)
    # (namespace, resource) -> VMs whose spec lists it
    listed: dict[tuple[str, str], list[str]] = defaultdict(list)
    for vm in world["vms"]:
        for resource in listed_resources(vm):
            listed[(vm["metadata"]["namespace"], resource)].append(vm["metadata"]["name"])

    # 1. An assigned, Ready device has exactly one PCIDevice in its namespace, owned by it.
    for name, node in sorted(nodes.items()):
        target = (node.get("spec") or {}).get("assignedNamespace") or ""
        if not target or namespaces.get(target) != "Active" or node["metadata"].get("deletionTimestamp"):
            continue
        if not (is_true(node, "Ready") and is_true(node, "Assigned")):
            continue
        there = [d for d in by_name.get(name, []) if d["metadata"]["namespace"] == target]
        owned = [d for d in there if _controller_uid(d) == node["metadata"]["uid"]]
        if len(there) != 1 or len(owned) != 1:
            found.append(f"NodePCIDevice {name} is assigned to {target}, Ready and Assigned=True, but {target} holds "
                         f"{len(there)} PCIDevice(s) of that name, {len(owned)} owned by it (want exactly one)")  # fmt: skip

    # 2. No PCIDevice anywhere else.
    for device in world["devices"]:
        meta = device["metadata"]
        where = f"PCIDevice {meta['namespace']}/{meta['name']}"
        owner_uid = _controller_uid(device)
        owner = next((n for n in nodes.values() if owner_uid and n["metadata"]["uid"] == owner_uid), None)
        if owner is None:
            found.append(f"{where} has no live owner NodePCIDevice (controller uid {owner_uid or 'none'})")
            continue
        if owner["metadata"]["name"] != meta["name"]:
            found.append(f"{where} is owned by NodePCIDevice {owner['metadata']['name']}, not the one of its name")
        target = (owner.get("spec") or {}).get("assignedNamespace") or ""
        if meta["namespace"] == target:
            continue
        holders = listed.get((meta["namespace"], exclusive_resource_name(meta["name"])), [])
        if not meta.get("deletionTimestamp") or FINALIZER not in (meta.get("finalizers") or []):
            found.append(f"{where} is outside its owner's namespace ({target or 'unassigned'}) and is not Terminating "
                         "under the VM finalizer")  # fmt: skip
        elif not holders:
            found.append(f"{where} is Terminating, held by {FINALIZER}, but no VirtualMachine of {meta['namespace']} lists it")

    # 3. No assignment lost, none made up.
    for name, namespace in sorted(expected.assignments.items()):
        node = nodes.get(name)
        if node is None:
            found.append(f"assignment lost: NodePCIDevice {name} (assigned to {namespace}) is gone")
            continue
        have = (node.get("spec") or {}).get("assignedNamespace") or ""
        if have != namespace:
            found.append(f"assignment lost: NodePCIDevice {name} says assignedNamespace {have or '(none)'}, expected {namespace}")
            continue
        live = [d for d in by_name.get(name, []) if d["metadata"]["namespace"] == namespace and not d["metadata"].get("deletionTimestamp")]
        assigned = _conditions(node).get("Assigned", {})
        if name in expected.withheld:
            if live or assigned.get("status") == "True":
                found.append(f"NodePCIDevice {name} should keep its assignment to {namespace} without handing it out, but "
                             f"Assigned={assigned.get('status')}/{assigned.get('reason')} and {len(live)} live PCIDevice(s) there")  # fmt: skip
        elif assigned.get("status") != "True" or len(live) != 1:
            found.append(f"NodePCIDevice {name} should be handed out to {namespace}, but Assigned={assigned.get('status')}/"
                         f"{assigned.get('reason')} ({assigned.get('message', '')!r}) and {len(live)} live PCIDevice(s) there")  # fmt: skip
    for name, node in sorted(nodes.items()):
        have = (node.get("spec") or {}).get("assignedNamespace") or ""
        if have and name not in expected.assignments:
            found.append(f"NodePCIDevice {name} is assigned to {have}, which the test never asked for (or took back)")

    # 4. KubeVirt allows exactly the handed-out devices.
    if world["config"] is not None:
        found += _kubevirt_violations(world, expected)
    return found


def _kubevirt_violations(world: dict[str, Any], expected: Expected) -> list[str]:
    namespace, name = kubevirt_target((world["config"] or {}).get("spec") or {})
    kubevirt = world["kubevirt"]
    if kubevirt is None:
        return [f"KubeVirt {namespace}/{name} named by the PassthroughConfig does not exist"]
    configuration = (kubevirt.get("spec") or {}).get("configuration") or {}
    entries = (configuration.get("permittedHostDevices") or {}).get("pciHostDevices") or []
    ours = [e for e in entries if str(e.get("resourceName", "")).startswith(EXCLUSIVE_PREFIX)]
    found = []
    counts = Counter(e["resourceName"] for e in ours)
    found += [f"KubeVirt lists {resource} {n} times" for resource, n in sorted(counts.items()) if n > 1]
    want = {exclusive_resource_name(device): device for device in expected.handed_out()}
    have = set(counts)
    found += [f"KubeVirt lacks {resource} (handed out to {expected.assignments[want[resource]]})" for resource in sorted(set(want) - have)]
    found += [f"KubeVirt still lists {resource}, which is not handed out" for resource in sorted(have - set(want))]
    for entry in ours:
        resource = entry["resourceName"]
        if entry.get("externalResourceProvider") is not True:
            found.append(f"KubeVirt entry {resource} has externalResourceProvider {entry.get('externalResourceProvider')!r}, not true")
        attributes = ((world["nodes"].get(resource[len(EXCLUSIVE_PREFIX):]) or {}).get("status") or {}).get("attributes") or {}
        ids = f"{attributes.get('vendorID', '')}:{attributes.get('deviceID', '')}"
        if resource in want and str(entry.get("pciVendorSelector", "")).lower() != ids.lower():
            found.append(f"KubeVirt entry {resource} selects {entry.get('pciVendorSelector')}, the device is {ids}")
    return found


class NotConverged(AssertionError):
    def __init__(self, timeout: float, violations: list[str]) -> None:
        self.violations = violations
        shown = "\n  ".join(violations[:20]) + (f"\n  ... and {len(violations) - 20} more" if len(violations) > 20 else "")
        super().__init__(f"the invariant did not hold within {timeout:.0f}s ({len(violations)} violations):\n  {shown}")


async def converge(api: client.ApiClient, expected: Expected, timeout: float = 30, interval: float = 0.25, settle: float = 0) -> float:
    """Poll until the invariant holds, and has held for `settle` s (a late garbage collection, a
    grace period running out, must not hide behind an early look); the seconds until it began to
    hold. NotConverged (an AssertionError) with the violations if it does not begin within `timeout`."""
    started = time.monotonic()
    holding_since: float | None = None
    while True:
        found = await check(api, expected)
        now = time.monotonic()
        if found:
            holding_since = None
            if now - started > timeout:
                raise NotConverged(timeout, found)
        else:
            holding_since = holding_since or now
            if now - holding_since >= settle:
                return holding_since - started
        await asyncio.sleep(interval)
