"""The `passthrough` command: help for every subcommand, and clear errors that lose nothing."""

from __future__ import annotations

import subprocess
import sys

import pytest

COMMANDS = ["operator", "agent", "binder", "discover", "render", "resource-name", "uninstall", "crds", "values-schema"]


def run(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "passthrough", *args], capture_output=True, text=True, timeout=60, env=env)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_subcommand_has_help(command):
    result = run(command, "--help")
    assert result.returncode == 0 and result.stdout.startswith(f"usage: passthrough {command}")


def _client(command: str, *args: str) -> subprocess.CompletedProcess:
    return run(command, "--node-name=n1", *args) if command == "agent" else run(command, *args)


@pytest.mark.parametrize("command", ["operator", "agent"])
def test_a_kubeconfig_that_does_not_exist_is_a_usage_error_that_says_so(command, tmp_path):
    missing = tmp_path / "missing"
    result = _client(command, f"--kubeconfig={missing}")
    assert result.returncode == 2
    assert f"--kubeconfig: {missing}: the file does not exist" in result.stderr
    assert "pass the path of a kubeconfig" in result.stderr  # and what to do instead
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["operator", "agent"])
def test_without_a_usable_kubeconfig_the_message_says_what_to_do(command, tmp_path):
    garbled = tmp_path / "kubeconfig"
    garbled.write_text("this: is not a kubeconfig\n")
    result = _client(command, f"--kubeconfig={garbled}")
    assert result.returncode == 1
    assert "no usable kubeconfig" in result.stderr and "--kubeconfig" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["agent", "--node-name=n1", "--rescan-interval=soon"], "--rescan-interval: 'soon' is not a duration"),
        (["operator", "--not-found-grace=-5m"], "--not-found-grace"),
    ],
)
def test_a_bad_duration_is_a_usage_error(args, message):
    result = run(*args)
    assert result.returncode == 2 and message in result.stderr


def test_version_names_the_installed_package():
    import importlib.metadata

    result = run("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"passthrough {importlib.metadata.version('passthrough-operator')}"
