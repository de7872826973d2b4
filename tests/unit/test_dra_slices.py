"""A node's pool of ResourceSlices: resource.k8s.io/v1 takes at most 128 devices in one slice, so a
node with more to offer publishes several, all of one generation, each saying how many there are."""

from __future__ import annotations

from e2e.support import gpu
from passthrough.dra import slice as dra_slice

NODE = "gpu-1"


def offered(count: int, namespace: str = "team-a") -> list[dra_slice.Published]:
    """`count` GPUs handed out to `namespace`, on buses 0x01.. (functions 0 to 7 of each slot)."""
    return [dra_slice.Published(gpu(f"0000:{1 + i // 256:02x}:{(i // 8) % 32:02x}.{i % 8}"), f"pci-{i}", namespace)
            for i in range(count)]  # fmt: skip


def names(spec: dict) -> list[str]:
    return [d["name"] for d in spec["devices"]]


def test_up_to_128_devices_is_one_slice_and_more_is_a_pool_of_several_that_each_say_how_many():
    [one] = dra_slice.specs(NODE, offered(128))
    assert len(one["devices"]) == 128 and one["pool"] == {"name": NODE, "resourceSliceCount": 1}
    pool = dra_slice.specs(NODE, offered(300))
    assert [len(s["devices"]) for s in pool] == [128, 128, 44]
    assert all(s["pool"] == {"name": NODE, "resourceSliceCount": 3} for s in pool)
    everything = [n for s in pool for n in names(s)]
    assert everything == sorted(everything) and len(set(everything)) == 300
    # Named for the node, the first as a node with one slice has always named it.
    assert [dra_slice.slice_name(NODE, i) for i in range(3)] == [f"{NODE}-pci.passthrough.io", f"{NODE}-pci.passthrough.io-1",
                                                                 f"{NODE}-pci.passthrough.io-2"]  # fmt: skip


def test_a_pool_never_shrinks_below_its_live_count_the_slices_left_over_are_empty():
    pool = dra_slice.specs(NODE, offered(5), at_least=3)
    assert [len(s["devices"]) for s in pool] == [5, 0, 0] and pool[0]["pool"]["resourceSliceCount"] == 3
    live = dra_slice.pool_bodies(NODE, "uid-1", dra_slice.specs(NODE, offered(300)), [None, None, None])
    assert dra_slice.live_count(live[0]) == 3 and dra_slice.live_count(None) == 1
    assert dra_slice.live_count({"spec": {"pool": {"resourceSliceCount": "3"}}}) == 1  # unreadable: one


def test_every_slice_of_the_pool_is_written_with_one_generation_past_the_newest_and_nothing_at_rest():
    desired = dra_slice.specs(NODE, offered(200))
    written = dra_slice.pool_bodies(NODE, "uid-1", desired, [None, None])
    assert [b["spec"]["pool"]["generation"] for b in written] == [1, 1]
    assert not dra_slice.pool_changed(desired, written, "uid-1")
    # One device fewer: both are written again, one generation on.
    fewer = dra_slice.specs(NODE, offered(199))
    assert dra_slice.pool_changed(fewer, written, "uid-1")
    again = dra_slice.pool_bodies(NODE, "uid-1", fewer, written)
    assert [b["spec"]["pool"]["generation"] for b in again] == [2, 2]
    # A pass that wrote one slice and not the other: the generations disagree, so all again.
    same_devices_old_generation = {**again[1], "spec": {**again[1]["spec"], "pool": written[1]["spec"]["pool"]}}
    assert not dra_slice.changed(fewer[1], same_devices_old_generation, "uid-1")
    assert dra_slice.pool_changed(fewer, [again[0], same_devices_old_generation], "uid-1")
    # A slice missing from the live pool.
    assert dra_slice.pool_changed(fewer, [again[0], None], "uid-1")
