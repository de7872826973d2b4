"""The small API client (kube.client.Session) against the real API server: every way it logs in,
what a refusal looks like, and a watch."""

from __future__ import annotations

import asyncio
import json
import stat
import sys

import pytest
import yaml

from passthrough.kube import client
from passthrough.kube.client import ApiError, open_session

pytestmark = pytest.mark.cluster


def kubeconfig(cluster, path, user: dict, cluster_extra: dict | None = None, ca_data: bool = True):
    entry = {"server": cluster.server, **(cluster_extra or {})}
    if ca_data:
        entry["certificate-authority-data"] = yaml.safe_load(cluster.kubeconfig.read_text())["clusters"][0]["cluster"][
            "certificate-authority-data"
        ]
    path.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "c",
        "clusters": [{"name": "k", "cluster": entry}], "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
    }))  # fmt: skip
    return path


async def namespaces(session: client.Session) -> list[str]:
    listing = await session.request("GET", "/api/v1/namespaces")
    return [n["metadata"]["name"] for n in listing["items"]]


async def test_the_clusters_own_kubeconfig_logs_in(cluster):
    async with await open_session(str(cluster.kubeconfig)) as session:
        assert "default" in await namespaces(session)


async def test_a_token_file_and_a_ca_file_relative_to_the_kubeconfig(cluster, tmp_path):
    (tmp_path / "token").write_text(cluster.token + "\n")
    (tmp_path / "ca.crt").write_bytes(cluster.ca_file.read_bytes())
    path = kubeconfig(cluster, tmp_path / "config", {"tokenFile": "token"}, {"certificate-authority": "ca.crt"}, ca_data=False)
    async with await open_session(str(path)) as session:
        assert "default" in await namespaces(session)


async def test_a_wrong_token_is_a_401_with_the_servers_words(cluster, tmp_path):
    path = kubeconfig(cluster, tmp_path / "config", {"token": "not-a-token"})
    async with await open_session(str(path)) as session:
        with pytest.raises(ApiError) as refused:
            await namespaces(session)
    assert refused.value.status == 401 and refused.value.message == "Unauthorized", refused.value.body


async def test_a_server_whose_certificate_is_not_trusted_is_refused_unless_told_to_skip(cluster, tmp_path):
    untrusted = kubeconfig(cluster, tmp_path / "untrusted", {"token": cluster.token}, ca_data=False)
    async with await open_session(str(untrusted)) as session:
        with pytest.raises(Exception, match="certificate verify failed"):
            await namespaces(session)
    skipping = kubeconfig(cluster, tmp_path / "skipping", {"token": cluster.token}, {"insecure-skip-tls-verify": True}, ca_data=False)
    async with await open_session(str(skipping)) as session:
        assert "default" in await namespaces(session)


async def test_in_a_pod_the_service_account_logs_in_and_its_token_is_read_again(cluster, tmp_path, monkeypatch):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "ca.crt").write_bytes(cluster.ca_file.read_bytes())
    (account / "token").write_text("stale")
    host, port = cluster.server.removeprefix("https://").rsplit(":", 1)
    monkeypatch.setattr(client, "SERVICE_ACCOUNT", account)
    monkeypatch.setattr(client, "TOKEN_REREAD_SECONDS", 0.0)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", port)
    monkeypatch.delenv("KUBECONFIG", raising=False)
    async with await open_session() as session:
        assert session.host == cluster.server
        with pytest.raises(ApiError) as refused:
            await namespaces(session)
        assert refused.value.status == 401
        (account / "token").write_text(cluster.token)  # rotated, as the kubelet does with bound tokens
        assert "default" in await namespaces(session)


async def test_an_exec_plugin_goes_through_kubernetes_asyncio(cluster, tmp_path):
    plugin = tmp_path / "credential"
    credential = {"apiVersion": "client.authentication.k8s.io/v1", "kind": "ExecCredential", "status": {"token": cluster.token}}
    plugin.write_text(f"#!{sys.executable}\nprint({json.dumps(json.dumps(credential))})\n")
    plugin.chmod(plugin.stat().st_mode | stat.S_IXUSR)
    exec_ = {"apiVersion": "client.authentication.k8s.io/v1", "command": str(plugin), "interactiveMode": "Never"}
    path = kubeconfig(cluster, tmp_path / "config", {"exec": exec_})
    async with await open_session(str(path)) as session:
        assert "default" in await namespaces(session)


async def test_a_watch_sends_events_and_ends_when_the_server_says(cluster, api, unique):
    async with await open_session(str(cluster.kubeconfig)) as session:
        name = f"kubeapi-{unique}"
        body = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"a": "é😀"}}
        listing = await session.request("GET", "/api/v1/namespaces/default/configmaps")
        seen = []

        async def watch() -> None:
            query = {"resourceVersion": listing["metadata"]["resourceVersion"], "fieldSelector": f"metadata.name={name}",
                     "timeoutSeconds": 2}  # fmt: skip
            async for kind, obj in session.watch("/api/v1/namespaces/default/configmaps", query):
                seen.append((kind, obj["data"]["a"]))

        watching = asyncio.create_task(watch())
        made = await session.request("POST", "/api/v1/namespaces/default/configmaps", body=body)
        assert made["data"]["a"] == "é😀"
        await asyncio.wait_for(watching, 10)  # the server's timeoutSeconds ends it
        await session.request("DELETE", f"/api/v1/namespaces/default/configmaps/{name}")
    assert seen == [("ADDED", "é😀")]


async def test_a_watch_of_a_kind_that_does_not_exist_is_a_404(cluster):
    async with await open_session(str(cluster.kubeconfig)) as session:
        with pytest.raises(ApiError) as refused:
            async for _ in session.watch("/apis/passthrough.io/v1alpha1/nosuchthings"):
                pass
    assert refused.value.status == 404



async def test_the_api_server_knows_us_by_our_user_agent(cluster, unique):
    # A write without a fieldManager is recorded under the client's User-Agent (its part before
    # the first "/"), as the API server's audit log and metrics see it.
    async with await open_session(str(cluster.kubeconfig)) as session:
        name = f"agent-{unique}"
        made = await session.request("POST", "/api/v1/namespaces/default/configmaps",
                                     body={"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": {"a": "b"}})  # fmt: skip
        await session.request("DELETE", f"/api/v1/namespaces/default/configmaps/{name}")
    assert [m["manager"] for m in made["metadata"]["managedFields"]] == ["passthrough"]


async def test_a_rotated_ca_file_is_read_again_without_a_new_session(cluster, tmp_path):
    from tests.unit.test_kubeapi_transport import authority

    other, _ = authority(tmp_path, "other-ca")
    (tmp_path / "ca.crt").write_bytes(other.read_bytes())
    path = kubeconfig(cluster, tmp_path / "config", {"token": cluster.token}, {"certificate-authority": "ca.crt"}, ca_data=False)
    async with await open_session(str(path)) as session:
        with pytest.raises(Exception, match="certificate verify failed"):
            await namespaces(session)
        (tmp_path / "ca.crt").write_bytes(cluster.ca_file.read_bytes())  # the cluster's CA, written in place
        assert "default" in await namespaces(session)  # the failed handshake made it look again at once


async def test_a_kubeconfigs_proxy_url_reaches_the_api_server_through_the_proxy(cluster, tmp_path):
    from tests.unit.test_kubeapi_transport import connect_proxy

    tunnels: list[tuple[str, str]] = []
    server, port = await connect_proxy(tunnels)
    path = kubeconfig(cluster, tmp_path / "config", {"token": cluster.token}, {"proxy-url": f"http://127.0.0.1:{port}"})
    try:
        async with await open_session(str(path)) as session:
            assert "default" in await namespaces(session)
    finally:
        server.close()
    assert tunnels == [(f"CONNECT {cluster.server.removeprefix('https://')} HTTP/1.1", "")]
