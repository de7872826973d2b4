"""When the KubeVirt sync runs: only for a change it reads, and seldom enough when it is costly."""

from __future__ import annotations

import dataclasses

import pytest

from passthrough.api.conditions import Cond
from passthrough.controller.kubevirt_sync import (
    advertised,
    assigned_devices,
    device_sync_inputs,
    next_sync_delay,
    node_device_sync_inputs,
)
from passthrough.api.views import Device, NodeDevice

READY = Cond("True", "Ready", "ok", "2026-01-01T00:00:00Z")
NPCI = NodeDevice(name="pci-a", uid="u1", resource_version="1", assigned_namespace="", deleting=False, finalizers=(),
                  ready=READY, assigned=None, attached=None,
                  attributes={"pciAddress": "0000:3b:00.0", "vendorID": "10de", "deviceID": "2236", "nodeName": "n1"},
                  node_name="n1", resource_name="nvidia.com/A10", mode="Pool")
DEVICE = Device(name="pci-a", namespace="team-a", uid="d1", resource_version="2", deleting=False,
                metadata={"labels": {}, "ownerReferences": [{"controller": True, "kind": "NodePCIDevice", "uid": "u1"}],
                          "finalizers": []},
                status={})


def test_our_own_conditions_and_versions_do_not_start_a_sync():
    busy = Cond("True", "Assigned", "Assigned to namespace team-a", "2026-01-01T00:00:00Z")
    for changed in (dataclasses.replace(NPCI, resource_version="9", assigned=busy, attached=busy, finalizers=("x",),
                                        assigned_namespace="team-a", missing_since="2026-01-01T00:00:00Z"),):
        assert node_device_sync_inputs(changed) == node_device_sync_inputs(NPCI)
        # ...and indeed the sync's inputs are the same.
        assert advertised([changed]) == advertised([NPCI])
        assert assigned_devices([DEVICE], {"pci-a": changed}) == assigned_devices([DEVICE], {"pci-a": NPCI})
    status_written = dataclasses.replace(DEVICE, resource_version="3", status={"conditions": []})
    assert device_sync_inputs(status_written) == device_sync_inputs(DEVICE)


def test_what_the_sync_reads_starts_one():
    not_ready = dataclasses.replace(NPCI, ready=Cond("False", "NotReady", "busy"))
    for changed in (not_ready, dataclasses.replace(NPCI, mode="Exclusive"), dataclasses.replace(NPCI, deleting=True),
                    dataclasses.replace(NPCI, uid="u2"), dataclasses.replace(NPCI, attributes={**NPCI.attributes, "deviceID": "1"})):
        assert node_device_sync_inputs(changed) != node_device_sync_inputs(NPCI)
    assert node_device_sync_inputs(None) != node_device_sync_inputs(NPCI)  # came or went
    adopted = dataclasses.replace(DEVICE, metadata={**DEVICE.metadata, "ownerReferences": []})
    assert device_sync_inputs(adopted) != device_sync_inputs(DEVICE) and device_sync_inputs(None) != device_sync_inputs(DEVICE)


def test_a_costly_sync_waits_long_enough_to_keep_to_a_fifth_of_the_time():
    assert next_sync_delay(0.0) == 0.2  # cheap: changes within 0.2s fold into one
    assert next_sync_delay(0.01) == 0.2
    delay = next_sync_delay(0.5)  # 5,000 allow-list entries
    assert 0.5 / (0.5 + delay) == pytest.approx(0.2)
