"""Events are posted in order, a few at a time, after the work that made them; none is lost."""

from __future__ import annotations

import asyncio

from passthrough.kube.events import EventRecorder


class FakeCore:
    """Shaped as `kube.client.Session`: Events are POSTed, repeats PATCHed."""

    def __init__(self, delay: float = 0.01, hang: bool = False) -> None:
        self.posted: list[dict] = []
        self.in_flight = self.most_in_flight = 0
        self.delay, self.hang = delay, hang

    async def request(self, method, path, body=None, **kwargs):
        assert method == "POST" and path.startswith("/api/v1/namespaces/") and path.endswith("/events")
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(3600 if self.hang else self.delay)
            self.posted.append({"namespace": path.split("/")[4], **body})
            return {**body, "metadata": {**body["metadata"], "name": f"e{len(self.posted)}"}}
        finally:
            self.in_flight -= 1


def recorder(core: FakeCore, **kwargs) -> EventRecorder:
    return EventRecorder(core, "test", **kwargs)


def involved(i: int) -> dict:
    return {"api_version": "passthrough.io/v1alpha1", "kind": "PCIDevice", "name": f"d{i}", "namespace": "team-a", "uid": f"u{i}"}


async def test_every_event_is_posted_in_order_with_few_in_flight():
    core = FakeCore()
    events = recorder(core, concurrency=3)
    for i in range(20):
        events.post(involved(i), "Normal", "Assigned", f"message {i}")
    await asyncio.wait_for(events.drain(), 5)
    assert [e["message"] for e in core.posted] == [f"message {i}" for i in range(20)]
    assert core.most_in_flight == 3
    first = core.posted[0]
    assert first["involvedObject"] == {"apiVersion": "passthrough.io/v1alpha1", "kind": "PCIDevice", "name": "d0",
                                       "namespace": "team-a", "uid": "u0"}
    assert first["metadata"] == {"generateName": "d0.", "namespace": "team-a"} and first["source"] == {"component": "test"}
    assert first["firstTimestamp"] == first["lastTimestamp"] and first["type"] == "Normal" and first["count"] == 1


async def test_past_the_backlog_the_oldest_events_are_dropped_and_counted():
    core = FakeCore()
    events = recorder(core, concurrency=1, backlog=5)
    for i in range(12):
        events.post(involved(i), "Normal", "Assigned", f"message {i}")
    await asyncio.wait_for(events.drain(), 5)
    assert [e["message"] for e in core.posted] == [f"message {i}" for i in range(7, 12)]
    assert events.dropped == 7


async def test_closing_does_not_hang_on_an_api_server_that_is_gone():
    events = recorder(FakeCore(hang=True))
    events.post(involved(1), "Warning", "NodeGone", "the node is gone")
    await asyncio.wait_for(events.close(timeout=0.2), 2)
    assert not events._posters
