"""The agent's own Node: read at each scan (its labels as the plan reads them, its extended
resources), labelled with what the node can do, the mode it serves devices in and the answer to a
give-back request, and watched for the changes that call for a scan."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from passthrough.agent import metrics
from passthrough.agent import plan as node_plan
from passthrough.agent import report
from passthrough.api.labels import GIVEN_BACK_LABEL, MODE_LABEL, SERVING_LABEL
from passthrough.kube.client import APPLY_PATCH as APPLY, ApiError
from passthrough.kube.custom import AGENT_MANAGER
from passthrough.pci import preflight
from passthrough.pci.discovery import Discovery

log = logging.getLogger(__name__)


def extended_resources(node: Mapping[str, Any]) -> dict[str, str]:
    """A Node's extended resources (the names with a domain) and their counts: a plugin's
    devices may reach the node's capacity a status update after its name does."""
    capacity = (node.get("status") or {}).get("capacity") or {}
    return {name: count for name, count in capacity.items() if "/" in name}


class OwnNode:
    def __init__(self, session: Any, name: str, log_once: Callable[..., None], forget: Callable[[str], None]) -> None:
        self.session, self.name, self._log_once, self._forget = session, name, log_once, forget
        self.labels: dict[str, str] = {}  # as the plan reads them (`plan.as_planned`)
        self.resources: dict[str, str] | None = None  # its extended resources, as a scan last read them
        self.given_back = ""  # the give-back request this agent has answered on its Node
        self.serving = ""  # the mode it serves devices in (SERVING_LABEL); "" when it serves none
        self.mode_label: str | None = None  # where nodes choose: MODE_LABEL as the agent started ("" absent)

    async def read(self) -> report.Node | None:
        """The Node now (None while it does not exist). Plain JSON, not the client's V1Node model:
        a real Node's status (its images, its conditions) would cost more CPU to build than the
        request itself, at every scan."""
        try:
            body = await self.session.request("GET", f"/api/v1/nodes/{self.name}")
        except ApiError as exc:
            if exc.status == 404:
                self._log_once("node-missing", "Node %s does not exist; not reporting until it does", self.name)
                return None
            raise
        self._forget("node-missing")
        metadata = body["metadata"]
        asked = (metadata.get("labels") or {}).get(MODE_LABEL, "")
        if self.mode_label is not None and asked != self.mode_label:
            self._log_once("mode-label", "Node %s's label %s is now %r: this agent serves in %s mode until it starts "
                           "again (restart its pod to apply the label)", self.name, MODE_LABEL, asked, self.serving)  # fmt: skip
        else:
            self._forget("mode-label")
        self.labels = node_plan.as_planned(metadata.get("labels"))
        self.resources = extended_resources(body)
        return report.Node(name=self.name, uid=metadata["uid"])

    async def label(self, node: report.Node, discovery: Discovery) -> int:
        """Labels what `passthrough discover --check` says, and the give-back answer; the writes made."""
        labels = preflight.node_labels(discovery.node)
        if self.serving:
            labels[SERVING_LABEL] = self.serving
        answer = self.given_back if self.given_back == node_plan.giving_back(self.labels) else ""
        if answer:
            labels[GIVEN_BACK_LABEL] = answer
        stale = GIVEN_BACK_LABEL in self.labels and not answer  # an answer to a request withdrawn
        if all(self.labels.get(k) == v for k, v in labels.items()) and not stale:
            return 0
        body = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node.name, "labels": labels}}
        with metrics.write("nodes", "apply"):
            await self.session.request("PATCH", f"/api/v1/nodes/{node.name}", query={"fieldManager": AGENT_MANAGER, "force": True},
                                       body=body, content_type=APPLY)  # fmt: skip
        log.info("labelled Node %s %s", node.name, " ".join(f"{k}={v}" for k, v in labels.items()))
        return 1


class NodeChanges:
    """Seen on the watch of the agent's Node: a change of GPU passthrough mode (a label an admin
    sets) calls `on_mode`, a change of its extended resources (another device plugin registered,
    went or changed: one server per device) or of its passthrough.io/mode label calls `on_resources`."""

    def __init__(self, own: OwnNode, on_mode: Callable[[], None], on_resources: Callable[[], None]) -> None:
        # What the last scan read: a change between that read and this watch's start (its first
        # event) wakes a scan as one seen later does.
        self.own, self.served, self.on_mode, self.on_resources = own, own.resources, on_mode, on_resources
        self.asked = own.mode_label  # the serving mode's label as last seen, where nodes choose

    def seen(self, kind: str, node: dict[str, Any]) -> None:
        raw = (node.get("metadata") or {}).get("labels") or {}
        labels = node_plan.as_planned(raw)
        names = extended_resources(node)
        asked = raw.get(MODE_LABEL, "")
        if node_plan.mode(labels) != node_plan.mode(self.own.labels):
            self.own.labels = labels
            self.on_mode()
        elif (self.served is not None and names != self.served) or (self.asked is not None and asked != self.asked):
            self.on_resources()  # a scan: it also says that a new mode label waits for the agent's next start
        self.served = names
        if self.asked is not None:
            self.asked = asked
