"""`make run REALNODE=1`: a control plane and a real node (containerd, runc, CNI, kube-proxy), the
project's image imported into it, and the chart installed with `helm install` as the README says.

Prints `kubectl get pods -A` once the operator's Deployment and the agents' DaemonSet are rolled
out, and how to reach the cluster; Ctrl-C stops it all and leaves nothing behind.
"""

from __future__ import annotations

import signal
import sys
import time

from e2e.realnode import install
from e2e.realnode.node import RealNode, RealNodeError


def _say(line: str) -> None:
    print(line, flush=True)


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


def main() -> int:
    started = time.monotonic()
    # Ctrl-C and SIGTERM stop it even when started as a background job (which ignores SIGINT).
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    node = RealNode(name="real-node-1", project_image=True)
    try:
        _say("starting the control plane and a real node (containerd, runc, CNI, kube-proxy) ...")
        node.start()
        install.prepare_kubevirt(node)
        from e2e import image

        values = install.write_values(node.workdir, install.values(image.name()))
        _say(f"$ helm install {install.RELEASE} charts/passthrough-operator --namespace {install.NAMESPACE} --create-namespace --values {values}")
        _say(install.install(node, values))
        install.wait_rolled_out(node)
        _say(f"$ kubectl get pods -A   (ready in {time.monotonic() - started:.0f}s)")
        _say(node.kubectl("get", "pods", "-A", "-o", "wide").stdout)
        _say(f"export KUBECONFIG={node.kubeconfig}")
        _say(f"export PATH={node.bin_dir}:$PATH")
        _say(f"Logs: {node.logs}/ (the node's processes), kubectl logs for the pods.   Ctrl-C stops everything.")
        while True:
            signal.pause()
    except KeyboardInterrupt:
        return 0
    except RealNodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        _say("\nstopping ...")
        node.stop()
        left = node.leftovers()
        _say("stopped" if not left else f"stopped; the host still has: {left}")


if __name__ == "__main__":
    sys.exit(main())
