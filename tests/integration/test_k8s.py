"""Our thin API layer against the real API server: failed writes raise, never pass as objects."""

from __future__ import annotations

import pytest

from passthrough.api.models import API_VERSION
from passthrough.kube.custom import Custom
from passthrough.kube.client import ApiError

pytestmark = pytest.mark.cluster


async def test_a_refused_apply_raises_with_the_servers_message(api, unique):
    kind = Custom(api, "nodepcidevices")
    body = {"apiVersion": API_VERSION, "kind": "NodePCIDevice", "metadata": {"name": f"pci-{unique}"},
            "spec": {"assignedNamespace": "Not_A_Namespace"}}
    with pytest.raises(ApiError) as err:
        await kind.apply(body, "test")
    assert err.value.status == 422 and "must be empty or a namespace name" in err.value.body


async def test_a_status_apply_for_a_missing_object_is_404(api, unique):
    kind = Custom(api, "nodepcidevices")
    body = {"apiVersion": API_VERSION, "kind": "NodePCIDevice", "metadata": {"name": f"pci-gone-{unique}"}, "status": {"mode": "Pool"}}
    with pytest.raises(ApiError) as err:
        await kind.apply(body, "test", status=True)
    assert err.value.status == 404


async def test_an_apply_naming_a_uid_never_brings_a_deleted_object_back(api, unique):
    kind = Custom(api, "nodepcidevices")
    name = f"pci-uid-{unique}"
    created = await kind.apply({"apiVersion": API_VERSION, "kind": "NodePCIDevice", "metadata": {"name": name}}, "test")
    await kind.delete(name)
    with pytest.raises(ApiError) as err:
        await kind.apply({"apiVersion": API_VERSION, "kind": "NodePCIDevice",
                          "metadata": {"name": name, "uid": created["metadata"]["uid"], "finalizers": ["x/y"]}}, "test")
    assert err.value.status in (404, 409), err.value
    assert await kind.get(name) is None


async def test_identical_events_count_up_on_one_event_and_a_different_one_is_its_own(api, unique):
    from kubernetes_asyncio import client

    from passthrough.kube.events import EventRecorder

    recorder = EventRecorder(api, "passthrough-test")
    involved = {"api_version": API_VERSION, "kind": "NodePCIDevice", "name": f"pci-events-{unique}", "uid": f"uid-{unique}"}
    for _ in range(3):
        recorder.post(involved, "Warning", "NodeGone", "Node gpu-1 was deleted")
        await recorder.drain()  # one after the other, as repeats come
    recorder.post(involved, "Normal", "Assigned", "Assigned to team-a.")
    await recorder.drain()
    found = await client.CoreV1Api(api).list_namespaced_event("default", field_selector=f"involvedObject.name={involved['name']}")
    counts = sorted((e.reason, e.count) for e in found.items)
    assert counts == [("Assigned", 1), ("NodeGone", 3)], counts
    [gone] = [e for e in found.items if e.reason == "NodeGone"]
    assert gone.last_timestamp >= gone.first_timestamp
