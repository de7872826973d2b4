"""Which claim prepared on the node holds an IOMMU group: the driver prepares a device for no
second claim while one holds it or another member of its group."""

from __future__ import annotations

from passthrough.dra.prepared import PreparedClaim, holder


def prepared(namespace: str, name: str, *groups: int) -> PreparedClaim:
    return PreparedClaim(namespace, name, devices=[{"name": f"pci-{g}", "iommu_group": g} for g in groups])


def test_a_group_is_held_by_the_claim_prepared_with_any_of_its_devices_and_never_by_the_asking_claim_itself():
    claims = {"uid-a": prepared("team-a", "first", 21), "uid-b": prepared("team-a", "other", 7, 9)}
    assert holder(claims, 21, "uid-new") == claims["uid-a"]
    assert holder(claims, 9, "uid-new") == claims["uid-b"]
    assert holder(claims, 21, "uid-a") is None  # its own prepare again (a kubelet retry)
    assert holder(claims, 22, "uid-new") is None
    assert holder({}, 21, "uid-new") is None
