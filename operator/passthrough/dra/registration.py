"""How the kubelet finds the DRA driver: the registration service on a socket in
`<kubelet dir>/plugins_registry/`, which the kubelet's plugin watcher finds and asks GetInfo (type
DRAPlugin, the driver's name, its endpoint, the gRPC services it serves), then tells whether it
registered the driver; and the Unix sockets the driver's gRPC services are served on."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import grpc

from passthrough import unixgrpc
from passthrough.dra.kubeletapi.pluginregistration_v1 import api_pb2 as reg
from passthrough.dra.kubeletapi.pluginregistration_v1 import api_pb2_grpc as reg_grpc

log = logging.getLogger(__name__)

PLUGIN_TYPE = "DRAPlugin"
SOCKET_PATH_MAX = 107  # bytes of a Unix socket's path, at most (sun_path, less its NUL)


class DriverError(RuntimeError):
    """The driver cannot run at all; the message says what to do."""


class Registration(reg_grpc.RegistrationServicer):
    def __init__(self, driver: str, endpoint: Path, services: Iterable[str]) -> None:
        self.driver, self.endpoint, self.services = driver, Path(endpoint), list(services)
        self.registered = asyncio.Event()  # set once the kubelet says it registered the driver

    async def GetInfo(self, request, context) -> reg.PluginInfo:
        return reg.PluginInfo(type=PLUGIN_TYPE, name=self.driver, endpoint=str(self.endpoint), supported_versions=self.services)

    async def NotifyRegistrationStatus(self, request, context) -> reg.RegistrationStatusResponse:
        if request.plugin_registered:
            log.info("the kubelet registered DRA driver %s", self.driver)
            self.registered.set()
        else:
            log.error("the kubelet refused DRA driver %s: %s", self.driver, request.error)
        return reg.RegistrationStatusResponse()


async def serve_on(path: Path, servicer: Any, adds: Iterable[Callable[[Any, grpc.aio.Server], None]]) -> grpc.aio.Server:
    """A gRPC server of `servicer`'s services (`adds`) on the Unix socket `path`, started; the
    socket a previous run left is replaced. DriverError saying what to do when it cannot be."""
    if len(os.fsencode(str(path))) > SOCKET_PATH_MAX:
        raise DriverError(f"cannot serve on {path}: a Unix socket's path takes at most {SOCKET_PATH_MAX} bytes "
                          f"and this one has {len(os.fsencode(str(path)))}; use a shorter --kubelet-dir")  # fmt: skip
    try:
        return await unixgrpc.serve(path, servicer, adds)
    except OSError as exc:
        raise DriverError(str(exc)) from exc
