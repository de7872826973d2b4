"""`passthrough agent`: connect, check, and run the scan loop until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

from passthrough import metrics
from passthrough.agent import uevent
from passthrough.agent.bound import Bound
from passthrough.agent.handover import Handover
from passthrough.agent.loop import CONNECTIONS, Agent, AgentError
from passthrough.agent.metrics import AGENT, AGENT_STATE
from passthrough.agent.mode import Mode, chosen, kept
from passthrough.api.labels import DRA_MODE, MODE_LABEL, SERVING_LABEL
from passthrough.durations import DurationError, parse_duration
from passthrough.kube.client import ApiError, session_of
from passthrough.kube.connect import CannotStart, session, smaller_tls_buffers
from passthrough.kube.review import MetricsReviewer
from passthrough.pci.binder import Binder
from passthrough.pci.naming import EXCLUSIVE_DOMAIN
from passthrough.pci.pciids import PciIds

log = logging.getLogger("passthrough.agent")


async def _main(args: argparse.Namespace, rescan: float, deadline: float, jitter: float = 0.0) -> int:
    api = await session(args.kubeconfig, connections=CONNECTIONS)
    endpoint = None
    try:
        mode, node = await node_mode(api, args) if args.device_plugin else (None, None)
        metadata = (node or {}).get("metadata") or {}
        dra = mode is not None and mode.dra
        handover = None
        if args.device_plugin and not dra:  # one way to serve devices at a time
            handover = Handover(
                sysfs_root=Path(args.sysfs_root),
                dev_root=Path(args.dev_root),
                plugin_dir=Path(args.device_plugin_dir),
                pod_resources_socket=Path(args.pod_resources_socket),
                serve_pools=args.pool_resources,
                state_dir=Path(args.state_dir),
                write_deadline=deadline,
                binder_sockets=binder_sockets(args),
            )
            confine(handover.binder, args)
        agent = Agent(
            api,
            node_name=args.node_name,
            sysfs_root=Path(args.sysfs_root),
            proc_root=Path(args.proc_root),
            pci_ids=PciIds.load(args.pci_ids, host_root=args.host_root),
            rescan_interval=rescan,
            virtual_functions=args.sriov_virtual_functions,
            handover=handover,
            start_jitter=jitter,
        )
        AGENT_STATE.plugins = lambda: handover.plugins if handover is not None else None
        if mode is not None:
            agent.node.serving = mode.name  # the operator's word on what a device here needs
            if args.per_node_mode:  # a later change of the label is said, and waits for the next start
                agent.node.mode_label = (metadata.get("labels") or {}).get(MODE_LABEL, "")
            if mode.problem and metadata.get("uid"):
                involved = {"api_version": "v1", "kind": "Node", "name": args.node_name, "uid": metadata["uid"]}
                agent.reporter.events.post(involved, "Warning", mode.reason, mode.problem)
        try:
            endpoint = await metrics.serve(AGENT, args.metrics_port, args.metrics_addr,
                                           MetricsReviewer(api) if args.metrics_auth else None)  # fmt: skip
        except OSError as exc:
            raise AgentError(f"--metrics-port {args.metrics_port}: {exc}") from None
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, agent.trigger)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [asyncio.create_task(agent.run(), name="agent")]
        if dra:
            from passthrough.dra.driver import Driver  # gRPC and the DRA protos, for a DRA agent only

            driver = Driver(api, args.node_name, Path(args.sysfs_root), Path(args.proc_root), Path(args.dev_root),
                            agent.pci_ids, Path(args.kubelet_dir), Path(args.cdi_dir), rescan, args.sriov_virtual_functions,
                            deadline, binder_sockets=binder_sockets(args))  # fmt: skip
            confine(driver.binder, args)
            driver.preparer.on_drivers_moved = agent.trigger  # a prepare or give-back moved drivers: report them now
            loop.add_signal_handler(signal.SIGHUP, lambda: (agent.trigger(), driver.trigger()))
            # One server per device: what the driver finds other servers have, the agent reports.
            agent.other_servers, agent.on_node_change = (lambda: driver.others.elsewhere), driver.trigger
            driver.others.on_change = agent.trigger
            # The uninstall's give-back: the driver gives back, then the agent answers on the Node.
            agent.given_back_by, driver.on_given_back = (lambda: driver.given_back), agent.trigger
            tasks.append(asyncio.create_task(supervised("DRA driver", driver.run), name="dra"))
        if args.hotplug:
            tasks.append(asyncio.create_task(supervised("hotplug listener", lambda: uevent.listen(agent.trigger)), name="uevents"))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait([tasks[0], stopper], return_when=asyncio.FIRST_COMPLETED)
        stopper.cancel()
        return 0 if await stop_tasks(tasks) else 1
    finally:
        if endpoint is not None:
            await endpoint.cleanup()
        await api.close()


async def own_node(api, name: str) -> dict | None:
    """The agent's Node as the API server has it, None while it does not exist."""
    try:
        return await session_of(api).request("GET", f"/api/v1/nodes/{name}")
    except ApiError as exc:
        if exc.status == 404:
            return None
        raise


async def node_mode(api, args: argparse.Namespace) -> tuple[Mode, dict | None]:
    """This node's mode and its Node as read then (None while there is none), read once: the
    Node's passthrough.io/mode label where nodes may choose (`--per-node-mode`), `--dra` otherwise
    or where the label names no mode; where nodes choose, the mode it served in while that mode's
    users hold its devices (`mode.kept`). Why the label is not followed is said in the log and,
    once the agent runs, as a Warning Event on the Node."""
    try:
        node = await own_node(api, args.node_name)
    except ApiError as exc:
        if args.per_node_mode:  # a guess could serve the node in the mode it was taken out of
            raise AgentError(f"cannot read Node {args.node_name} for its passthrough.io/mode label: {exc}") from None
        node = None
    labels = ((node or {}).get("metadata") or {}).get("labels") or {}
    mode = chosen(labels, args.dra, args.per_node_mode, args.node_name)
    if mode.problem:
        log.warning("%s", mode.problem)
    serving = labels.get(SERVING_LABEL, "")
    # Only where nodes choose: there the chart renders both modes' mounts and access for every node,
    # so the agent can stay in the mode it served in (a cluster-wide switch renders one mode's).
    if args.per_node_mode and serving and serving != mode.name:
        switched = kept(mode, serving, await held_as(serving, args), args.node_name)
        if switched != mode:
            mode = switched
            log.warning("%s", mode.problem)
    log.info("serving devices %s", "as the DRA driver pci.passthrough.io" if mode.dra else "through device plugins")
    return mode, node


async def held_as(serving: str, args: argparse.Namespace) -> list[str]:
    """What still holds devices this node served in mode `serving`: the claims its DRA driver
    prepared (its checkpoint), or the pods holding resources of its device plugins (the kubelet's
    PodResources: of our resources, of devices the last agent bound, or of a resource no plugin serves
    now, as ours stopped with the last agent)."""
    if serving == DRA_MODE:
        from passthrough.dra.prepared import load_checkpoint  # the DRA driver's record, for a switch from DRA only
        from passthrough.dra.slice import DRIVER

        prepared = load_checkpoint(Path(args.kubelet_dir) / "plugins" / DRIVER)
        return sorted(f"claim {c.namespace}/{c.name}" for c in prepared.values())
    from passthrough.deviceplugin import podresources  # gRPC, for a switch from device plugins only

    try:
        kubelet = await podresources.view(Path(args.pod_resources_socket))
    except podresources.PodResourcesUnavailable as exc:
        log.warning("cannot ask the kubelet which pods hold this node's devices (%s): switching modes as if none did", exc)
        return []
    served = {name for names in kubelet.allocatable.values() for name in names}
    bound = Bound(Path(args.state_dir)).devices  # what the device plugins' agent bound: its pools' GPUs too
    return sorted({f"pod {h.namespace}/{h.pod} ({h.resource})" for device, holders in kubelet.holders.items() for h in holders
                   if h.resource.startswith(f"{EXCLUSIVE_DOMAIN}/") or device in bound or h.resource not in served})  # fmt: skip


def binder_sockets(args: argparse.Namespace) -> list[Path]:
    """The binder containers, in order of preference (none: the agent's own child writes sysfs)."""
    return [Path(socket) for socket in args.binder_socket or ()]


def confine(binder: Binder, args: argparse.Namespace) -> None:
    """The binder child judges each job by discovery's rules on the agent's own /proc and flags
    (a binder container has its own, on its command line)."""
    binder.proc_root, binder.virtual_functions = Path(args.proc_root), args.sriov_virtual_functions


# Seconds the agent's tasks may take to end once cancelled (their `finally`: stopping the device
# plugins, the binder's children, the last Events), well inside a pod's 30 s of grace.
STOP_GRACE = 10.0


async def stop_tasks(tasks: list[asyncio.Task], grace: float = STOP_GRACE) -> bool:
    """Cancel the tasks and wait at most `grace` seconds for them; False, said in the log, if one
    is still running then: a task that lost its cancellation must not hold the agent up
    unnoticed (asyncio.run then cancels it once more on the way out). Re-raises AgentError from
    a task that failed to start."""
    for task in tasks:
        task.cancel()
    done, running = await asyncio.wait(tasks, timeout=grace)
    if running:
        log.error("%s still running %gs after it was told to stop; cancelling it once more",
                  ", ".join(sorted(t.get_name() for t in running)), grace)  # fmt: skip
    for task in tasks:
        if task in done and not task.cancelled():
            task.result()  # re-raises AgentError from a failed start
    return not running


async def supervised(what: str, start: Callable[[], Awaitable[None]], backoff: float = 1.0) -> None:
    """Run `start()` again whenever it fails, saying so: a helper task must not die unnoticed.

    One that returns has nothing more to do (the hotplug socket cannot be had here).
    """
    delay = backoff
    while True:
        try:
            await start()
            return
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("%s failed (%s: %s); starting it again in %.0fs", what, type(exc).__name__, exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 60)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.node_name = args.node_name or os.environ.get("NODE_NAME", "")
    if not args.node_name:
        print("passthrough agent: no node name: pass --node-name or set NODE_NAME", file=sys.stderr)
        return 2
    try:
        rescan = parse_duration(args.rescan_interval)
    except DurationError as exc:
        print(f"passthrough agent: --rescan-interval: {exc}", file=sys.stderr)
        return 2
    try:
        deadline = parse_duration(args.write_deadline)
    except DurationError as exc:
        print(f"passthrough agent: --write-deadline: {exc}", file=sys.stderr)
        return 2
    try:
        # In a pod, a DaemonSet's: its agents start together. Elsewhere (a developer's, a test's) at once.
        in_pod = bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
        text = args.start_jitter or ("10s" if in_pod else "0")
        jitter = 0.0 if text.strip() in ("0", "0s") else parse_duration(text)
    except DurationError as exc:
        print(f"passthrough agent: --start-jitter: {exc}", file=sys.stderr)
        return 2
    smaller_tls_buffers()
    try:
        return asyncio.run(_main(args, rescan, deadline, jitter))
    except (AgentError, CannotStart) as exc:
        print(f"passthrough agent: {exc}", file=sys.stderr)
        return 1
