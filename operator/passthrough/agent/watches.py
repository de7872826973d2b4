"""Watches that wake a scan: the pods of the node that ask for its devices (the Node's own
changes are read by `ownnode.NodeChanges`), and the loop that keeps a watch going."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from passthrough.kube.watch import watch_events

log = logging.getLogger(__name__)

# A pod's end, seen on the watch of the node's pods, is a scan then and these seconds after (the
# kubelet drops a pod from PodResources a moment after the API server does).
POD_END_RESCANS = (0.3, 1.0, 2.5)

Seen = Callable[[str, dict[str, Any]], None]


class PodEnds:
    """Seen on the watch of the node's pods: a pod that asks for one of our resources (or holds
    one of our devices) starts running, ends or goes. The kubelet tells a device plugin nothing
    when a pod ends, and a device its pod held waits for that (to be given back, pooled, or
    served to its new namespace); without this, the held recheck finds it."""

    def __init__(self, asks_ours: Callable[[dict[str, Any]], bool], trigger: Callable[[], None]) -> None:
        self.asks_ours, self.trigger = asks_ours, trigger
        self.states: dict[str, str] = {}  # pod uid -> its state last looked at

    def seen(self, kind: str, pod: dict[str, Any]) -> None:
        uid = (pod.get("metadata") or {}).get("uid", "")
        state = "Gone" if kind == "DELETED" else (pod.get("status") or {}).get("phase", "")
        before = self.states.pop(uid, None) if kind == "DELETED" else self.states.get(uid)
        if kind != "DELETED":
            self.states[uid] = state
        if state == before or state not in ("Running", "Succeeded", "Failed", "Gone") or not self.asks_ours(pod):
            return
        self.trigger()
        loop = asyncio.get_running_loop()
        for delay in POD_END_RESCANS if state != "Running" else ():
            loop.call_later(delay, self.trigger)


async def keep_watching(session: Any, what: str, path: str, selector: str, seen: Seen) -> None:
    """Calls `seen(type, object)` for each event of a watch of `path`, watching again (with
    backoff) when a watch ends."""
    backoff = 1.0
    while True:
        try:
            async for kind, obj in watch_events(session, path, fieldSelector=selector):
                if kind != "BOOKMARK":
                    seen(kind, obj)
            backoff = 1.0
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a dropped connection: the next watch starts over
            log.debug("watch of %s ended (%s); again in %.0fs", what, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 30)
