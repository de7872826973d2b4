"""Nothing lost under faults: after each, the invariant (e2e/invariants.py) holds within 30 s
and neither the operator nor an agent exited.

The faults are e2e/faults.py's, which `make chaos` runs many times over; here each runs once
(the operator kills twice), with a fresh random seed shown on failure. They run against a
control plane of this module's own: they stop its API server and its etcd.
"""

from __future__ import annotations

import random

import pytest

from e2e import faults

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
async def rig(tmp_path_factory):
    started = await faults.Rig.up(tmp_path_factory.mktemp("faults"))
    yield started
    await started.close()


async def survive(rig, kind: str) -> faults.Trial:
    seed = random.randrange(1, 2**31)
    trial = await faults.run_trial(rig, kind, seed)
    # A trial starts from what the ones before left (devices taken out, namespaces deleted).
    replay = f"replay: python e2e/chaos.py --replay {','.join(rig.history)}"
    assert not trial.violations, f"{trial.note}; {replay}\n" + "\n".join(trial.violations)
    assert not trial.exits, f"{trial.note}; {replay}\n" + "\n".join(trial.exits)
    assert trial.faults >= 1
    assert trial.converge_s <= faults.CONVERGE_LIMIT
    print(f"{kind} seed {seed}: converged {trial.converge_s:.1f}s after the fault ({trial.note})")
    return trial


@pytest.mark.parametrize("attempt", [1, 2])
async def test_operator_killed_at_random_moments_during_assignments_loses_nothing(rig, attempt):
    await survive(rig, "operator-kill")


async def test_agent_restarted_with_a_device_gone_and_one_added_keeps_the_assignment(rig):
    await survive(rig, "agent-hardware")


async def test_namespace_deleted_while_a_vm_lists_its_device_keeps_the_assignment_without_a_pcidevice(rig):
    await survive(rig, "namespace-delete")


async def test_etcd_stopped_and_started_again_loses_nothing(rig):
    await survive(rig, "etcd")


async def test_kube_apiserver_stopped_mid_burst_of_200_assignments_loses_nothing(rig):
    await survive(rig, "apiserver-burst")


async def test_node_deleted_and_created_again_keeps_its_devices_assignments(rig):
    await survive(rig, "node-recreate")
