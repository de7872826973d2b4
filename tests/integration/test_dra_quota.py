"""What a ResourceQuota does to passthrough devices, in both modes, against the real API server
(its quota admission) and kube-controller-manager (its resourcequota controller, which counts
what is used); `docs/tasks/dra.md` says the same in words.

- DRA mode: `passthrough-pool.gpu.deviceclass.resource.k8s.io/devices` caps the devices a
  namespace's claims *request* through the pool's class, counted when a claim is created
  (allocated or not; `allocationMode: All` counts 32, the most a claim can get; `firstAvailable`
  its largest subrequest), and freed when the claim is deleted. A claim through another class is
  not counted under it.
- A pod that asks for a pool GPU as an extended resource (`deviceclass.resource.kubernetes.io/
  passthrough-pool.gpu` in its limits; the scheduler makes the claim) is counted by
  `requests.deviceclass.resource.kubernetes.io/passthrough-pool.gpu` when it is created.
- Device-plugin mode: a GPU is an extended resource the pod requests (`nvidia.com/<model>`),
  capped by `requests.nvidia.com/<model>` when the pod is created.
"""

from __future__ import annotations

import contextlib

import pytest
from kubernetes_asyncio import client

from e2e import support
from passthrough.admission.claims import POOL_CLASS
from passthrough.controller import deviceclasses
from passthrough.kube.client import ApiError, session_of

pytestmark = pytest.mark.cluster
RESOURCE = "/apis/resource.k8s.io/v1"
DEVICES = f"{POOL_CLASS}.deviceclass.resource.k8s.io/devices"
EXTENDED = f"deviceclass.resource.kubernetes.io/{POOL_CLASS}"  # the pool class's implicit extended resource
MODEL = "nvidia.com/GA102GL_A10"  # a pool A10 in device-plugin mode


@pytest.fixture
async def pool_class(api):
    """The pool's DeviceClass, as the operator writes it."""
    with contextlib.suppress(ApiError):
        await session_of(api).request("POST", f"{RESOURCE}/deviceclasses", body=deviceclasses.body(deviceclasses.POOL))
    return POOL_CLASS


async def quota(api, namespace: str, hard: dict[str, str]) -> None:
    """A ResourceQuota, once the controller has counted its use (until then admission refuses all it covers)."""
    core = client.CoreV1Api(api)
    await core.create_namespaced_resource_quota(namespace, {"metadata": {"name": "gpus"}, "spec": {"hard": hard}})

    async def counted():
        found = await core.read_namespaced_resource_quota("gpus", namespace)
        return found.status and found.status.hard == hard and found.status.used is not None

    await support.wait_for(counted, 30, 0.2, what="the resourcequota controller counting quota gpus")


async def used(api, namespace: str) -> dict[str, str]:
    return (await client.CoreV1Api(api).read_namespaced_resource_quota("gpus", namespace)).status.used or {}


def claim(name: str, *requests: dict) -> dict:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": name},
            "spec": {"devices": {"requests": list(requests)}}}  # fmt: skip


def exactly(device_class: str, **more: object) -> dict:
    return {"name": "gpu", "exactly": {"deviceClassName": device_class, **more}}


async def create(api, namespace: str, body: dict) -> dict:
    return await session_of(api).request("POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaims", body=body)


async def refused(api, namespace: str, body: dict) -> str:
    with pytest.raises(ApiError) as raised:
        await create(api, namespace, body)
    assert raised.value.status == 403, raised.value
    return raised.value.message


def pod(name: str, limits: dict[str, str]) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "compute", "image": "virt-launcher:test", "resources": {"limits": limits}}]}}  # fmt: skip


async def test_a_quota_on_the_pool_class_caps_the_devices_claims_request_through_it(api, namespace, pool_class):
    await quota(api, namespace, {DEVICES: "2"})
    await create(api, namespace, claim("one", exactly(pool_class)))
    # Counted when created, not when allocated: nothing here allocates it.
    await support.wait_for(lambda: _used_is(api, namespace, DEVICES, "1"), 30, 0.2, what="one device counted")
    message = await refused(api, namespace, claim("two-more", exactly(pool_class, count=2)))
    assert f"exceeded quota: gpus, requested: {DEVICES}=2, used: {DEVICES}=1, limited: {DEVICES}=2" in message, message
    # allocationMode All counts the most a claim can be allocated (32), however few devices exist.
    message = await refused(api, namespace, claim("all", exactly(pool_class, allocationMode="All")))
    assert f"requested: {DEVICES}=32" in message, message
    # firstAvailable counts its largest subrequest of the class.
    first = {"name": "gpu", "firstAvailable": [{"name": "two", "deviceClassName": pool_class, "count": 2},
                                               {"name": "one", "deviceClassName": pool_class}]}  # fmt: skip
    assert f"requested: {DEVICES}=2" in await refused(api, namespace, claim("first", first))
    # A claim through another class (the namespace's own, here) is not counted under the pool's.
    await create(api, namespace, claim("own", exactly(f"passthrough-{namespace}")))
    await create(api, namespace, claim("second", exactly(pool_class)))
    await support.wait_for(lambda: _used_is(api, namespace, DEVICES, "2"), 30, 0.2, what="two devices counted")
    # Deleting a claim gives its count back.
    await session_of(api).request("DELETE", f"{RESOURCE}/namespaces/{namespace}/resourceclaims/one")
    await support.wait_for(lambda: _used_is(api, namespace, DEVICES, "1"), 30, 0.2, what="the deleted claim's device given back")
    await create(api, namespace, claim("third", exactly(pool_class)))


async def test_a_quota_on_extended_resources_caps_pods_in_either_mode(api, namespace, pool_class):
    core = client.CoreV1Api(api)
    await quota(api, namespace, {f"requests.{EXTENDED}": "1", f"requests.{MODEL}": "1"})
    # DRA mode: a pool GPU asked for as an extended resource (the scheduler makes the claim).
    await support.create_pod(api, namespace, pod("dra-one", {EXTENDED: "1"}))
    await support.wait_for(lambda: _used_is(api, namespace, f"requests.{EXTENDED}", "1"), 30, 0.2, what="the DRA pod counted")
    with pytest.raises(client.ApiException) as raised:
        await core.create_namespaced_pod(namespace, pod("dra-two", {EXTENDED: "1"}))
    assert raised.value.status == 403 and f"exceeded quota: gpus, requested: requests.{EXTENDED}=1" in raised.value.body
    # Device-plugin mode: the GPU is the device plugin's extended resource.
    await support.create_pod(api, namespace, pod("plugin-one", {MODEL: "1"}))
    with pytest.raises(client.ApiException) as raised:
        await core.create_namespaced_pod(namespace, pod("plugin-two", {MODEL: "1"}))
    assert raised.value.status == 403 and f"exceeded quota: gpus, requested: requests.{MODEL}=1" in raised.value.body


async def _used_is(api, namespace: str, name: str, value: str) -> bool:
    return (await used(api, namespace)).get(name) == value


async def test_a_claim_made_from_a_template_over_the_quota_leaves_its_pod_pending_and_told(api, namespace, pool_class):
    await quota(api, namespace, {DEVICES: "0"})
    template = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate", "metadata": {"name": "vm-gpu"},
                "spec": {"spec": {"devices": {"requests": [exactly(pool_class)]}}}}  # fmt: skip
    await session_of(api).request("POST", f"{RESOURCE}/namespaces/{namespace}/resourceclaimtemplates", body=template)
    body = pod("templated", {})
    body["spec"]["resourceClaims"] = [{"name": "gpu", "resourceClaimTemplateName": "vm-gpu"}]
    body["spec"]["containers"][0]["resources"] = {"claims": [{"name": "gpu"}]}
    await support.create_pod(api, namespace, body)  # the pod is admitted: it asks for no device itself

    async def told():
        events = await client.CoreV1Api(api).list_namespaced_event(namespace, field_selector="involvedObject.name=templated")
        return next((e.message for e in events.items if e.reason == "FailedResourceClaimCreation"), None)

    message = await support.wait_for(told, 30, 0.2, what="kube-controller-manager's event on the pod")
    assert f"exceeded quota: gpus, requested: {DEVICES}=1, used: {DEVICES}=0, limited: {DEVICES}=0" in message, message
    listed = await session_of(api).request("GET", f"{RESOURCE}/namespaces/{namespace}/resourceclaims")
    assert listed["items"] == []
