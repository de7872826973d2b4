"""Shared fixtures. `cluster` is one real control plane for the whole session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from e2e import cluster as local


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> local.LocalCluster:
    """A ready control plane with KubeVirt's and our CRDs installed.

    Set PASSTHROUGH_TEST_CLUSTER to the directory of a cluster started with
    `make cluster-up` (.cluster) to reuse it instead of starting one.
    """
    reuse = os.environ.get("PASSTHROUGH_TEST_CLUSTER")
    if reuse:
        yield local.LocalCluster.from_state(Path(reuse))
        return
    started = local.start(tmp_path_factory.mktemp("controlplane"))
    try:
        yield started
    finally:
        started.stop()
