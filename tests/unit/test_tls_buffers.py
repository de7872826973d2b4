"""The agent's and the operator's TLS connections read into a 64 KiB buffer, not asyncio's 256 KiB
(memory: the agent's, and the operator's with its 64 connections).

The knob is a class attribute of asyncio's TLS protocol; this fails when a Python release
renames or stops reading it, so the saving cannot go away unnoticed.
"""

from __future__ import annotations

import asyncio
import ssl
from asyncio import sslproto

from passthrough.kube.connect import TLS_READ_BUFFER, smaller_tls_buffers


async def test_a_tls_connection_made_after_the_knob_reads_into_the_smaller_buffer(monkeypatch):
    # asyncio's own size, whatever an agent or operator run in this test process set before (restored after).
    monkeypatch.setattr(sslproto.SSLProtocol, "max_size", 256 * 1024)
    before = sslproto.SSLProtocol(asyncio.get_running_loop(), asyncio.Protocol(), ssl.create_default_context(), None)
    smaller_tls_buffers()
    after = sslproto.SSLProtocol(asyncio.get_running_loop(), asyncio.Protocol(), ssl.create_default_context(), None)
    assert len(before._ssl_buffer) == 256 * 1024  # the attribute is what a connection's buffer is made from
    assert len(after._ssl_buffer) == TLS_READ_BUFFER == 64 * 1024

