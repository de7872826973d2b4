"""The values' gpu.mediatedDevicesConfiguration (the vGPU types virt-handler creates per node)
carried to both outputs as Cozystack's kubevirt chart carries it: the KubeVirt CR's
spec.configuration.mediatedDevicesConfiguration and the Package's kubevirt values."""

from __future__ import annotations

import dataclasses

import pytest

from passthrough.controller.kubevirt_sync import KubeVirtView, needs_apply, plan_sync, release
from passthrough.kubevirt.render import cozystack_package, render
from passthrough.kubevirt.values import ValuesError, parse_values
from tests.unit.test_kubevirt_sync import NOW, config, kubevirt_after, status_after

L40S = {"nvidia.com/gpu.product": "NVIDIA-L40S"}
CONFIG = {
    "mediatedDeviceTypes": ["nvidia-222"],
    "nodeMediatedDeviceTypes": [{"nodeSelector": L40S, "mediatedDeviceTypes": ["nvidia-740", "nvidia-741"]}],
}
VGPU = {"mdevNameSelector": "NVIDIA L40S-24Q", "resourceName": "nvidia.com/L40S-24Q"}


def vgpu_values(config: dict | None) -> dict:
    gpu: dict = {"variant": "vgpu", "permittedHostDevices": {"mediatedDevices": [VGPU]}}
    if config is not None:
        gpu["mediatedDevicesConfiguration"] = config
    return {"gpu": gpu}


def both(values: dict) -> tuple[dict, dict]:
    """(the KubeVirt CR's spec.configuration, the Package's kubevirt values) for `values`."""
    rendered = render(parse_values(values))
    package = cozystack_package(rendered)
    return rendered.patch["spec"]["configuration"], package["spec"]["components"]["kubevirt"]["values"]


def test_the_configuration_reaches_the_kubevirt_cr_and_the_package_as_written():
    configuration, package_values = both(vgpu_values(CONFIG))
    assert configuration["mediatedDevicesConfiguration"] == CONFIG
    assert package_values["mediatedDevicesConfiguration"] == CONFIG
    # Beside the allow-list entry that lets VMs ask for the type's resource, not in place of it.
    assert configuration["permittedHostDevices"]["mediatedDevices"][0]["mdevNameSelector"] == VGPU["mdevNameSelector"]


def test_only_the_lists_given_are_written():
    per_node = {"nodeMediatedDeviceTypes": CONFIG["nodeMediatedDeviceTypes"]}
    configuration, package_values = both(vgpu_values(per_node))
    assert configuration["mediatedDevicesConfiguration"] == per_node
    assert package_values["mediatedDevicesConfiguration"] == per_node


def test_a_key_kubevirt_does_not_have_is_not_carried():
    # KubeVirt's schema would prune it from the CR, and every apply would write it again.
    extra = {"mediatedDeviceTypes": ["nvidia-222"], "comment": "L40S hosts",
             "nodeMediatedDeviceTypes": [{**CONFIG["nodeMediatedDeviceTypes"][0], "owner": "platform"}]}  # fmt: skip
    configuration, package_values = both(vgpu_values(extra))
    assert configuration["mediatedDevicesConfiguration"] == package_values["mediatedDevicesConfiguration"] == CONFIG


@pytest.mark.parametrize("config", [None, {}, {"mediatedDeviceTypes": [], "nodeMediatedDeviceTypes": []}])
def test_without_types_neither_output_has_the_field(config):
    # Left out, server-side apply drops what the operator wrote before and an admin's own
    # configuration on the CR (written by another manager) is left alone.
    configuration, package_values = both(vgpu_values(config))
    assert "mediatedDevicesConfiguration" not in configuration
    assert "mediatedDevicesConfiguration" not in package_values


@pytest.mark.parametrize(
    "config,where",
    [
        ({"nodeMediatedDeviceTypes": [{"nodeSelector": L40S}]}, "mediatedDeviceTypes"),
        ({"nodeMediatedDeviceTypes": [{"mediatedDeviceTypes": ["nvidia-740"]}]}, "nodeSelector"),
        ({"mediatedDeviceTypes": "nvidia-740"}, "mediatedDeviceTypes"),
        ({"mediatedDeviceTypes": [""]}, "mediatedDeviceTypes[0]"),
    ],
)
def test_a_configuration_kubevirt_would_misread_is_refused_naming_the_field(config, where):
    with pytest.raises(ValuesError) as raised:
        parse_values(vgpu_values(config))
    [problem] = raised.value.problems
    assert "gpu.mediatedDevicesConfiguration." in problem and where in problem, problem


# -- the operator's sync: one apply when the types change, none otherwise, and let go when emptied --


def test_the_sync_applies_new_types_once_and_lets_go_of_them_when_the_values_drop_them():
    live = KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset())
    first = plan_sync(config(), live, [], [], None, NOW)
    at_rest = kubevirt_after(first)
    with_types = plan_sync(config(vgpu_values(CONFIG), status_after(first)), at_rest, [], [], first.rendered, NOW)
    assert with_types.apply is not None
    assert with_types.apply["spec"]["configuration"]["mediatedDevicesConfiguration"] == CONFIG
    applied = kubevirt_after(with_types)
    assert "mediatedDevicesConfiguration" in applied.owned
    again = plan_sync(config(vgpu_values(CONFIG), status_after(with_types)), applied, [], [], with_types.rendered, NOW)
    assert again.apply is None

    dropped = plan_sync(config(vgpu_values(None), status_after(with_types)), applied, [], [], with_types.rendered, NOW)
    assert dropped.apply is not None and "mediatedDevicesConfiguration" not in dropped.apply["spec"]["configuration"]
    # Types another manager wrote on the CR are not ours to drop: nothing to write about them.
    theirs = dataclasses.replace(applied, owned=applied.owned - {"mediatedDevicesConfiguration"})
    assert not needs_apply(dropped.rendered, theirs)


def test_letting_go_of_a_cr_drops_our_types_from_it():
    with_types = plan_sync(config(vgpu_values(CONFIG)), KubeVirtView("kubevirt", "kubevirt", "", None, None, (), frozenset()),
                           [], [], None, NOW)  # fmt: skip
    body = release(kubevirt_after(with_types))
    assert body is not None and "mediatedDevicesConfiguration" not in str(body)
