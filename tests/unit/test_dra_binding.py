"""dra.binding: which of a claim's devices wait for this node's answer, and the answer."""

from passthrough.dra import binding
from passthrough.dra.slice import BIND_FAILED, BOUND, DRIVER

NODE = "gpu-1"


def claim(results, devices=()) -> dict:
    return {"metadata": {"namespace": "team-a", "name": "c", "uid": "u-1", "resourceVersion": "7"},
            "status": {"allocation": {"devices": {"results": results}}, "devices": list(devices)}}


def result(device: str, driver: str = DRIVER, pool: str = NODE, conditions=(BOUND,), **more) -> dict:
    return {"request": "gpu", "driver": driver, "pool": pool, "device": device, "bindingConditions": list(conditions), **more}


def answered(device: str, kind: str, status: str = "True", pool: str = NODE) -> dict:
    return {"driver": DRIVER, "pool": pool, "device": device, "conditions": [{"type": kind, "status": status}]}


def test_only_our_devices_in_this_nodes_pool_with_our_condition_wait():
    found = binding.waiting(NODE, claim([
        result("a"), result("b", driver="other.example.com"), result("c", pool="gpu-2"), result("d", conditions=()),
        result("e", adminAccess=True),
    ]))  # fmt: skip
    assert (found.namespace, found.name, found.uid, found.resource_version) == ("team-a", "c", "u-1", "7")
    assert found.devices == (("gpu", "a", False), ("gpu", "e", True))


def test_a_device_answered_either_way_waits_no_more():
    found = binding.waiting(NODE, claim([result("a"), result("b"), result("c"), result("d")], [
        answered("a", BOUND), answered("b", BIND_FAILED), answered("c", BOUND, status="False"), answered("d", BOUND, pool="gpu-2"),
    ]))  # fmt: skip
    assert [d for _, d, _ in found.devices] == ["c", "d"]


def test_an_unallocated_or_odd_claim_waits_for_nothing():
    assert binding.waiting(NODE, {"metadata": {"name": "c"}}).devices == ()
    assert binding.waiting(NODE, {"metadata": {}, "status": {"allocation": None}}).devices == ()


def test_the_answer_is_an_apply_of_our_entries_for_this_claim_only():
    waiting = binding.waiting(NODE, claim([result("a"), result("b")]))
    body = binding.status_apply(waiting, NODE, {
        "b": binding.condition(False, "no", "2026-01-01T00:00:00Z", reason="BindFailed"),
        "a": binding.condition(True, "on vfio-pci", "2026-01-01T00:00:00Z"),
    })  # fmt: skip
    assert body["metadata"] == {"name": "c", "namespace": "team-a", "uid": "u-1"}
    assert [(d["driver"], d["pool"], d["device"], d["conditions"][0]["type"], d["conditions"][0]["reason"])
            for d in body["status"]["devices"]] == [(DRIVER, NODE, "a", BOUND, "GroupOnVFIO"),
                                                     (DRIVER, NODE, "b", BIND_FAILED, "BindFailed")]  # fmt: skip
    assert all(d["conditions"][0]["status"] == "True" for d in body["status"]["devices"])
