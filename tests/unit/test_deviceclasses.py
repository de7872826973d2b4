"""DRA mode's DeviceClass per namespace: which classes there should be, and the writes that get
there (none when the live ones are as they should be)."""

from __future__ import annotations

from passthrough.admission.claims import class_owner
from passthrough.controller import deviceclasses as dc
from tests.unit.test_admission_claims import NS, NS_UID, node_device

GPU, OTHER = "0000:af:00.0", "0000:3b:00.0"


def live(*namespaces: str) -> dict[str, dc.Live]:
    return {dc.class_name(ns): dc.Live(ns, dc.selectors(ns)) for ns in namespaces}


def test_the_class_of_a_namespace_selects_the_devices_the_agents_publish_for_it():
    body = dc.body("team-a")
    assert body["metadata"] == {"name": "passthrough-team-a", "labels": {"passthrough.io/namespace": "team-a",
                                                                         "app.kubernetes.io/managed-by": "passthrough-operator"}}  # fmt: skip
    assert body["spec"]["selectors"] == [{"cel": {"expression":
        'device.driver == "pci.passthrough.io" && device.attributes["passthrough.io"].namespace == "team-a"'}}]  # fmt: skip
    assert dc.Live.of(body["metadata"]["labels"], body["spec"]) == dc.Live("team-a", dc.selectors("team-a"))


def test_only_namespaces_with_a_device_handed_out_have_a_class():
    devices = [node_device(GPU, NS, (NS, NS_UID)), node_device(OTHER, "team-b")]  # team-b's not handed out yet
    assert dc.namespaces_with_devices(devices) == {NS}


def test_a_missing_class_is_applied_a_changed_one_put_back_and_nothing_written_at_rest():
    assert dc.plan({"team-a"}, live(dc.POOL)) == (["team-a"], [])
    assert dc.plan({"team-a"}, live(dc.POOL, "team-a")) == ([], [])
    edited = {**live(dc.POOL), "passthrough-team-a": dc.Live("team-a", [{"cel": {"expression": "true"}}])}
    assert dc.plan({"team-a"}, edited) == (["team-a"], [])


def test_the_pool_has_a_class_of_its_own_always_that_no_namespace_can_have_and_every_namespace_may_use():
    assert dc.plan(set(), {}) == ([dc.POOL], [])
    body = dc.body(dc.POOL)
    assert body["metadata"]["name"] == "passthrough-pool.gpu" and body["metadata"]["labels"]["passthrough.io/namespace"] == ""
    assert body["spec"]["selectors"] == [{"cel": {"expression":
        'device.driver == "pci.passthrough.io" && device.attributes["passthrough.io"].namespace == ""'}}]  # fmt: skip
    # No namespace's class is it (a namespace name has no dot), and the webhook sees no owner in it.
    assert dc.class_name("pool") != dc.POOL_CLASS and "." in dc.POOL_CLASS
    assert class_owner(dc.POOL_CLASS) == ""


def test_the_class_of_a_namespace_whose_last_device_left_is_deleted_and_others_classes_are_left_alone():
    assert dc.plan(set(), live(dc.POOL, "team-a")) == ([], ["passthrough-team-a"])
    # Labelled as ours under another name: not ours to delete, and no owner for the webhook.
    odd = {**live(dc.POOL), "gpus-for-all": dc.Live("team-a", [])}
    assert dc.plan(set(), odd) == ([], [])
    assert class_owner("gpus-for-all") == ""
    # The owner follows from the name, whether the class exists yet or not.
    assert class_owner(dc.class_name("team-a")) == "team-a"


def test_a_node_serves_through_dra_by_its_agents_word_and_the_clusters_default_until_it_has_said():
    dra_default, plugin_default = {"dra": {"enabled": True, "perNode": True}}, {"dra": {"enabled": False, "perNode": True}}
    assert dc.through_dra("dra", plugin_default) and not dc.through_dra("device-plugin", dra_default)
    assert dc.through_dra("", dra_default) and not dc.through_dra("", plugin_default) and not dc.through_dra("", {})
