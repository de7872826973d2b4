"""Standard Kubernetes conditions, as the agent and the operator both write them.

A condition keeps its lastTransitionTime while its status holds; only a flip moves it.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Cond:
    status: str
    reason: str
    message: str
    lastTransitionTime: str = ""

    @classmethod
    def of(cls, raw: Mapping[str, Any] | None) -> Cond | None:
        if not raw:
            return None
        return cls(raw.get("status", "Unknown"), raw.get("reason", ""), raw.get("message", ""), raw.get("lastTransitionTime", ""))

    def same(self, other: Cond | None) -> bool:
        return other is not None and (self.status, self.reason, self.message) == (other.status, other.reason, other.message)


def timestamp(now: datetime.datetime) -> str:
    return now.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_timestamp(text: str) -> datetime.datetime | None:
    try:
        return datetime.datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.UTC)
    except (TypeError, ValueError):
        return None


def condition(type_: str, new: Cond, old: Cond | None, now: datetime.datetime) -> dict[str, Any]:
    keep = old is not None and old.status == new.status and old.lastTransitionTime
    return {
        "type": type_,
        "status": new.status,
        "reason": new.reason,
        "message": new.message,
        "lastTransitionTime": old.lastTransitionTime if keep else timestamp(now),
    }
