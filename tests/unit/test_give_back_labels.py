"""How a node asked to give its devices back (`helm uninstall`'s pre-delete hook) reads to the plan."""

from __future__ import annotations

from passthrough.agent import plan
from passthrough.api.labels import GIVE_BACK_LABEL

GPU_MODE = {"passthrough.io/gpu-passthrough": "true", "nvidia.com/gpu.workload.config": "vm-passthrough"}


def test_a_node_asked_to_give_back_is_in_gpu_mode_no_longer():
    asked = plan.as_planned({**GPU_MODE, GIVE_BACK_LABEL: "17", "zone": "a"})
    assert not plan.gpu_mode(asked) and asked == {GIVE_BACK_LABEL: "17", "zone": "a"}
    assert plan.as_planned(GPU_MODE) == GPU_MODE and plan.as_planned(None) == {}


def test_a_request_and_its_withdrawal_change_the_mode_in_gpu_mode_or_not():
    assert plan.mode({}) == (False, "")
    assert plan.mode(plan.as_planned({GIVE_BACK_LABEL: "17"})) == (False, "17")
    assert plan.mode(plan.as_planned({**GPU_MODE, GIVE_BACK_LABEL: "18"})) == (False, "18")
    assert plan.mode(plan.as_planned(GPU_MODE)) == (True, "")
