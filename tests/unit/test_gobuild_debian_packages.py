"""What a cgo build needs first comes from Debian's packages: nothing is installed when it is there
already, package lists are refreshed once when an install fails, and where apt-get cannot run the
error says what to install."""

from __future__ import annotations

import pytest

from e2e import gobuild

PACKAGES = ("libexample-dev", "pkg-config")


@pytest.fixture
def steps(monkeypatch, tmp_path):
    """The commands the install would run, recorded instead; `fail` names the steps that fail once."""
    ran: list[str] = []
    fail: set[str] = set()

    def step(label, name, args, cwd, log_path, env=None, progress_total=0):
        ran.append(name)
        if name in fail:
            fail.discard(name)
            raise gobuild.BuildError(f"{label} build failed at step '{name}'")
        return ""

    monkeypatch.setattr(gobuild, "step", step)
    monkeypatch.setenv("PASSTHROUGH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(gobuild.os, "geteuid", lambda: 0)
    monkeypatch.setattr(gobuild.shutil, "which", lambda command: f"/usr/bin/{command}")
    return ran, fail


def test_nothing_is_installed_when_the_library_is_there(steps):
    ran, _ = steps
    gobuild.debian_packages("example", PACKAGES, lambda: True)
    assert ran == []


def test_a_failed_install_refreshes_the_package_lists_once_and_tries_again(steps):
    ran, fail = steps
    fail.add("apt-get install libexample-dev pkg-config")
    present = iter([False, True])  # missing before, there after
    gobuild.debian_packages("example", PACKAGES, lambda: next(present))
    assert ran == ["apt-get install libexample-dev pkg-config", "apt-get update", "apt-get install libexample-dev pkg-config"]


def test_an_install_that_leaves_the_library_missing_says_so(steps):
    with pytest.raises(gobuild.BuildError, match="libexample-dev pkg-config installed, and the example build still cannot find"):
        gobuild.debian_packages("example", PACKAGES, lambda: False)


def test_without_root_the_error_says_what_to_install(steps, monkeypatch):
    ran, _ = steps
    monkeypatch.setattr(gobuild.os, "geteuid", lambda: 1000)
    with pytest.raises(gobuild.BuildError, match=r"needs libexample-dev pkg-config .*apt-get install libexample-dev pkg-config"):
        gobuild.debian_packages("example", PACKAGES, lambda: False)
    assert ran == []
