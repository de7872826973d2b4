"""Who may read /metrics: the API server decides, as kube-rbac-proxy and controller-runtime's
metrics filter have it decide.

A scraper sends `Authorization: Bearer <token>`. A TokenReview says whose token it is; a
SubjectAccessReview says whether that user may `get` the non-resource URL `/metrics` (the
chart's `<release>-metrics-reader` ClusterRole grants it). Each decision is kept for a minute
per token, so a scrape every 15 s costs the API server two small requests a minute.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import logging
from typing import Any

from passthrough.kube.client import session_of

log = logging.getLogger(__name__)

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
ACCESS_REVIEWS = "/apis/authorization.k8s.io/v1/subjectaccessreviews"


class MetricsReviewer:
    """`await reviewer(token)`: 200 (may read), 401 (no token, or one the API server does not
    know), 403 (known, not allowed) or 503 (the API server could not be asked; not kept)."""

    def __init__(self, api: Any, path: str = "/metrics", ttl: float = 60.0, remembered: int = 256) -> None:
        self.session = session_of(api)
        self.path, self.ttl, self.remembered = path, ttl, remembered
        self._decided: collections.OrderedDict[bytes, tuple[int, float]] = collections.OrderedDict()
        self._failure_logged = False

    async def __call__(self, token: str | None) -> int:
        if not token:
            return 401
        key = hashlib.sha256(token.encode()).digest()  # the token itself is not kept
        now = asyncio.get_running_loop().time()
        decided = self._decided.get(key)
        if decided is not None and decided[1] > now:
            return decided[0]
        try:
            status = await self._review(token)
        except Exception as exc:  # the API server away: refuse this scrape, decide again next time
            if not self._failure_logged:
                self._failure_logged = True
                log.warning("cannot review a metrics scraper's token (%s: %s); answering 503", type(exc).__name__, exc)
            return 503
        self._failure_logged = False
        self._decided[key] = (status, now + self.ttl)
        self._decided.move_to_end(key)
        while len(self._decided) > self.remembered:
            self._decided.popitem(last=False)
        return status

    async def _review(self, token: str) -> int:
        review = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token}}
        who = (await self.session.request("POST", TOKEN_REVIEWS, body=review, timeout=10)).get("status") or {}
        if not who.get("authenticated"):
            return 401
        user = who.get("user") or {}
        spec = {key: user[key] for key in ("uid", "groups", "extra") if user.get(key)}
        access = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {**spec, "user": user.get("username", ""), "nonResourceAttributes": {"path": self.path, "verb": "get"}},
        }
        verdict = (await self.session.request("POST", ACCESS_REVIEWS, body=access, timeout=10)).get("status") or {}
        return 200 if verdict.get("allowed") else 403
