"""When the agent looks again after a scan whose binds or give-backs failed."""

from __future__ import annotations

import asyncio

from passthrough.agent.handover import Outcome
from passthrough.agent.moves import BINDER_AWAY_RECHECK, Moves
from passthrough.pci.binder import BinderAway
from passthrough.pci.vfio import BindError

RESCAN = 300.0


def next_looks(failures: list[dict[str, BindError]]) -> list[float]:
    """The delay to the next scan that `_look_again` asks for after each scan's failures, in turn."""

    async def run() -> list[float]:
        loop = asyncio.get_running_loop()
        moves = Moves(handover=None, node_name="n", rescan_interval=RESCAN, wake=lambda: None, discover=None)
        delays = []
        for failed in failures:
            moves._look_again(Outcome(failures=dict(failed)), blocked=False)
            delays.append(round(moves._again.when() - loop.time()))
        moves._again.cancel()
        return delays

    return asyncio.run(run())


def test_a_refusing_driver_is_asked_again_ever_later():
    refused = {"0000:3b:00.0": BindError("BindFailed", "write error")}
    assert next_looks([refused] * 5) == [5, 10, 20, 40, 80]


def test_a_binder_container_that_does_not_answer_is_asked_again_soon_however_long_it_is_away():
    away = {"0000:3b:00.0": BinderAway("the binder container does not answer")}
    blocked = {"0000:af:00.0": BindError("WriteBlocked", "has not returned")}
    assert next_looks([{**away, **blocked}] * 6) == [BINDER_AWAY_RECHECK] * 6
    # Beside another kind of failure, the back-off holds.
    refused = {"0000:5e:00.0": BindError("BindFailed", "write error")}
    assert next_looks([{**away, **refused}] * 3) == [5, 10, 20]
