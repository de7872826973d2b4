"""`passthrough operator` webhook flags: off unless asked, and a clear usage error when the certificate is missing."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "passthrough", "operator", *args], capture_output=True, text=True, timeout=60)


def test_the_webhook_flags_are_documented():
    out = run("--help").stdout
    assert "--webhook-port PORT" in out and "--webhook-cert-dir DIR" in out and "--webhook-addr ADDR" in out


def test_a_webhook_port_without_a_certificate_directory_is_a_usage_error():
    result = run("--webhook-port=9443")
    assert result.returncode == 2
    assert "--webhook-port needs --webhook-cert-dir (tls.crt, tls.key)" in result.stderr and "Traceback" not in result.stderr


def test_a_certificate_directory_without_the_files_names_them(tmp_path):
    (tmp_path / "tls.crt").write_text("")
    result = run("--webhook-port=9443", f"--webhook-cert-dir={tmp_path}")
    assert result.returncode == 2
    assert f"--webhook-cert-dir: {tmp_path / 'tls.key'} not found" in result.stderr
