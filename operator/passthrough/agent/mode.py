"""How this node's agent serves devices: through device plugins or as a DRA driver. The cluster's
default (`--dra`), or, where nodes may choose (`--per-node-mode`), the Node's own label
passthrough.io/mode, read once at start-up: a change takes effect at the agent's next start, since
moving a running node from one mode to the other would hand devices that pods hold to another server."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from passthrough.api.labels import DEVICE_PLUGIN_MODE, DRA_MODE, MODE_LABEL

MODES = (DRA_MODE, DEVICE_PLUGIN_MODE)


@dataclass(frozen=True)
class Mode:
    dra: bool
    problem: str = ""  # why the label was not followed, for the log and a Warning Event on the Node

    @property
    def name(self) -> str:
        return DRA_MODE if self.dra else DEVICE_PLUGIN_MODE


def chosen(labels: Mapping[str, str] | None, default_dra: bool, per_node: bool, node: str = "") -> Mode:
    """The mode this agent serves in: the Node's label where nodes may choose and it names one,
    the default otherwise; a label that is not followed says why and what to do."""
    default = Mode(default_dra)
    value = (labels or {}).get(MODE_LABEL)
    if value is None:
        return default
    where = f"Node {node}'s label {MODE_LABEL}={value}" if node else f"label {MODE_LABEL}={value}"
    if value not in MODES:
        return Mode(default_dra, f"{where} is neither {DRA_MODE} nor {DEVICE_PLUGIN_MODE}; serving in the cluster's default "
                                 f"mode, {default.name}. Set it to {DRA_MODE} or {DEVICE_PLUGIN_MODE}, or remove it, "
                                 "then restart the node's agent.")  # fmt: skip
    if not per_node and value != default.name:
        return Mode(default_dra, f"{where} is not followed: nodes do not choose their mode in this installation "
                                 f"(the chart's agent.devicePlugin.perNode is false); serving in the cluster's mode, "
                                 f"{default.name}. Set agent.devicePlugin.perNode=true to let them, or remove the label.")  # fmt: skip
    return Mode(value == DRA_MODE)
