"""What the small API client makes of kubeconfigs that cannot be used, and of query values."""

from __future__ import annotations

import asyncio

import pytest

from passthrough.kube.connect import CannotStart, session
from passthrough.kube.client import ApiError, KubeconfigError, _query, open_session


def refusal(tmp_path, text: str) -> str:
    path = tmp_path / "config"
    path.write_text(text)
    with pytest.raises(KubeconfigError) as refused:
        asyncio.run(open_session(str(path)))
    return str(refused.value)


CONTEXT = "current-context: c\ncontexts: [{name: c, context: {cluster: k, user: u}}]\n"


def test_each_unusable_kubeconfig_says_what_is_wrong(tmp_path):
    assert "no current-context" in refusal(tmp_path, "clusters: []\n")
    assert "no cluster named 'k'" in refusal(tmp_path, CONTEXT)
    assert "cluster 'k' has no server" in refusal(tmp_path, CONTEXT + "clusters: [{name: k, cluster: {}}]\n")
    with_server = CONTEXT + "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:1'}}]\n"
    assert "no user named 'u'" in refusal(tmp_path, with_server)
    bad_data = with_server + "users: [{name: u, user: {client-certificate-data: '%%%', client-key-data: '%%%'}}]\n"
    assert "client-certificate-data is not base64" in refusal(tmp_path, bad_data)
    junk = with_server + "users: [{name: u, user: {client-certificate-data: anVuaw==, client-key-data: anVuaw==}}]\n"
    assert "the client certificate and key cannot be used" in refusal(tmp_path, junk)
    missing_ca = CONTEXT + "clusters: [{name: k, cluster: {server: 'https://x', certificate-authority: nowhere.crt}}]\nusers: [{name: u, user: {}}]\n"
    assert "cannot load the TLS credentials" in refusal(tmp_path, missing_ca)
    assert "is not YAML" in refusal(tmp_path, "a: [\n")
    assert "no mapping at the top" in refusal(tmp_path, "- a\n")


def test_a_missing_kubeconfig_stops_the_command_with_what_to_pass(tmp_path, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(CannotStart) as refused:
        asyncio.run(session(str(tmp_path / "missing")))
    assert "cannot read" in str(refused.value) and "pass --kubeconfig, set KUBECONFIG, or run in a pod" in str(refused.value)


def test_query_values_are_written_as_the_api_server_reads_them():
    assert _query({"watch": True, "force": False, "limit": 100, "continue": "", "labelSelector": None}) == {
        "watch": "true", "force": "false", "limit": "100"}
    assert _query({}) is None and _query({"continue": ""}) is None


def test_an_api_error_carries_the_servers_message():
    error = ApiError(422, "Unprocessable Entity", '{"kind": "Status", "message": "spec.x: Invalid value"}')
    assert error.status == 422 and error.message == "spec.x: Invalid value" and str(error) == "422 Unprocessable Entity"
    assert ApiError(500, "oops", "<html>").message == ""
