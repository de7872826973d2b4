"""`passthrough uninstall`: what the chart's hooks do around `helm uninstall`.

Before Helm deletes anything (the pre-delete hook, `--give-back`; left out with the value
`uninstall.keepDevices`), the agents, still running, are asked to give back every device they
bound to vfio-pci that nothing holds: each Node with a device on vfio-pci is labelled with a token
of the request (`GIVE_BACK_LABEL`); its agent then plans as if nothing were handed out or pooled,
so its own give-back (withdrawn from the kubelet, asked who holds it, unbound only when nothing
does) returns what it bound, keeps what a VM or pod holds, and answers with the token
(`GIVEN_BACK_LABEL`) once its reports say why each device left on vfio-pci stays. The hook waits
for every answer (bounded) and lists what stays and why.

Once Helm has removed the operator and the agents (the post-delete hook), so that nothing the
operator wrote keeps working without it:

It lets go of:
- the KubeVirt CRs' allow-list entries and feature gates the operator applied (the apply that
  lets go of a CR the values no longer name, `kubevirt_sync.release`): what others wrote stays;
- the in-use finalizer on every PCIDevice and NodePCIDevice: no operator is left to take it off,
  and a namespace whose PCIDevice holds it would never finish deleting;
- the operator's DeviceClasses (DRA mode);
- the give-back request and answer labels on Nodes.

It leaves, as Helm does, the CRDs and with them every NodePCIDevice (and its assignment),
PCIDevice and PassthroughConfig: installing again picks up where it was. What is still bound to
vfio-pci stays (held at the give-back, pinned by an admin, or kept with `uninstall.keepDevices`);
the summary lists it with the way to give it back on its node. First it waits until no pod of the
operator is left (`--wait-for-pods`), so that no reconcile of it comes after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from typing import Any

from passthrough.api import views
from passthrough.api.labels import GIVE_BACK_LABEL, GIVEN_BACK_LABEL
from passthrough.api.models import NODE_PCI_DEVICE, PCI_DEVICE
from passthrough.controller import deviceclasses, kubevirt_sync
from passthrough.controller.lifecycle import device_body, own_metadata
from passthrough.controller.world import FINALIZER
from passthrough.kube.client import MERGE_PATCH, ApiError, Session
from passthrough.kube.connect import CannotStart, session
from passthrough.kube.custom import OPERATOR_MANAGER, Custom

POLL = 1.0  # seconds between looks at the operator's pods, and at the Nodes' answers
VFIO = "vfio-pci"
# A device's Ready reasons that say it is kept on vfio-pci for whoever holds it.
HELD = frozenset({"HeldByPod", "HeldByProcess", "HeldUnknown"})


async def uninstall(api: Session, say: Any = print) -> dict[str, int]:
    """Let go of what the operator wrote (see the module's docstring); returns how many of each."""
    done = {"kubevirt": await _release_kubevirts(api, say), "finalizers": await _release_finalizers(api, say),
            "deviceclasses": await _delete_device_classes(api, say), "nodes": await _release_nodes(api, say)}  # fmt: skip
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


async def give_back(api: Session, timeout: float, say: Any = print) -> dict[str, list[str]]:
    """Ask the agent of each Node with a device on vfio-pci to give back what it bound and nothing
    holds, and wait up to `timeout` seconds for their answers. Returns node -> the addresses still
    on vfio-pci there (all of them for a node whose agent did not answer)."""
    before = _on_vfio(await _items(Custom(api, NODE_PCI_DEVICE.plural)))
    if not before:
        say("No device is bound to vfio-pci: nothing to give back.")
        return {}
    token = str(time.time_ns())
    asked = []
    for node in sorted(before):
        try:
            await _label(api, node, {GIVE_BACK_LABEL: token})
        except ApiError as exc:
            if exc.status != 404:
                raise
            say(f"Node {node} is gone: its devices are not asked for")  # its devices left with it
            continue
        asked.append(node)
    say(f"Asked the agents of {len(asked)} node(s) to give back the devices they bound: {', '.join(asked)}")
    answered, down = await _answers(api, asked, token, timeout)
    after = _on_vfio(await _items(Custom(api, NODE_PCI_DEVICE.plural)))
    left: dict[str, list[str]] = {}
    for node in asked:
        was, stays = before[node], after.get(node, {})
        if node not in answered:
            left[node] = sorted(was)
            why = "is not Ready, so it was not waited for" if node in down else f"did not answer within {timeout:.0f}s"
            say(f"Node {node} {why} (is its agent running?); what its agent bound stays on vfio-pci: {', '.join(sorted(was))}")
            continue
        back = sorted(set(was) - set(stays))
        say(f"Node {node}: gave back {', '.join(back)}" if back else f"Node {node}: gave nothing back")
        for address, (reason, message) in sorted(stays.items()):
            if reason in HELD:
                why = (f"held ({reason}: {message}). Freed before Helm deletes the agent, it goes back then; else, once "
                       f"free, on the node: echo {address} > /sys/bus/pci/drivers/vfio-pci/unbind; echo > /sys/bus/pci/"
                       f"devices/{address}/driver_override; echo {address} > /sys/bus/pci/drivers_probe (or reboot it)")
            elif reason in ("", "Ready"):
                why = "not bound by the agent (an admin's pin: driverctl, vfio-pci.ids=): left as it was"
            else:
                why = f"{reason}: {message}"
            say(f"  {address} stays on vfio-pci: {why}")
        left[node] = sorted(stays)
    return left


async def _answers(api: Session, nodes: list[str], token: str, timeout: float) -> tuple[set[str], set[str]]:
    """The nodes whose agent answered `token` before `timeout` seconds pass, and those not waited
    for: not Ready (or gone), whose agent may never answer."""
    deadline, answered, down = time.monotonic() + timeout, set(), set()
    while True:
        for node in set(nodes) - answered - down:
            try:
                body = await api.request("GET", f"/api/v1/nodes/{node}")
            except ApiError as exc:
                if exc.status != 404:
                    raise
                down.add(node)
                continue
            if (body["metadata"].get("labels") or {}).get(GIVEN_BACK_LABEL) == token:
                answered.add(node)
            elif not _ready(body):
                down.add(node)
        if answered | down == set(nodes) or time.monotonic() > deadline:
            return answered, down
        await asyncio.sleep(POLL)


def _ready(node: dict[str, Any]) -> bool:
    conditions = (node.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def _on_vfio(node_devices: list[dict[str, Any]]) -> dict[str, dict[str, tuple[str, str]]]:
    """Node -> address -> its Ready reason and message, of the devices reported on vfio-pci."""
    found: dict[str, dict[str, tuple[str, str]]] = {}
    for device in node_devices:
        status = device.get("status") or {}
        attributes = status.get("attributes") or {}
        if attributes.get("driver") != VFIO or not attributes.get("nodeName"):
            continue
        ready = next((c for c in status.get("conditions") or [] if c.get("type") == "Ready"), {})
        found.setdefault(attributes["nodeName"], {})[attributes.get("pciAddress", "?")] = (
            ready.get("reason", ""), ready.get("message", ""))  # fmt: skip
    return found


async def _label(api: Session, node: str, labels: dict[str, str | None]) -> None:
    await api.request("PATCH", f"/api/v1/nodes/{node}", body={"metadata": {"labels": labels}}, content_type=MERGE_PATCH)


async def _release_nodes(api: Session, say: Any) -> int:
    """The give-back request and its answer off every Node that carries either."""
    named: set[str] = set()
    for label in (GIVE_BACK_LABEL, GIVEN_BACK_LABEL):
        nodes = await api.request("GET", "/api/v1/nodes", query={"labelSelector": label})
        named |= {n["metadata"]["name"] for n in nodes["items"]}
    for node in sorted(named):
        with contextlib.suppress(ApiError):  # a Node deleted meanwhile has no label left to take off
            await _label(api, node, {GIVE_BACK_LABEL: None, GIVEN_BACK_LABEL: None})
            say(f"Node {node}: labels {GIVE_BACK_LABEL} and {GIVEN_BACK_LABEL} removed")
    return len(named)


async def _summary(api: Session, say: Any) -> None:
    node_devices = await _items(Custom(api, NODE_PCI_DEVICE.plural))
    bound = sorted((((d.get("status") or {}).get("attributes") or {}).get("nodeName", "?"),
                    ((d.get("status") or {}).get("attributes") or {}).get("pciAddress", "?"))
                   for d in node_devices if ((d.get("status") or {}).get("attributes") or {}).get("driver") == VFIO)  # fmt: skip
    say(f"Left as Helm leaves them: the CRDs, {len(node_devices)} NodePCIDevices with their assignments, the PCIDevices "
        "and the PassthroughConfig (installing again picks up where this left off; kubectl delete crd "
        "nodepcidevices.passthrough.io pcidevices.passthrough.io passthroughconfigs.passthrough.io removes them).")
    if bound:
        say(f"Still bound to vfio-pci ({len(bound)}: held by a VM or pod at the give-back, pinned by an admin, or kept with "
            "uninstall.keepDevices). To give one back to its "
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


def api_error_text(exc: ApiError) -> str:
    """The API server's answer in full: its code, then what its Status says (`message`, and the
    `details.causes` the message leaves out), which name the object and the field at fault."""
    text = str(exc)
    try:
        status = json.loads(exc.body or "{}")
    except ValueError:
        return f"{text}: {exc.body.strip()}" if (exc.body or "").strip() else text
    if not isinstance(status, dict):
        return text
    message = str(status.get("message") or "")
    causes = ((status.get("details") or {}).get("causes") or []) if isinstance(status.get("details"), dict) else []
    extra = [f"{c.get('field')}: {c.get('message')}" if c.get("field") else str(c.get("message"))
             for c in causes if isinstance(c, dict) and c.get("message") and str(c.get("message")) not in message]  # fmt: skip
    return ": ".join([text, *([message] if message else []), *(["; ".join(extra)] if extra else [])])


def run(args: argparse.Namespace) -> int:
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> int:
    try:
        api = await session(args.kubeconfig, connections=4)
    except CannotStart as exc:
        print(f"passthrough uninstall: {exc}", file=sys.stderr)
        return 1
    try:
        if args.give_back:
            await give_back(api, args.timeout, lambda line: print(line, flush=True))
            return 0
        if args.wait_for_pods and not await wait_for_pods(api, args.namespace, args.wait_for_pods, args.timeout):
            print(f"passthrough uninstall: pods {args.wait_for_pods} of namespace {args.namespace} are still there after "
                  f"{args.timeout:.0f}s; the operator could write again after this, so nothing was changed. Delete them "
                  "(kubectl delete pods -l ...) and run it again.", file=sys.stderr)  # fmt: skip
            return 1
        await uninstall(api, lambda line: print(line, flush=True))
        return 0
    except ApiError as exc:
        print(f"passthrough uninstall: {api_error_text(exc)}. What was done before it is listed above; once that is fixed, "
              "run it again: it picks up where it stopped.", file=sys.stderr)  # fmt: skip
        return 1
    finally:
        await api.close()
