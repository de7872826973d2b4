"""Keeping the KubeVirt CR in line with the PassthroughConfig, as a pure plan.

`plan_sync` takes the config, the live KubeVirt CR, the assigned devices and what the nodes
advertise, and returns at most one apply for the CR, at most one status for the config, and
the Events worth telling. It writes nothing when the CR already says what we would write.
Bad values keep the last good configuration; an assigned device whose own entry cannot be
written is only left out (status.leftOut, condition AssignedDevicesPermitted, its Assigned).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from passthrough.api.models import API_VERSION, CONFIG_NAME, PASSTHROUGH_CONFIG
from passthrough.api.conditions import Cond, condition
from passthrough.api.views import Device, NodeDevice, expected_name
from passthrough.kube.custom import OPERATOR_MANAGER
from passthrough.pci.naming import exclusive_resource_name
from passthrough.kubevirt.allowlist import AssignedDevice
from passthrough.kubevirt.mismatches import Advertised, Mismatch, mismatches, split_default_models
from passthrough.kubevirt.render import GATES_ANNOTATION, Rendered, render
from passthrough.kubevirt.values import ValuesError, parse_values

# status lists are capped so that a config of thousands of entries keeps a readable status
MAX_LISTED = 50


@dataclass(frozen=True)
class ConfigView:
    name: str
    uid: str
    generation: int
    spec: Mapping[str, Any]
    status: Mapping[str, Any]
    resource_version: str = ""

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> ConfigView:
        meta = body["metadata"]
        return cls(meta["name"], meta.get("uid", ""), int(meta.get("generation") or 0), dict(body.get("spec") or {}),
                   dict(body.get("status") or {}), meta.get("resourceVersion", ""))


@dataclass(frozen=True)
class KubeVirtView:
    namespace: str
    name: str
    uid: str
    pci_host_devices: tuple[Mapping[str, Any], ...] | None
    mediated_devices: tuple[Mapping[str, Any], ...] | None
    feature_gates: tuple[str, ...]
    owned: frozenset[str]  # which of our three lists our field manager owns
    resource_version: str = ""
    our_gates: tuple[str, ...] | None = None  # the gates we applied (our annotation), None without one of ours
    disabled_gates: tuple[str, ...] = ()  # developerConfiguration.disabledFeatureGates: never ours to write
    mediated_devices_configuration: Mapping[str, Any] | None = None  # spec.configuration.mediatedDevicesConfiguration

    @classmethod
    def of(cls, body: Mapping[str, Any]) -> KubeVirtView:
        meta = body["metadata"]
        owned = owned_by_us(meta.get("managedFields") or [])
        configuration = ((body.get("spec") or {}).get("configuration")) or {}
        permitted = configuration.get("permittedHostDevices") or {}
        developer = configuration.get("developerConfiguration") or {}
        gates = developer.get("featureGates") or []
        pci = permitted.get("pciHostDevices")
        mdev = permitted.get("mediatedDevices")
        return cls(
            namespace=meta.get("namespace", ""),
            name=meta["name"],
            uid=meta.get("uid", ""),
            pci_host_devices=tuple(dict(e) for e in pci) if pci is not None else None,
            mediated_devices=tuple(dict(e) for e in mdev) if mdev is not None else None,
            feature_gates=tuple(gates),
            owned=owned,
            resource_version=meta.get("resourceVersion", ""),
            our_gates=_our_gates((meta.get("annotations") or {}).get(GATES_ANNOTATION)) if GATES_ANNOTATION in owned else None,
            disabled_gates=tuple(developer.get("disabledFeatureGates") or []),
            mediated_devices_configuration=configuration.get("mediatedDevicesConfiguration"),
        )


def _our_gates(recorded: str | None) -> tuple[str, ...] | None:
    if recorded is None:
        return None
    return tuple(g for g in recorded.split(",") if g)


def owned_by_us(managed_fields: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """What our field manager's applies own of a KubeVirt CR, from its managedFields: of our
    three lists, the ones it owns ("pciHostDevices", "mediatedDevices", "featureGates"),
    "mediatedDevicesConfiguration" when it is ours, and GATES_ANNOTATION when the annotation
    that records our gates is ours."""
    owned = set()
    for entry in managed_fields:
        if entry.get("manager") != OPERATOR_MANAGER or entry.get("operation") != "Apply":
            continue
        fields = entry.get("fieldsV1") or {}
        configuration = (fields.get("f:spec") or {}).get("f:configuration") or {}
        permitted = configuration.get("f:permittedHostDevices") or {}
        owned |= {key[2:] for key in permitted if key in ("f:pciHostDevices", "f:mediatedDevices")}
        if "f:featureGates" in (configuration.get("f:developerConfiguration") or {}):
            owned.add("featureGates")
        if "f:mediatedDevicesConfiguration" in configuration:
            owned.add("mediatedDevicesConfiguration")
        if f"f:{GATES_ANNOTATION}" in ((fields.get("f:metadata") or {}).get("f:annotations") or {}):
            owned.add(GATES_ANNOTATION)
    return frozenset(owned)


def release(kubevirt: KubeVirtView, recorded_gates: Sequence[str] = ()) -> dict[str, Any] | None:
    """The apply that lets go of a KubeVirt CR the values no longer name (spec.kubevirt points
    elsewhere), None when there is nothing of ours left on it.

    Our allow-lists and our annotation go. The feature gates list is atomic: what stays of it is
    the live gates less ours (the annotation's, or `recorded_gates` for a CR written before the
    annotation), still under our manager (letting go of it would remove the whole list); with
    none left, an empty list: where spec.configuration holds nothing of anyone else's (an install
    that ships `configuration: {}`, or KubeVirt's release CR), letting go of every field in it
    leaves the API server writing `configuration: null`, which KubeVirt's schema refuses (422)."""
    ours = kubevirt.our_gates if kubevirt.our_gates is not None else tuple(recorded_gates)
    lists = kubevirt.owned - {"featureGates", GATES_ANNOTATION}
    others = [g for g in kubevirt.feature_gates if g not in ours]
    gates_left = "featureGates" in kubevirt.owned and list(kubevirt.feature_gates) != others
    if not lists and GATES_ANNOTATION not in kubevirt.owned and not gates_left:
        return None
    body: dict[str, Any] = {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt",
                            "metadata": {"name": kubevirt.name, "namespace": kubevirt.namespace}}  # fmt: skip
    if "featureGates" in kubevirt.owned:
        body["spec"] = {"configuration": {"developerConfiguration": {"featureGates": others}}}
    return body


def assigned_devices(devices: Iterable[Device], node_devices: Mapping[str, NodeDevice]) -> list[AssignedDevice]:
    """The devices that get an exclusive allow-list entry: the PCIDevices the operator made.

    A PCIDevice counts only while its controller owner is the live NodePCIDevice of the same
    name (by uid), and its IDs are that NodePCIDevice's, as its node's agent reported them:
    a PCIDevice someone else wrote adds no entry and, whatever its status says, cannot make
    the render invalid. A device in two namespaces at once (reassigned while a VM still
    holds it) is one entry. Sorted by name.
    """
    found: dict[str, AssignedDevice] = {}
    for device in devices:
        owner = node_devices.get(device.name)
        if owner is None or device.name in found:
            continue
        if not any(o.get("controller") and o.get("kind") == "NodePCIDevice" and o.get("uid") == owner.uid
                   for o in device.metadata.get("ownerReferences", [])):  # fmt: skip
            continue
        vendor, product = owner.attributes.get("vendorID"), owner.attributes.get("deviceID")
        if vendor and product:
            found[device.name] = AssignedDevice(device.name, vendor, product)
    return [found[name] for name in sorted(found)]


def advertised(node_devices: Iterable[NodeDevice]) -> list[Advertised]:
    """The pool resources the nodes really advertise: pooled GPUs that are Ready.

    A GPU that is not eligible, could not be bound or is gone from its node is served by no
    device plugin, so it cannot stand for its name in the mismatch report; nor can an object
    whose name is not the one its attributes give (written by hand, or by an agent that took a
    name another node's device will get: the operator flags it and hands it to no one).
    """
    return [
        Advertised(d.node_name, d.attributes.get("pciAddress", ""), d.attributes.get("vendorID", ""),
                   d.attributes.get("deviceID", ""), d.resource_name)
        for d in node_devices
        if d.mode == "Pool" and d.resource_name and not d.deleting and d.ready is not None and d.ready.status == "True"
        and expected_name(d) == d.name
    ]


def on_device_plugin_nodes(
    assigned: Sequence[AssignedDevice], advertised: Sequence[Advertised], node_devices: Mapping[str, NodeDevice],
    through_dra: Callable[[str], bool],
) -> tuple[list[AssignedDevice], list[Advertised]]:
    """Where nodes choose their mode: the assigned devices and pool GPUs of the nodes that serve
    device plugins (`through_dra(node)` false). Only they need an allow-list entry and only they
    advertise resources; a DRA node's devices are claimed, and KubeVirt takes a claim unlisted."""
    kept = [d for d in assigned if d.name in node_devices and not through_dra(node_devices[d.name].node_name)]
    return kept, [a for a in advertised if not through_dra(a.node)]


def served_by_kubevirt(config: ConfigView | None, rendered: Rendered | None) -> dict[str, str]:
    """The models KubeVirt's own device plugin serves, to VMs of any namespace: "vvvv:dddd" ->
    resource name, of the allow-list entries with externalResourceProvider false (those of the
    rendered allow-list KubeVirt has; before the first render, those of the values)."""
    if config is None:
        return {}
    if rendered is not None:
        entries: Iterable[Any] = rendered.pci_host_devices
    else:
        entries = ((config.spec.get("gpu") or {}).get("permittedHostDevices") or {}).get("pciHostDevices") or []
    return {str(e.get("pciVendorSelector")).lower(): str(e.get("resourceName") or "") for e in entries
            if isinstance(e, Mapping) and e.get("externalResourceProvider") is False}  # fmt: skip


def next_sync_delay(last_cost: float, least: float = 0.2, share: float = 0.2) -> float:
    """Seconds from a change to the sync it starts. Changes within it fold into one sync; and
    one that took `last_cost` seconds of the event loop (5,000 assigned devices: half a second
    to render on two cores) waits long enough to keep syncs to `share` of the operator's time."""
    return max(least, last_cost * (1 - share) / share)


def node_device_sync_inputs(d: NodeDevice | None) -> tuple | None:
    """All that `assigned_devices` and `advertised` read of a NodePCIDevice: a change that
    leaves this as it was (a condition of ours written, say) cannot change the sync's plan."""
    if d is None:
        return None
    ready = d.ready.status if d.ready is not None else None
    attrs = d.attributes
    return (d.uid, d.node_name, d.mode, d.resource_name, d.deleting, ready,
            attrs.get("pciAddress"), attrs.get("vendorID"), attrs.get("deviceID"))


def device_sync_inputs(d: Device | None) -> tuple | None:
    """All that `assigned_devices` reads of a PCIDevice (its status is not trusted there)."""
    if d is None:
        return None
    return d.namespace, tuple((o.get("controller"), o.get("kind"), o.get("uid")) for o in d.metadata.get("ownerReferences", []))


def kubevirt_target(spec: Mapping[str, Any]) -> tuple[str, str]:
    """(namespace, name) of the KubeVirt CR the values name, defaults filled in."""
    target = spec.get("kubevirt") or {}
    return target.get("namespace") or "kubevirt", target.get("name") or "kubevirt"


@dataclass
class SyncPlan:
    apply: dict[str, Any] | None = None  # KubeVirt CR apply body
    remove_block: str = ""  # another manager's permittedHostDevices to remove ("1 pciHostDevices"), "" for none
    status: dict[str, Any] | None = None  # PassthroughConfig status apply body
    events: list[tuple[str, str, str]] = field(default_factory=list)  # (type, reason, message)
    rendered: Rendered | None = None  # the configuration now good (to keep when later values are bad)
    problems: list[str] = field(default_factory=list)  # why the values are invalid; [] when valid
    unapplied: dict[str, str] = field(default_factory=dict)  # assigned device -> why KubeVirt lacks its entry
    left_out: dict[str, str] = field(default_factory=dict)  # assigned devices the render leaves out alone (the rest applied)
    not_permitted: int = 0  # GPUs nodes advertise that the allow-list lacks
    not_advertised: int = 0  # allow-listed names no node advertises


def needs_apply(rendered: Rendered, live: KubeVirtView) -> bool:
    """Whether applying `rendered` would change the CR (hand edits of our fields included)."""
    for key, want, have in (
        ("pciHostDevices", rendered.pci_host_devices, live.pci_host_devices),
        ("mediatedDevices", rendered.mediated_devices, live.mediated_devices),
        ("featureGates", rendered.feature_gates, live.feature_gates),
    ):
        if want or key == "featureGates":  # the apply always holds the gates list, empty or not
            if [dict(e) if isinstance(e, Mapping) else e for e in (have or ())] != list(want):
                return True
        elif key in live.owned:  # we wrote it once and must now let go of it
            return True
    if rendered.mediated_devices_configuration:
        if live.mediated_devices_configuration != rendered.mediated_devices_configuration:
            return True
    elif "mediatedDevicesConfiguration" in live.owned:  # we wrote it once and must now let go of it
        return True
    return live.our_gates != tuple(rendered.our_feature_gates)  # the record of our gates, missing or edited


def _block_of_another_manager(kubevirt: KubeVirtView | None) -> str:
    """What is left of KubeVirt's permittedHostDevices once our apply without it lands: the lists
    another field manager owns ("3 pciHostDevices, ..."), or "" when there are none."""
    if kubevirt is None:
        return ""
    left = [f"{len(entries)} {key}" for key, entries in (("pciHostDevices", kubevirt.pci_host_devices),
                                                         ("mediatedDevices", kubevirt.mediated_devices))
            if entries and key not in kubevirt.owned]  # fmt: skip
    return ", ".join(left)


def _listed(items: list[Mismatch]) -> list[dict[str, str]]:
    return [
        {k: v for k, v in {"resourceName": m.resource_name, "pciVendorSelector": m.selector, "nodeName": m.node,
                           "pciAddress": m.pci_address, "expected": m.expected}.items() if v}
        for m in items[:MAX_LISTED]
    ]


def plan_sync(
    config: ConfigView | None,
    kubevirt: KubeVirtView | None,
    assigned: Sequence[AssignedDevice],
    advertised: Sequence[Advertised],
    last_good: Rendered | None,
    now: datetime.datetime,
) -> SyncPlan:
    """The steps: render the values (or keep the last good render), what KubeVirt lacks of the
    assigned devices, what to write to the CR, the four conditions, and the config's status."""
    plan = SyncPlan()
    if config is None:
        return plan  # without the platform values, KubeVirt is not ours to manage
    target = "/".join(kubevirt_target(config.spec))
    previous_gates = _previous_gates(config, kubevirt)
    rendered = _render(plan, config, kubevirt, assigned, last_good, previous_gates)
    _unapplied(plan, config, kubevirt, assigned, rendered)
    pci = rendered.pci_host_devices if rendered else []
    not_advertised, not_permitted = mismatches(pci, advertised)
    not_advertised, unused_default_models = split_default_models(not_advertised)
    plan.not_permitted, plan.not_advertised = len(not_permitted), len(not_advertised)
    conditions = {
        "Valid": _valid(plan.problems, last_good),
        "Applied": _applied(plan, kubevirt, rendered, target),
        **({"AssignedDevicesPermitted": _permitted(plan.left_out)} if rendered is not None else {}),
        "NodesMatchAllowList": _allow_list(plan, kubevirt, rendered, not_permitted, target),
    }
    old = {c.get("type"): Cond.of(c) for c in config.status.get("conditions") or []}
    for type_, cond in conditions.items():
        if not cond.same(old.get(type_)) and cond.status == "False" and type_ != "Applied":
            plan.events.append(("Warning", cond.reason, cond.message))
    status = {
        "observedGeneration": config.generation,
        "conditions": [condition(t, c, old.get(t), now) for t, c in conditions.items()],
        "featureGates": list(rendered.our_feature_gates) if rendered and not plan.problems else previous_gates,
        "pciHostDevices": len(pci),
        "mediatedDevices": len(rendered.mediated_devices) if rendered else 0,
        "warnings": list(rendered.warnings if rendered else []),
        "notAdvertised": _listed(not_advertised),
        "notAdvertisedCount": len(not_advertised),
        "unusedDefaultModels": unused_default_models,
        "notPermitted": _listed(not_permitted),
        "notPermittedCount": len(not_permitted),
        "leftOut": [{"name": name, "reason": why} for name, why in list(plan.left_out.items())[:MAX_LISTED]],
        "leftOutCount": len(plan.left_out),
    }
    if _status_differs(config.status, status):
        plan.status = {"apiVersion": API_VERSION, "kind": PASSTHROUGH_CONFIG.kind, "metadata": {"name": CONFIG_NAME},
                       "status": status}
    return plan


def _previous_gates(config: ConfigView, kubevirt: KubeVirtView | None) -> list[str]:
    """The gates we applied last: the CR's own record, written in the same apply as the gates;
    the config's status only for a CR written before that record existed."""
    if kubevirt is not None and kubevirt.our_gates is not None:
        return list(kubevirt.our_gates)
    return list(config.status.get("featureGates") or [])


def _render(plan: SyncPlan, config: ConfigView, kubevirt: KubeVirtView | None, assigned: Sequence[AssignedDevice],
            last_good: Rendered | None, previous_gates: list[str]) -> Rendered | None:
    """The values rendered (plan.rendered), or, when they are invalid, the last good render
    (plan.problems say why): a bad edit tears nothing down."""
    live_gates = list(kubevirt.feature_gates) if kubevirt else []
    disabled = list(kubevirt.disabled_gates) if kubevirt else []
    try:
        plan.rendered = render(parse_values(config.spec), assigned, live_gates=live_gates, previous_gates=previous_gates,
                               disabled_gates=disabled)  # fmt: skip
        return plan.rendered
    except ValuesError as exc:
        plan.problems = exc.problems
        return last_good


def _unapplied(plan: SyncPlan, config: ConfigView, kubevirt: KubeVirtView | None, assigned: Sequence[AssignedDevice],
               rendered: Rendered | None) -> None:
    """The assigned devices KubeVirt lacks an entry for, and why: those the render left out
    alone (the rest of the allow-list goes on), and with invalid values those assigned since
    the last good configuration (with DRA, none needs one)."""
    names = {d.name for d in assigned}
    plan.left_out = {name: why for name, why in (rendered.left_out if rendered else {}).items() if name in names}
    plan.unapplied = dict(plan.left_out)
    dra_values = config.spec.get("dra")
    # Every node in DRA mode: no device needs an entry. Where nodes choose, those of device-plugin nodes do.
    dra = isinstance(dra_values, Mapping) and dra_values.get("enabled") is True and dra_values.get("perNode") is not True
    if plan.problems and kubevirt is not None and not dra:
        have = {e.get("resourceName") for e in (rendered.pci_host_devices if rendered else [])}
        why = f"the PassthroughConfig is invalid ({'; '.join(plan.problems)})"
        plan.unapplied = {d.name: plan.left_out.get(d.name, why) for d in assigned if exclusive_resource_name(d.name) not in have}


def _valid(problems: list[str], last_good: Rendered | None) -> Cond:
    if not problems:
        return Cond("True", "Valid", "The values are valid.")
    kept = " The last good configuration stays applied." if last_good else " Nothing was applied."
    return Cond("False", "InvalidValues", "; ".join(problems) + kept)


def _applied(plan: SyncPlan, kubevirt: KubeVirtView | None, rendered: Rendered | None, target: str) -> Cond:
    """The Applied condition; and the CR apply (plan.apply, with its Event) when the CR lacks
    what `rendered` says."""
    if kubevirt is None:
        return Cond("False", "WaitingForKubeVirt",
                    f"Waiting for KubeVirt {target}: it is applied as soon as that KubeVirt CR exists "
                    "(or set spec.kubevirt.name and namespace to the CR KubeVirt runs with).")
    if rendered is None:
        return Cond("False", "InvalidValues", f"Nothing applied to KubeVirt {target}: fix the values.")
    if needs_apply(rendered, kubevirt):
        plan.apply = rendered.patch
        plan.events.append(("Normal", "Applied", f"Applied permittedHostDevices and feature gates to KubeVirt {target}."))
    summary = (f"{len(rendered.pci_host_devices)} pciHostDevices, {len(rendered.mediated_devices)} mediatedDevices, "
               f"feature gates {', '.join(rendered.feature_gates)}")
    if plan.problems:
        return Cond("True", "LastGoodApplied", f"KubeVirt {target} keeps the last good configuration: {summary}.")
    return Cond("True", "Applied", f"KubeVirt {target} has {summary}.")


def _permitted(left_out: Mapping[str, str]) -> Cond:
    if not left_out:
        return Cond("True", "AllPermitted", "Every assigned device has its passthrough.io/ entry in the allow-list.")
    (name, why), *others = left_out.items()
    also = f"; also {', '.join(n for n, _ in others[:3])}{' ...' if len(others) > 3 else ''}" if others else ""
    return Cond("False", "DevicesLeftOut",
                f"{len(left_out)} assigned device(s) left out of KubeVirt's allow-list (the rest of it is applied), and VMs "
                f"asking for them will not start. {name}: {why}{also}. See status.leftOut.")


def _allow_list(plan: SyncPlan, kubevirt: KubeVirtView | None, rendered: Rendered | None,
                not_permitted: list[Mismatch], target: str) -> Cond:
    """The NodesMatchAllowList condition; and, when the values' allow-list is empty, the removal
    of a block another field manager wrote (plan.remove_block, with its Event)."""
    pci = rendered.pci_host_devices if rendered else []
    theirs = _block_of_another_manager(kubevirt) if rendered is not None and not pci and not rendered.mediated_devices else ""
    if theirs and plan.problems:
        # Invalid values tear nothing down, a block someone else wrote included.
        return Cond("False", "AllowListNotOurs",
                    f"KubeVirt {target} has a permittedHostDevices block another field manager wrote ({theirs}), and KubeVirt "
                    "checks device names against it; it stays while the values are invalid, and goes once valid values render "
                    "an empty allow-list.")
    if theirs:
        # The allow-list is the values' (DESIGN: an empty result removes the block): a hand edit of
        # it is reverted like any other, by removing what another field manager added.
        plan.remove_block = theirs
        plan.events.append(("Warning", "AllowListRemoved",
                            f"Removed the permittedHostDevices block another field manager wrote to KubeVirt {target} ({theirs}): "
                            "the values' allow-list is empty, so KubeVirt now checks no device names at all. List devices in "
                            "gpu.permittedHostDevices to permit them; a block written by hand or by GitOps is removed again."))  # fmt: skip
        return Cond("False", "NoAllowList",
                    f"permittedHostDevices is empty, so KubeVirt checks no device names at all (a block another field manager "
                    f"wrote, {theirs}, was removed: the allow-list is the values').")
    if rendered is not None and not pci:
        return Cond("False", "NoAllowList", "permittedHostDevices is empty, so KubeVirt checks no device names at all.")
    if not_permitted:
        first = "; ".join(m.message for m in not_permitted[:3])
        return Cond("False", "NotPermitted",
                    f"{len(not_permitted)} GPU(s) advertised by nodes are not in the allow-list, and VMs asking for them will "
                    f"not start: {first}{' ...' if len(not_permitted) > 3 else ''}. See status.notPermitted.")
    return Cond("True", "Match", "Every GPU the nodes advertise is allow-listed.")


def _status_differs(live: Mapping[str, Any], wanted: Mapping[str, Any]) -> bool:
    for key, value in wanted.items():
        if key == "conditions":
            have = {c.get("type"): Cond.of(c) for c in live.get("conditions") or []}
            if any(not Cond.of(c).same(have.get(c["type"])) for c in value):
                return True
        elif live.get(key) != value and not (value in ([], 0) and key not in live):
            return True
    return False
