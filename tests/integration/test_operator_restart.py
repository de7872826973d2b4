"""The operator is level-triggered: killed mid-way through 200 assignments, it converges."""

from __future__ import annotations

import asyncio
import signal
from collections import Counter

import pytest
from kubernetes_asyncio import client

from e2e import support
from passthrough.kube.custom import Custom
from e2e.processes import OperatorProcess

pytestmark = pytest.mark.cluster
COUNT = 200


async def test_operator_killed_mid_way_through_200_assignments_converges(api, cluster, tmp_path, unique):
    core = client.CoreV1Api(api)
    npci, pcidev = Custom(api, "nodepcidevices"), Custom(api, "pcidevices", namespaced=True)
    first, second = f"kill-{unique}-a", f"kill-{unique}-b"
    for ns in (first, second):
        await support.create_namespace(api, ns)
    node = await support.ensure_node(api, f"big-{unique}")
    limit = asyncio.Semaphore(16)

    async def report(i):
        async with limit:
            return await support.report_device(api, node, support.gpu(f"0000:{i // 8 + 1:02x}:{i % 8:02x}.0"))

    names = await asyncio.gather(*(report(i) for i in range(COUNT)))

    async def assign(name, ns):
        async with limit:
            await support.assign(api, name, ns)

    operator = OperatorProcess(cluster, tmp_path / "operator.log")
    operator.start()
    try:
        await asyncio.gather(*(assign(name, first) for name in names))

        async def some_done():
            return len((await pcidev.list(namespace=first))["items"]) >= COUNT // 4

        await support.wait_for(some_done, 60, interval=0.05, what="a quarter of the PCIDevices")
        operator.stop(signal.SIGKILL)
        done_before = len((await pcidev.list(namespace=first))["items"])
        assert done_before < COUNT, "the operator finished before it could be killed; the test proves nothing"

        # While it is down, the admin moves a fifth of the devices on.
        moved = set(names[::5])
        await asyncio.gather(*(assign(name, second) for name in moved))

        operator = OperatorProcess(cluster, tmp_path / "operator-2.log")
        operator.start()

        async def converged():
            everywhere = [(d["metadata"]["namespace"], d["metadata"]["name"])
                          for d in (await pcidev.list())["items"] if d["metadata"]["name"] in set(names)]
            if len(everywhere) != COUNT or any(count > 1 for count in Counter(n for _, n in everywhere).values()):
                return False
            wrong = [(ns, n) for ns, n in everywhere if ns != (second if n in moved else first)]
            if wrong:
                return False
            assigned = [d for d in (await npci.list(f"passthrough.io/node={node.name}"))["items"]
                        if any(c["type"] == "Assigned" and c["status"] == "True" for c in d["status"].get("conditions", []))]
            return len(assigned) == COUNT

        await support.wait_for(converged, 120, interval=0.5, what="all 200 devices in the right namespace, once")
    finally:
        operator.stop()
        await support.remove_node(api, node.name)
        for ns in (first, second):
            await core.delete_namespace(ns)
