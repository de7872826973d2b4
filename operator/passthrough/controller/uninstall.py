"""`passthrough uninstall`: what the chart's post-delete hook does once `helm uninstall` has
removed the operator and the agents, so that nothing the operator wrote keeps working without it.

It lets go of:
- the KubeVirt CRs' allow-list entries and feature gates the operator applied (the apply that
  lets go of a CR the values no longer name, `kubevirt_sync.release`): what others wrote stays;
- the in-use finalizer on every PCIDevice and NodePCIDevice: no operator is left to take it off,
  and a namespace whose PCIDevice holds it would never finish deleting;
- the operator's DeviceClasses (DRA mode).

It leaves, as Helm does, the CRDs and with them every NodePCIDevice (and its assignment),
PCIDevice and PassthroughConfig: installing again picks up where it was. Devices the agents bound
to vfio-pci stay bound (a VM may still run on one); the summary lists them with the way to give
them back on their node. First it waits until no pod of the operator is left (`--wait-for-pods`),
so that no reconcile of it comes after.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

from passthrough.api import views
from passthrough.api.models import NODE_PCI_DEVICE, PCI_DEVICE
from passthrough.controller import deviceclasses, kubevirt_sync
from passthrough.controller.lifecycle import device_body, own_metadata
from passthrough.controller.world import FINALIZER
from passthrough.kube.client import ApiError, Session
from passthrough.kube.connect import CannotStart, session
from passthrough.kube.custom import OPERATOR_MANAGER, Custom

POLL = 1.0  # seconds between looks at the operator's pods


async def uninstall(api: Session, say: Any = print) -> dict[str, int]:
    """Let go of what the operator wrote (see the module's docstring); returns how many of each."""
    done = {"kubevirt": await _release_kubevirts(api, say), "finalizers": await _release_finalizers(api, say),
            "deviceclasses": await _delete_device_classes(api, say)}  # fmt: skip
    await _summary(api, say)
    return done


async def _release_kubevirts(api: Session, say: Any) -> int:
    kubevirts = Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")
    config = await Custom(api, "passthroughconfigs").get("cluster")
    recorded = list(((config or {}).get("status") or {}).get("featureGates") or [])
    released = 0
    for live in await _items(kubevirts):
        view = kubevirt_sync.KubeVirtView.of(live)
        body = kubevirt_sync.release(view, recorded)
        if body is not None:
            await kubevirts.apply(body, OPERATOR_MANAGER)
            released += 1
            say(f"KubeVirt {view.namespace}/{view.name}: let go of the operator's allow-list entries and feature gates")
    return released


async def _release_finalizers(api: Session, say: Any) -> int:
    pcidevices, node_devices = Custom(api, PCI_DEVICE.plural, namespaced=True), Custom(api, NODE_PCI_DEVICE.plural)
    released = 0
    for raw in await _items(pcidevices):
        device = views.Device.of(raw)
        if FINALIZER in device.metadata["finalizers"]:
            await pcidevices.apply(device_body(device.name, device.namespace, own_metadata(device, []), device.uid), OPERATOR_MANAGER)
            released += 1
            say(f"PCIDevice {device.namespace}/{device.name}: finalizer {FINALIZER} removed")
    for raw in await _items(node_devices):
        meta = raw["metadata"]
        if FINALIZER in (meta.get("finalizers") or []):
            body = {"apiVersion": raw["apiVersion"], "kind": NODE_PCI_DEVICE.kind,
                    "metadata": {"name": meta["name"], "uid": meta["uid"], "finalizers": []}}  # fmt: skip
            await node_devices.apply(body, OPERATOR_MANAGER)
            released += 1
            say(f"NodePCIDevice {meta['name']}: finalizer {FINALIZER} removed")
    return released


async def _delete_device_classes(api: Session, say: Any) -> int:
    classes = Custom(api, deviceclasses.PLURAL, group="resource.k8s.io", version="v1")
    ours = f"{deviceclasses.MANAGED_BY}={OPERATOR_MANAGER},{deviceclasses.NAMESPACE_LABEL}"
    deleted = 0
    for raw in await _items(classes, ours):
        name = raw["metadata"]["name"]
        if await classes.delete(name, uid=raw["metadata"]["uid"]) == 200:
            deleted += 1
            say(f"DeviceClass {name}: deleted")
    return deleted


async def _summary(api: Session, say: Any) -> None:
    node_devices = await _items(Custom(api, NODE_PCI_DEVICE.plural))
    bound = sorted((((d.get("status") or {}).get("attributes") or {}).get("nodeName", "?"),
                    ((d.get("status") or {}).get("attributes") or {}).get("pciAddress", "?"))
                   for d in node_devices if ((d.get("status") or {}).get("attributes") or {}).get("driver") == "vfio-pci")  # fmt: skip
    say(f"Left as Helm leaves them: the CRDs, {len(node_devices)} NodePCIDevices with their assignments, the PCIDevices "
        "and the PassthroughConfig (installing again picks up where this left off; kubectl delete crd "
        "nodepcidevices.passthrough.io pcidevices.passthrough.io passthroughconfigs.passthrough.io removes them).")
    if bound:
        say(f"Bound to vfio-pci, as the agents left them ({len(bound)}): a VM may still use one. To give one back to its "
            "own driver, on its node: echo ADDRESS > /sys/bus/pci/drivers/vfio-pci/unbind; echo > "
            "/sys/bus/pci/devices/ADDRESS/driver_override; echo ADDRESS > /sys/bus/pci/drivers_probe (or reboot the node).")
        for node, address in bound:
            say(f"  {node} {address}")


async def _items(kind: Custom, label_selector: str = "") -> list[dict[str, Any]]:
    """Every object of `kind`; none when the API server does not serve it (KubeVirt or DRA absent)."""
    try:
        return (await kind.list(label_selector))["items"]
    except ApiError as exc:
        if exc.status == 404:
            return []
        raise


async def wait_for_pods(api: Session, namespace: str, selector: str, timeout: float) -> bool:
    """Whether every pod `selector` finds in `namespace` is gone before `timeout` seconds pass."""
    deadline = time.monotonic() + timeout
    while True:
        pods = await api.request("GET", f"/api/v1/namespaces/{namespace}/pods", query={"labelSelector": selector})
        if not pods["items"] or time.monotonic() > deadline:
            return not pods["items"]
        await asyncio.sleep(POLL)


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    try:
        api = await session(args.kubeconfig, connections=4)
    except CannotStart as exc:
        print(f"passthrough uninstall: {exc}", file=sys.stderr)
        return 1
    try:
        if args.wait_for_pods and not await wait_for_pods(api, args.namespace, args.wait_for_pods, args.timeout):
            print(f"passthrough uninstall: pods {args.wait_for_pods} of namespace {args.namespace} are still there after "
                  f"{args.timeout:.0f}s; the operator could write again after this, so nothing was changed. Delete them "
                  "(kubectl delete pods -l ...) and run it again.", file=sys.stderr)  # fmt: skip
            return 1
        await uninstall(api, lambda line: print(line, flush=True))
        return 0
    except ApiError as exc:
        print(f"passthrough uninstall: {exc}", file=sys.stderr)
        return 1
    finally:
        await api.close()
