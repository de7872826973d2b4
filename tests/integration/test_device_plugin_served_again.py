"""A resource withdrawn and served again at once, against the real kubelet.

The agent withdraws a resource (its device reassigned while a pod holds it, or gone) and
serves it again moments later. The kubelet (1.37.2) keys a device plugin by resource and
socket path: a registration at the path of a plugin it has not yet let go of is refused
("device plugin already connected"), and its clean-up of the refused one forgets the old
connection too, so that every later registration at that path is refused until the kubelet
restarts. The resource is then never served again on that node. Each socket after the first
has a path of its own (deviceplugin/server.py), and so registers.
"""

from __future__ import annotations

import asyncio

import pytest
from kubernetes_asyncio import client

from e2e import support
from passthrough.deviceplugin.allocation import PluginDevice
from passthrough.deviceplugin.manager import PluginManager

pytestmark = pytest.mark.cluster

RESOURCE = "example.com/served-again"
DEVICE = PluginDevice(id="0000:3b:00.0", iommu_group=21)
ROUNDS = 8


async def test_a_resource_withdrawn_and_served_again_at_once_registers_again_each_time(api, kubelet_nodes):
    node = kubelet_nodes()
    core = client.CoreV1Api(api)
    manager = PluginManager(node.device_plugin_dir)
    runner = asyncio.create_task(manager.run())

    async def served(when: str) -> None:
        await support.wait_for(lambda: asyncio.sleep(0, manager.registrations()[RESOURCE].registered), 15,
                               what=lambda: f"{when}: registered ({manager.registrations()[RESOURCE]})")
        await support.wait_for(lambda: _allocatable(core, node.node_name, "1"), 30,
                               what=f"{when}: {RESOURCE} allocatable on {node.node_name}")

    try:
        await manager.set_resources({RESOURCE: [DEVICE]})
        for round_ in range(ROUNDS):
            await served(f"before round {round_}")
            # Withdrawn (the last list says Unhealthy) and at once back, while the kubelet is busy: it
            # reads the old stream's end and the new registration together, in either order.
            node.freeze()
            try:
                await manager.set_resources({})
                back = asyncio.create_task(manager.set_resources({RESOURCE: [DEVICE]}))
                await asyncio.sleep(0.5)
            finally:
                node.thaw()
            await back
        await served("at the end")
    finally:
        await manager.close()
        await asyncio.wait_for(runner, 5)


async def _allocatable(core: client.CoreV1Api, node: str, count: str) -> bool:
    return (await support.resources(core, node)).get(RESOURCE, "0") == count
