"""Which groups a node binds to vfio-pci, which it gives back, and what its plugins serve."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from e2e import fakesysfs
from passthrough.agent import plan
from passthrough.agent.report import object_name
from passthrough.pci.discovery import discover
from passthrough.pci.pciids import PciIds

NODE = "gpu-1"
A10 = "nvidia.com/GA102GL_A10"


@pytest.fixture(scope="module")
def pci_ids():
    return PciIds.load(Path(__file__).resolve().parents[2] / "e2e" / "data" / "pci.ids.2025-07-11")


@pytest.fixture
def gpu_node(tmp_path, pci_ids):
    host = fakesysfs.gpu_node(tmp_path)
    devices = discover(host.sysfs, host.proc, pci_ids).devices
    names = {d.address: object_name(d, NODE) for d in devices if d.reported}
    return devices, names


def on_vfio(devices, *addresses):
    return [dataclasses.replace(d, driver="vfio-pci", driver_override="vfio-pci") if d.address in addresses else d
            for d in devices]


def test_gpu_mode_honours_our_label_and_the_gpu_operators():
    assert plan.gpu_mode({"passthrough.io/gpu-passthrough": "true"})
    assert plan.gpu_mode({"nvidia.com/gpu.workload.config": "vm-passthrough"})
    assert not plan.gpu_mode({"nvidia.com/gpu.workload.config": "container"})
    assert not plan.gpu_mode({"passthrough.io/gpu-passthrough": "false"})
    assert not plan.gpu_mode(None)


def test_gpus_of_a_node_in_gpu_mode_go_to_vfio_with_their_whole_group(gpu_node):
    devices, names = gpu_node
    wanted = plan.plan(devices, {}, names, in_gpu_mode=True)
    # The audio functions share the GPUs' groups and go with them; the root ports (bridges) do not.
    assert wanted.bind == {20: ("0000:3b:00.0", "0000:3b:00.1"), 21: ("0000:af:00.0", "0000:af:00.1")}
    assert wanted.release == {}
    assert wanted.wanted == {"0000:3b:00.0", "0000:af:00.0"}


def test_a_group_already_on_vfio_pci_needs_no_job_and_a_half_bound_one_does(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, "0000:3b:00.0", "0000:3b:00.1", "0000:af:00.0")
    wanted = plan.plan(bound, {}, names, in_gpu_mode=True)
    assert wanted.bind == {21: ("0000:af:00.0", "0000:af:00.1")}  # the audio function of 21 is not there yet
    assert wanted.wanted == {"0000:3b:00.0", "0000:af:00.0"}  # still wanted: served, never given back


def test_a_node_outside_gpu_mode_binds_only_assigned_devices(gpu_node):
    devices, names = gpu_node
    assert plan.plan(devices, {}, names, in_gpu_mode=False).bind == {}
    audio = names["0000:af:00.1"]
    wanted = plan.plan(devices, {audio: "team-a"}, names, in_gpu_mode=False)
    assert wanted.bind == {21: ("0000:af:00.0", "0000:af:00.1")}


def test_pools_left_to_nvidias_plugin_bind_and_serve_only_assigned_devices(gpu_node):
    devices, names = gpu_node
    assert plan.plan(devices, {}, names, in_gpu_mode=True, serve_pools=False).bind == {}
    bound = on_vfio(devices, "0000:3b:00.0", "0000:3b:00.1")
    gpu = names["0000:3b:00.0"]
    served = plan.resources(bound, {gpu: "team-a"}, names, in_gpu_mode=True, serve_pools=False)
    assert list(served) == [f"passthrough.io/{gpu}"]


def test_a_group_no_one_wants_goes_back_only_when_the_agent_bound_it(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, "0000:3b:00.0", "0000:3b:00.1")
    ours = {"0000:3b:00.0", "0000:3b:00.1"}
    assert plan.plan(bound, {}, names, in_gpu_mode=False, ours=ours).release == {20: ("0000:3b:00.0", "0000:3b:00.1")}
    # Pinned by the admin (driverctl sets driver_override to vfio-pci too; vfio-pci.ids= sets
    # none): not in the agent's record, so left alone whatever sysfs says.
    assert plan.plan(bound, {}, names, in_gpu_mode=False).release == {}


def test_a_group_with_a_write_in_flight_is_left_alone(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, "0000:3b:00.0", "0000:3b:00.1")
    ours = {"0000:3b:00.0", "0000:3b:00.1"}
    # An unbind that blocks for its holder: neither given back again nor bound, whatever is assigned.
    assert plan.plan(bound, {}, names, in_gpu_mode=False, ours=ours, locked={"0000:3b:00.1"}).release == {}
    gpu = names["0000:3b:00.0"]
    assert plan.plan(devices, {gpu: "team-a"}, names, in_gpu_mode=False, locked={"0000:3b:00.0"}).bind == {}


def test_ineligible_devices_are_never_bound_even_when_assigned(gpu_node):
    devices, names = gpu_node
    busy = [dataclasses.replace(d, eligible=False, reason="in use") if d.address == "0000:3b:00.0" else d for d in devices]
    assert plan.plan(busy, {names["0000:3b:00.0"]: "team-a"}, names, in_gpu_mode=False).bind == {}


def test_an_assigned_gpu_leaves_its_pool_for_its_own_resource(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, *(d.address for d in devices if d.iommu_group in (20, 21)))
    served = plan.resources(bound, {}, names, in_gpu_mode=True)
    assert [s.address for s in served[A10]] == ["0000:3b:00.0", "0000:af:00.0"]
    gpu = names["0000:af:00.0"]
    served = plan.resources(bound, {gpu: "team-a"}, names, in_gpu_mode=True)
    assert [s.address for s in served[A10]] == ["0000:3b:00.0"]
    assert served[f"passthrough.io/{gpu}"] == (plan.Served("0000:af:00.0", 21, 1),)
    # Audio functions are bound with their group but served only when assigned themselves.
    assert set(served) == {A10, f"passthrough.io/{gpu}"}


def test_a_pool_stays_served_empty_when_every_gpu_is_assigned(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, *(d.address for d in devices if d.iommu_group in (20, 21)))
    everything = {names["0000:3b:00.0"]: "team-a", names["0000:af:00.0"]: "team-b"}
    assert plan.resources(bound, everything, names, in_gpu_mode=True)[A10] == ()


def test_devices_not_on_vfio_or_whose_bind_failed_are_served_by_nobody(gpu_node):
    devices, names = gpu_node
    assert plan.resources(devices, {}, names, in_gpu_mode=True) == {A10: ()}
    bound = on_vfio(devices, *(d.address for d in devices if d.iommu_group in (20, 21)))
    served = plan.resources(bound, {}, names, in_gpu_mode=True, failed=["0000:3b:00.0"])
    assert [s.address for s in served[A10]] == ["0000:af:00.0"]


# -- the node's guarantees: hand-out, holders, the group, other plugins -------------------------

from passthrough.deviceplugin.holder import Holder  # noqa: E402


def test_a_gpu_a_pool_pod_holds_is_served_by_nobody_once_assigned_until_that_pod_ends(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, *(d.address for d in devices if d.iommu_group in (20, 21)))
    gpu = names["0000:af:00.0"]
    pool_pod = {"0000:af:00.0": (Holder("team-b", "pool-vm", A10),)}
    # Still pooled: the pool pod holds it where it belongs.
    assert "0000:af:00.0" in [s.address for s in plan.resources(bound, {}, names, True, holders=pool_pod)[A10]]
    serving = plan.serving(bound, {gpu: "team-a"}, names, True, claimed={gpu}, holders=pool_pod)
    assert serving.resources[f"passthrough.io/{gpu}"] == ()  # not allocatable under its new resource
    assert [s.address for s in serving.resources[A10]] == ["0000:3b:00.0"]  # nor back in the pool
    assert serving.blocked == {"0000:af:00.0": pool_pod["0000:af:00.0"]}
    freed = plan.serving(bound, {gpu: "team-a"}, names, True, claimed={gpu}, holders={})
    assert freed.resources[f"passthrough.io/{gpu}"] == (plan.Served("0000:af:00.0", 21, 1),) and freed.blocked == {}


def test_an_unassigned_gpu_its_pod_still_holds_goes_back_to_the_pool_only_when_the_pod_ends(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, *(d.address for d in devices if d.iommu_group in (20, 21)))
    gpu = names["0000:af:00.0"]
    vm = {"0000:af:00.0": (Holder("team-a", "virt-launcher-vm", f"passthrough.io/{gpu}"),)}
    serving = plan.serving(bound, {}, names, True, holders=vm)
    assert [s.address for s in serving.resources[A10]] == ["0000:3b:00.0"] and "0000:af:00.0" in serving.blocked


def test_a_device_reassigned_while_the_old_namespaces_pod_holds_it_waits_for_that_pod(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, "0000:af:00.0", "0000:af:00.1")
    gpu = names["0000:af:00.0"]
    resource = f"passthrough.io/{gpu}"
    team_a_pod = {"0000:af:00.0": (Holder("team-a", "virt-launcher-vm", resource),)}
    # Same resource name, another namespace: the kubelet cannot tell them apart, the agent must.
    moved = plan.serving(bound, {gpu: "team-b"}, names, False, claimed={gpu}, holders=team_a_pod)
    assert moved.resources == {resource: ()} and moved.blocked == team_a_pod
    # Its own namespace's pod holds it: that is the running VM, served as ever.
    stayed = plan.serving(bound, {gpu: "team-a"}, names, False, claimed={gpu}, holders=team_a_pod)
    assert stayed.resources == {resource: (plan.Served("0000:af:00.0", 21, 1),)} and stayed.blocked == {}


def test_no_member_of_a_group_with_a_claimed_member_is_pooled(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, *(d.address for d in devices if d.iommu_group in (20, 21)))
    audio = names["0000:af:00.1"]
    # The audio function is assigned (even before its hand-out): its GPU leaves the pool, since a
    # pool pod would get /dev/vfio/21 and with it the assigned device.
    assert [s.address for s in plan.resources(bound, {}, names, True, claimed={audio})[A10]] == ["0000:3b:00.0"]
    assert plan.plan(devices, {}, names, in_gpu_mode=True, claimed={audio}).bind == {20: ("0000:3b:00.0", "0000:3b:00.1")}


def test_a_device_assigned_but_not_handed_out_is_neither_bound_nor_served(gpu_node):
    devices, names = gpu_node
    nic = names["0000:af:00.1"]
    # The caller passes only handed-out assignments: a namespace that does not exist yet is not one.
    assert plan.plan(devices, {}, names, in_gpu_mode=False, claimed={nic}).bind == {}


def test_a_device_another_plugin_serves_is_not_ours_to_bind_give_back_or_serve(gpu_node):
    devices, names = gpu_node
    bound = on_vfio(devices, *(d.address for d in devices if d.iommu_group in (20, 21)))
    others = {"0000:3b:00.0": "nvidia.com/GA102GL_A10"}
    assert plan.plan(devices, {}, names, in_gpu_mode=True, others=others).bind == {21: ("0000:af:00.0", "0000:af:00.1")}
    ours = {d.address for d in bound if d.iommu_group == 20}
    assert plan.plan(bound, {}, names, in_gpu_mode=False, ours=ours, others=others).release == {}
    gpu = names["0000:3b:00.0"]
    served = plan.resources(bound, {gpu: "team-a"}, names, True, claimed={gpu}, others=others)
    assert f"passthrough.io/{gpu}" not in served and [s.address for s in served[A10]] == ["0000:af:00.0"]


def test_a_pool_gpu_assigned_but_not_handed_out_yet_stays_where_it_is(gpu_node):
    # The operator hands a device out only while it is Ready; giving it back meanwhile (or
    # reporting it held) would keep it from ever being Ready: it waits on vfio-pci, unserved.
    devices, names = gpu_node
    bound = on_vfio(devices, *(d.address for d in devices if d.iommu_group in (20, 21)))
    ours = {d.address for d in bound if d.iommu_group in (20, 21)}
    gpu = names["0000:af:00.0"]
    waiting = plan.plan(bound, {}, names, in_gpu_mode=True, ours=ours, claimed={gpu})
    assert waiting.release == {} and 21 not in waiting.bind
    assert "0000:af:00.0" not in [s.address for s in plan.resources(bound, {}, names, True, claimed={gpu})[A10]]
    # Out of GPU mode and not on vfio-pci: not bound for it either, until the hand-out.
    assert plan.plan(devices, {}, names, in_gpu_mode=False, claimed={gpu}).bind == {}
