"""The node's cluster DNS: Service names to ClusterIPs, as a cluster's DNS answers them for pods.

Clients in pods reach Services by name (Kopf's in-cluster login calls
`https://kubernetes.default.svc`), so the kubelet gives each pod this server (on the node's
address, inside the node's network namespace) as its nameserver. It answers A queries for
`<service>.<namespace>.svc[.cluster.local]` with the Service's ClusterIP, read from the API
server at each query; any other name is NXDOMAIN and any other type of a known name has no
data. It is not CoreDNS: no headless Services, no pod records, SRV or forwarding; nothing the
chart's pods use.
"""

from __future__ import annotations

import asyncio
import ipaddress
import struct
from collections.abc import Callable

DOMAIN = "cluster.local"
TYPE_A = 1
CLASS_IN = 1
RCODE_NXDOMAIN = 3
RCODE_FORMERR = 1


def service_of(name: str, domain: str = DOMAIN) -> tuple[str, str] | None:
    """(namespace, service) a name asks for, or None when it is not a Service's name."""
    labels = name.rstrip(".").lower().split(".")
    suffix = domain.split(".")
    if labels[-len(suffix) :] == suffix:
        labels = labels[: -len(suffix)]
    if len(labels) == 3 and labels[2] == "svc" and all(labels[:2]):
        return labels[1], labels[0]
    return None


def parse_question(packet: bytes) -> tuple[int, int, str, int, int] | None:
    """(id, flags, name, type, question's end) of a one-question query, or None when malformed."""
    if len(packet) < 12:
        return None
    ident, flags, questions = struct.unpack("!HHH", packet[:6])
    if questions != 1:
        return None
    labels, offset = [], 12
    while True:
        if offset >= len(packet):
            return None
        length = packet[offset]
        offset += 1
        if length == 0:
            break
        if length > 63 or offset + length > len(packet):
            return None
        labels.append(packet[offset : offset + length].decode("ascii", "replace"))
        offset += length
    if offset + 4 > len(packet):
        return None
    qtype, _qclass = struct.unpack("!HH", packet[offset : offset + 4])
    return ident, flags, ".".join(labels), qtype, offset + 4


def answer(packet: bytes, lookup: Callable[[str, str], str | None]) -> bytes | None:
    """The response to `packet`; `lookup(namespace, service)` gives a ClusterIP or None."""
    question = parse_question(packet)
    if question is None:
        if len(packet) < 12:
            return None
        return packet[:2] + struct.pack("!HHHHH", 0x8180 | RCODE_FORMERR, 0, 0, 0, 0)
    ident, flags, name, qtype, end = question
    found = service_of(name)
    address = lookup(*found) if found else None
    rcode = 0 if address else RCODE_NXDOMAIN
    records = b""
    if address and qtype == TYPE_A:
        # The name as a pointer to the question's (offset 12), TTL 5 s.
        records = struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, 5, 4) + ipaddress.IPv4Address(address).packed
    header = struct.pack("!HHHHHH", ident, 0x8180 | (flags & 0x0100) | rcode, 1, 1 if records else 0, 0, 0)
    return header + packet[12:end] + records


class Server(asyncio.DatagramProtocol):
    """UDP DNS on one address; lookups run in the loop's executor (they call the API server)."""

    def __init__(self, lookup: Callable[[str, str], str | None]) -> None:
        self.lookup = lookup
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        asyncio.get_running_loop().create_task(self._reply(data, addr))

    async def _reply(self, data: bytes, addr) -> None:
        response = await asyncio.get_running_loop().run_in_executor(None, answer, data, self.lookup)
        if response is not None and self.transport is not None:
            self.transport.sendto(response, addr)
