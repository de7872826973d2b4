"""The two real nodes' addresses and configuration (e2e/realnode/config.py, the joined node's
kubeconfig): each node's pods in a range of its own, the second node on the first's link."""

from __future__ import annotations

import base64
import ipaddress
from pathlib import Path

from e2e.realnode import config
from e2e.realnode.inside import joined_kubeconfig


def test_the_joined_node_is_on_the_first_nodes_link_and_its_pods_in_a_range_of_their_own():
    link = ipaddress.ip_network(f"{config.NODE_IP}/24", strict=False)
    assert ipaddress.ip_address(config.WORKER_IP) in link and config.WORKER_IP != config.NODE_IP
    pods, worker_pods = ipaddress.ip_network(config.POD_CIDR), ipaddress.ip_network(config.WORKER_POD_CIDR)
    assert not pods.overlaps(worker_pods) and not link.overlaps(worker_pods) and not link.overlaps(pods)
    assert len(config.WORKER_LINK) <= 15  # IFNAMSIZ
    assert config.WORKER_LINK.startswith("veth")  # what `RealNode.host_leftovers` looks for on the host


def test_each_nodes_cni_and_kube_proxy_name_its_own_pods_range():
    assert config.cni_conflist()["plugins"][0]["ipam"]["ranges"] == [[{"subnet": config.POD_CIDR}]]
    worker = config.cni_conflist(pod_cidr=config.WORKER_POD_CIDR)
    assert worker["plugins"][0]["ipam"]["ranges"] == [[{"subnet": config.WORKER_POD_CIDR}]]
    assert config.kube_proxy_config(Path("/k"), "n")["clusterCIDR"] == config.POD_CIDR
    proxy = config.kube_proxy_config(Path("/k"), "n", node_ip=config.WORKER_IP, cluster_cidr=config.WORKER_POD_CIDR)
    assert (proxy["clusterCIDR"], proxy["bindAddress"]) == (config.WORKER_POD_CIDR, config.WORKER_IP)


def test_the_joined_nodes_kubeconfig_reaches_the_api_server_through_the_first_nodes_forwarder():
    kubeconfig = joined_kubeconfig("t0k", b"CA PEM")
    [cluster] = kubeconfig["clusters"]
    assert cluster["cluster"]["server"] == f"https://{config.NODE_IP}:{config.APISERVER_PORT}"
    # The API server's certificate names loopback, not the first node's address.
    assert cluster["cluster"]["tls-server-name"] == "localhost"
    assert base64.b64decode(cluster["cluster"]["certificate-authority-data"]) == b"CA PEM"
    assert kubeconfig["users"] == [{"name": "admin", "user": {"token": "t0k"}}]
