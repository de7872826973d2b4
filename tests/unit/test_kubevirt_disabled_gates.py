"""A gate the KubeVirt CR disables while the values enable it: reported, never written.

KubeVirt's update validator refuses a CR that names a gate in both `featureGates` and
`disabledFeatureGates` (Cozystack's kubevirt chart refuses to render one), so an apply that
wrote it would fail, and so would every later one.
"""

from __future__ import annotations

import dataclasses
import datetime

from passthrough.controller.kubevirt_sync import ConfigView, KubeVirtView, plan_sync
from passthrough.kubevirt.render import GATES_ANNOTATION, render
from passthrough.kubevirt.values import parse_values

NOW = datetime.datetime(2026, 12, 5, 12, 0, tzinfo=datetime.UTC)


def live_kubevirt(gates=(), disabled=()) -> KubeVirtView:
    developer = {"featureGates": list(gates), "disabledFeatureGates": list(disabled)}
    return KubeVirtView.of({"metadata": {"name": "kubevirt", "namespace": "kubevirt"},
                            "spec": {"configuration": {"developerConfiguration": developer}}})  # fmt: skip


def test_the_view_reads_the_disabled_gates():
    assert live_kubevirt(disabled=["Snapshot"]).disabled_gates == ("Snapshot",)
    assert live_kubevirt().disabled_gates == ()


def test_a_disabled_extra_gate_is_left_out_and_a_warning_says_where():
    spec = parse_values({"kubevirt": {"extraFeatureGates": ["Snapshot", "VMExport"]}})
    rendered = render(spec, live_gates=["CPUManager"], disabled_gates=["Snapshot"])
    assert rendered.feature_gates == ["HostDevices", "VMExport", "CPUManager"]
    assert rendered.our_feature_gates == ["HostDevices", "VMExport"]
    assert rendered.patch["metadata"]["annotations"][GATES_ANNOTATION] == "HostDevices,VMExport"
    [warning] = [w for w in rendered.warnings if "Snapshot" in w]
    assert "kubevirt.extraFeatureGates" in warning and "kubevirt/kubevirt disables it" in warning
    assert "disabledFeatureGates" in warning


def test_without_a_conflict_nothing_changes():
    spec = parse_values({"kubevirt": {"extraFeatureGates": ["Snapshot"]}})
    assert render(spec, disabled_gates=["VMExport"]) == render(spec)


def test_hostdevices_disabled_says_vms_will_not_start():
    rendered = render(parse_values({}), disabled_gates=["HostDevices"])
    assert "HostDevices" not in rendered.feature_gates
    [warning] = rendered.warnings[-1:]
    assert "HostDevices" in warning and "will not start" in warning


def test_the_sync_never_writes_a_disabled_gate_and_the_status_says_so():
    config = ConfigView("cluster", "uid", 1, {"kubevirt": {"extraFeatureGates": ["Snapshot"]}}, {})
    plan = plan_sync(config, live_kubevirt(gates=["CPUManager"], disabled=["Snapshot"]), [], [], None, NOW)
    written = plan.apply["spec"]["configuration"]["developerConfiguration"]["featureGates"]
    assert "Snapshot" not in written and written == ["HostDevices", "CPUManager"]
    status = plan.status["status"]
    assert status["featureGates"] == ["HostDevices"]
    assert any("Snapshot" in w and "disables it" in w for w in status["warnings"])


def test_a_gate_we_wrote_before_the_cr_disabled_it_is_taken_out():
    config = ConfigView("cluster", "uid", 1, {"kubevirt": {"extraFeatureGates": ["Snapshot"]}}, {})
    live = dataclasses.replace(live_kubevirt(gates=["HostDevices", "Snapshot"], disabled=["Snapshot"]),
                               our_gates=("HostDevices", "Snapshot"))  # fmt: skip
    plan = plan_sync(config, live, [], [], None, NOW)
    assert plan.apply["spec"]["configuration"]["developerConfiguration"]["featureGates"] == ["HostDevices"]
