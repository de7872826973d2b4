"""The real node's cluster DNS (e2e/realnode/dns.py): which names are Services', and the answers."""

from __future__ import annotations

import ipaddress
import struct

import pytest

from e2e.realnode import dns


def query(name: str, qtype: int = dns.TYPE_A, ident: int = 0x1234) -> bytes:
    labels = b"".join(bytes([len(label)]) + label.encode() for label in name.split("."))
    return struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + labels + b"\0" + struct.pack("!HH", qtype, 1)


def lookup(namespace: str, service: str) -> str | None:
    return {("default", "kubernetes"): "10.0.0.1", ("passthrough-system", "passthrough-webhook"): "10.0.0.7"}.get(
        (namespace, service)
    )


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("kubernetes.default.svc", ("default", "kubernetes")),
        ("kubernetes.default.svc.cluster.local.", ("default", "kubernetes")),
        ("Kubernetes.Default.SVC", ("default", "kubernetes")),
        # What a pod's resolver tries first with its search domains (ndots 5): no Service's name.
        ("kubernetes.default.svc.passthrough-system.svc.cluster.local", None),
        ("kubernetes.default.svc.svc.cluster.local", None),
        ("kubernetes.default", None),
        ("example.com", None),
        (".default.svc", None),
    ],
)
def test_service_of(name, expected):
    assert dns.service_of(name) == expected


def test_a_services_name_gets_its_cluster_ip():
    answer = dns.answer(query("kubernetes.default.svc.cluster.local"), lookup)
    ident, flags, questions, answers = struct.unpack("!HHHH", answer[:8])
    assert (ident, flags & 0x800F, questions, answers) == (0x1234, 0x8000, 1, 1)
    assert ipaddress.IPv4Address(answer[-4:]) == ipaddress.IPv4Address("10.0.0.1")


def test_an_unknown_name_is_nxdomain_and_another_type_has_no_data():
    unknown = dns.answer(query("nothing.default.svc"), lookup)
    assert struct.unpack("!HH", unknown[2:4] + unknown[6:8]) == (0x8183, 0)
    aaaa = dns.answer(query("kubernetes.default.svc", qtype=28), lookup)
    assert struct.unpack("!HH", aaaa[2:4] + aaaa[6:8]) == (0x8180, 0)


def test_a_malformed_query_is_a_format_error_or_no_answer():
    assert dns.answer(b"\x00\x01", lookup) is None
    truncated = query("kubernetes.default.svc")[:20]
    assert struct.unpack("!H", dns.answer(truncated, lookup)[2:4])[0] & 0x000F == dns.RCODE_FORMERR
