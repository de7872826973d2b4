"""A part of the suite that cannot run here (no kubelet, no image builder, no `go`) skips with a
yellow line, and fails instead under CI=true, where `make test` must have made what it needs."""

from __future__ import annotations

import pytest

from e2e import support


def test_a_part_that_cannot_run_skips_loudly_outside_ci(request, monkeypatch, capsys):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="example-part cannot run here: no root"):
        support.cannot_run(request, "example-part", "no root")


def test_under_ci_a_part_that_cannot_run_fails(request, monkeypatch):
    for value in ("true", "True"):
        monkeypatch.setenv("CI", value)
        with pytest.raises(pytest.fail.Exception, match="example-part tests are required under CI=true.*no buildah"):
            support.cannot_run(request, "example-part", "no buildah")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception):
        support.cannot_run(request, "example-part", "no buildah")
