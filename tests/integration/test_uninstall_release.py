"""Letting go of a KubeVirt CR whose `spec.configuration` holds nothing but what the operator
wrote (an install that ships `configuration: {}`, or KubeVirt's release CR with `featureGates: []`),
against the real API server and KubeVirt's own CRD: the uninstall hook, and the operator when its
values name another CR. Whatever lets go of everything leaves a valid CR (`spec.configuration` an
object; KubeVirt's schema refuses null), and a second run writes nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest
from kubernetes_asyncio import client

from e2e import identities, support
from passthrough.kube.custom import OPERATOR_MANAGER, Custom
from passthrough.kubevirt.render import GATES_ANNOTATION, render
from passthrough.kubevirt.values import parse_values
from tests.integration.test_kubevirt_config import MERGE, SYNCS, condition, configuration, pci_list, wait_config, wait_kubevirt
from tests.integration.test_metrics import scrape, scrape_when
from tests.integration.test_uninstall import hook  # noqa: F401  (the chart's post-delete hook, as a fixture)

pytestmark = pytest.mark.cluster

# What installs leave in spec.configuration before the operator writes: nothing of anyone else's.
OWN_NOTHING = {
    "empty": {},
    "kubevirt-release": {"developerConfiguration": {"featureGates": []}},
}


def kubevirts(api) -> Custom:
    return Custom(api, "kubevirts", namespaced=True, group="kubevirt.io", version="v1")


async def create_bare_kubevirt(api, namespace: str, config: dict) -> dict:
    body = {"apiVersion": "kubevirt.io/v1", "kind": "KubeVirt", "metadata": {"name": "kubevirt", "namespace": namespace},
            "spec": {"imagePullPolicy": "IfNotPresent", "configuration": config}}  # fmt: skip
    return await client.CustomObjectsApi(api).create_namespaced_custom_object("kubevirt.io", "v1", namespace, "kubevirts", body)


def assert_let_go(kv: dict) -> None:
    """The CR as valid as before the operator came: no allow-list, none of our gates, no record of them."""
    left = configuration(kv)
    assert isinstance(left, dict) and "permittedHostDevices" not in left, kv["spec"]
    assert "HostDevices" not in ((left.get("developerConfiguration") or {}).get("featureGates") or []), left
    assert GATES_ANNOTATION not in (kv["metadata"].get("annotations") or {})
    assert kv["spec"]["imagePullPolicy"] == "IfNotPresent"


@pytest.mark.parametrize("install", sorted(OWN_NOTHING))
async def test_the_hook_lets_go_of_a_kubevirt_cr_whose_configuration_is_all_the_operators(
    api, cluster, namespace, hook, install
):  # fmt: skip
    command, kubeconfig = hook
    cr = kubevirts(api)
    await create_bare_kubevirt(api, namespace, OWN_NOTHING[install])
    # What the operator writes for the values naming this CR (the defaults' allow-list, HostDevices).
    patch = render(parse_values({"kubevirt": {"name": "kubevirt", "namespace": namespace}})).patch
    await cr.apply(patch, OPERATOR_MANAGER)
    assert pci_list(await cr.get("kubevirt", namespace))

    as_hook = [sys.executable, "-m", "passthrough", "uninstall", *command[2:], f"--kubeconfig={kubeconfig}"]
    done = subprocess.run(as_hook, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert f"KubeVirt {namespace}/kubevirt: let go of the operator's allow-list entries and feature gates" in done.stdout
    kv = await cr.get("kubevirt", namespace)
    assert_let_go(kv)
    # Run again: nothing of ours is left on it, so nothing is written.
    again = subprocess.run(as_hook, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and f"KubeVirt {namespace}/kubevirt" not in again.stdout, again
    assert (await cr.get("kubevirt", namespace))["metadata"]["resourceVersion"] == kv["metadata"]["resourceVersion"]


async def test_the_operator_lets_go_of_a_cr_whose_configuration_was_all_its_own_when_the_values_name_another(
    api, namespace, operator
):  # fmt: skip
    configs, cr = Custom(api, "passthroughconfigs"), kubevirts(api)
    other = await support.create_namespace(api, f"{namespace}-b")
    try:
        await create_bare_kubevirt(api, namespace, {})
        await create_bare_kubevirt(api, other, {})
        spec = {"kubevirt": {"name": "kubevirt", "namespace": namespace}}
        await configs.apply({"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
                             "spec": spec}, "admin")  # fmt: skip
        await wait_kubevirt(cr, namespace, pci_list, "applied to the first CR")
        await configs.apply({"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
                             "spec": {"kubevirt": {"name": "kubevirt", "namespace": other}}}, "admin")  # fmt: skip
        await wait_kubevirt(cr, other, pci_list, "applied to the second CR")
        left = await wait_kubevirt(cr, namespace, lambda o: "permittedHostDevices" not in configuration(o), "the first CR let go of")
        assert_let_go(left)
    finally:
        await configs.delete("cluster")
        await client.CoreV1Api(api).delete_namespace(other)


async def test_values_that_render_no_gate_and_no_allow_list_apply_and_then_write_nothing(api, namespace, operator):
    # KubeVirt disables HostDevices and the values replace the defaults with nothing: what the
    # operator writes is an empty gates list (null would be refused), once.
    configs, cr = Custom(api, "passthroughconfigs"), kubevirts(api)
    await create_bare_kubevirt(api, namespace, {"developerConfiguration": {"disabledFeatureGates": ["HostDevices"]}})
    try:
        await configs.apply({"apiVersion": "passthrough.io/v1alpha1", "kind": "PassthroughConfig", "metadata": {"name": "cluster"},
                             "spec": {"kubevirt": {"name": "kubevirt", "namespace": namespace}, "gpu": {"replaceDefaults": True}}},
                            "admin")  # fmt: skip
        await wait_config(configs, lambda o: condition(o, "Applied").get("reason") == "Applied", "Applied=True")
        kv = await cr.get("kubevirt", namespace)
        assert configuration(kv) == {"developerConfiguration": {"disabledFeatureGates": ["HostDevices"], "featureGates": []}}
        assert kv["metadata"]["annotations"][GATES_ANNOTATION] == ""
        await support.quiet(api, ("kubevirts",), settle=1)
        before = await support.write_counts(api)
        syncs = (await scrape(operator.metrics_port))(SYNCS, kind="kubevirt")
        await client.CustomObjectsApi(api).patch_namespaced_custom_object(
            "kubevirt.io", "v1", namespace, "kubevirts", "kubevirt", {"metadata": {"labels": {"touched": "1"}}},
            _content_type=MERGE)  # fmt: skip
        await scrape_when(operator.metrics_port, lambda s: s(SYNCS, kind="kubevirt") > syncs, "a sync of the KubeVirt CR")
        after = await support.write_counts(api)
        assert support.writes_between(before, after, "kubevirts", verbs=support.CHANGE_VERBS) == 1, support.diff(before, after)
    finally:
        await configs.delete("cluster")


async def test_a_failure_says_what_the_api_server_said(cluster, namespace, tmp_path):
    # A ServiceAccount granted nothing: the API server refuses, and says why.
    nobody = identities.identity(cluster, namespace, "nobody", tmp_path)
    done = subprocess.run([sys.executable, "-m", "passthrough", "uninstall", f"--kubeconfig={nobody.kubeconfig}"],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 1, done
    assert "403 Forbidden" in done.stderr and f"system:serviceaccount:{namespace}:nobody" in done.stderr, done.stderr
    assert "cannot get resource" in done.stderr, done.stderr
