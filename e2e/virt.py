"""KubeVirt's own programs against the local control plane: virt-operator's install generator,
virt-api and virt-controller, built from KubeVirt's Go module at the release
`e2e/kubevirt_controllers/go.mod` pins (unmodified, through the Go module proxy).

- `install_manifest(namespace)`: what virt-operator installs for a KubeVirt CR in `namespace`,
  from its own install strategy (`install/main.go`): the CRDs, virt-api's webhook
  configurations, the two Deployments. `e2e/kubevirt.py` installs the CRDs from it.
- `KubeVirtControllers`: virt-api and virt-controller as processes on 127.0.0.1, with
  virt-operator's own KubeVirt CR webhooks (`validator/main.go`: its create, update and delete
  admitters; its update validator refuses a gate in both featureGates and disabledFeatureGates),
  every webhook registered as virt-operator registers it, pointed at the process serving it.
  They read the KubeVirt CR of their namespace (`kubevirt`), which the operator configures.

Where the chain stops: virt-handler and virt-launcher do not run (they need libvirt and a
node's /dev/kvm). What they would do for the rest of the chain is done by the caller: a node
is marked `kubevirt.io/schedulable=true` with the capacity of KubeVirt's own device plugins
(`mark_node`), as virt-handler would; the launcher pod virt-controller makes is run by the
kubelet with the stand-in runtime, so its compute container is created but runs nothing.
What virt-operator does around the programs is done here too, in its place: virt-api's
serving certificate (for 127.0.0.1, in a file, as KubeVirt reads its mounted Secret), the CA
ConfigMap, the KubeVirt CR's status (phase Deployed and the default architecture, which
virt-api and virt-controller read), and the request-header CA virt-api insists on finding in
`kube-system/extension-apiserver-authentication` (an aggregated API server's setting; the
subresource API itself is not registered, so `virtctl start` is not available: VMs start by
`runStrategy`). virt-api and virt-controller make their requests as the service accounts
virt-operator gives them (impersonated, with the admin's rights): virt-api keeps a VMI status
change only from KubeVirt's own accounts, so as the admin virt-controller could never move a
VMI past `Pending`.

The binaries are built as every Go program of the suite is (`e2e/gobuild.py`), cached beside
the control plane's, keyed by the Go release and the module's files.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import platform
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from e2e import build, gobuild
from e2e.cluster import _die_with_parent, free_ports

MODULE = Path(__file__).resolve().parent / "kubevirt_controllers"
NAMESPACE = "kubevirt"  # where virt-api and virt-controller look for their KubeVirt CR (no service account file here)
PACKAGES = {
    "kubevirt-install": "./install",
    "kubevirt-validator": "./validator",
    "virt-api": "kubevirt.io/kubevirt/cmd/virt-api",
    "virt-controller": "kubevirt.io/kubevirt/cmd/virt-controller",
}
# Registered by virt-operator only while a feature gate asks for it.
GATED_WEBHOOKS = frozenset({"virt-launcher-pod-mutator"})
SCHEDULABLE = "kubevirt.io/schedulable"
MACHINE_TYPE_LABEL = "machine-type.node.kubevirt.io/q35"
GOARCH = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())  # virt-operator's runtime.GOARCH
# What virt-handler's device plugins advertise on a node: every launcher pod asks for kvm, and
# for tun and vhost-net when it has a pod network interface.
NODE_CAPACITY = {"devices.kubevirt.io/kvm": "1k", "devices.kubevirt.io/tun": "1k", "devices.kubevirt.io/vhost-net": "1k"}


def kubevirt_version() -> str:
    return gobuild.required_version(MODULE, "kubevirt.io/kubevirt")


def cache_key() -> str:
    """The Go release, the module's go.mod and go.sum and every source in it (ours and the
    third-party copies): a change to any means new binaries."""
    digest = hashlib.sha256(gobuild.go_version().encode())
    paths = sorted([MODULE / "go.mod", MODULE / "go.sum", *MODULE.rglob("*.go"), *MODULE.rglob("go.mod")])
    gobuild.hash_files(digest, paths, MODULE)
    digest.update(json.dumps(PACKAGES, sort_keys=True).encode())
    return digest.hexdigest()[:12]


def cache_dir() -> Path:
    return gobuild.cache_root() / "kubevirt" / f"kubevirt-{kubevirt_version()}-{cache_key()}"


def ensure_binaries() -> Path:
    """The directory of the programs, built first when the cache lacks them (a first build takes
    minutes). Raises build.BuildError (no `go`, a failed build) with a message that says what to do."""
    program = gobuild.Program(MODULE, PACKAGES)
    return gobuild.ensure(gobuild.GoBuild("kubevirt", f"KubeVirt {kubevirt_version()}'s programs", cache_dir(), (program,)))


def install_manifest(namespace: str = NAMESPACE) -> dict[str, Any]:
    """virt-operator's install strategy for a KubeVirt CR in `namespace` (kept beside the binaries)."""
    bin_dir = ensure_binaries()
    cached = bin_dir.parent / f"install-{namespace}.json"
    if cached.is_file():
        return json.loads(cached.read_text())
    proc = subprocess.run([str(bin_dir / "kubevirt-install"), namespace], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise build.BuildError(f"virt-operator's install generator failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    partial = cached.with_name(f"{cached.name}.partial-{os.getpid()}")
    partial.write_text(proc.stdout)
    partial.rename(cached)
    return json.loads(proc.stdout)


def _container_args(deployments: list[dict], container: str) -> list[str]:
    """The arguments virt-operator's Deployment gives `container`, less those that name files
    or addresses of a pod (set here for a process on loopback)."""
    [deployment] = deployments
    [spec] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == container]
    return list(spec.get("args") or [])


class KubeVirtControllers:
    """virt-api and virt-controller of the pinned release against `cluster`, each its own process.

    `start()` returns once virt-api serves (its webhooks registered) and virt-controller leads;
    `stop()` takes the webhook configurations away first, so no later request meets a webhook
    whose server is gone.
    """

    def __init__(self, cluster, workdir: Path) -> None:
        from e2e.processes import WebhookServing

        self.cluster, self.workdir = cluster, Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.serving = WebhookServing(self.workdir / "tls")
        self.manifest = install_manifest(NAMESPACE)
        self.bin_dir = ensure_binaries()
        self.procs: dict[str, subprocess.Popen] = {}
        self.webhooks: list[tuple[str, str]] = []  # (kind, name) registered

    def log(self, name: str) -> Path:
        return self.workdir / f"{name}.log"

    def output(self, name: str) -> str:
        path = self.log(name)
        return path.read_text(errors="replace") if path.exists() else ""

    # -- what virt-operator would have done --------------------------------------------------

    def _prepare(self) -> None:
        kubectl = self.cluster.kubectl
        kubectl("create", "namespace", NAMESPACE, check=False)
        # virt-api refuses to start without a request-header CA in the API server's
        # authentication ConfigMap; the API server keeps keys it finds there (it merges CAs).
        ca = self.cluster.ca_file.read_text()
        kubectl("patch", "configmap", "extension-apiserver-authentication", "-n", "kube-system", "--type=merge", "-p",
                json.dumps({"data": {"requestheader-client-ca-file": ca, "requestheader-username-headers": '["X-Remote-User"]',
                                     "requestheader-group-headers": '["X-Remote-Group"]',
                                     "requestheader-extra-headers-prefix": '["X-Remote-Extra-"]'}}))  # fmt: skip
        kubectl("apply", "--server-side", "--field-manager=virt-operator", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "kubevirt-ca", "namespace": NAMESPACE},
            "data": {"ca-bundle": self.serving.ca.decode()},
        }))  # fmt: skip

    def _deployed(self) -> None:
        """The KubeVirt CRs of the namespace reported Deployed, as virt-operator reports its
        install done: virt-api and virt-controller read their configuration only from a CR
        with a phase, and take the VMs' default architecture from its status."""
        listed = json.loads(self.cluster.kubectl("get", "kubevirts", "-n", NAMESPACE, "-o", "json").stdout)["items"]
        for kv in listed:
            status = {"status": {"phase": "Deployed", "defaultArchitecture": GOARCH}}
            self.cluster.kubectl("patch", "kubevirt", kv["metadata"]["name"], "-n", NAMESPACE, "--subresource=status",
                                 "--type=merge", "-p", json.dumps(status))  # fmt: skip

    def _register_webhooks(self, ports: dict[str, int]) -> None:
        """virt-operator's webhook configurations, each webhook pointed at the process that
        serves its Service (`ports`: Service name -> port on 127.0.0.1). A configuration
        virt-operator registers only with a feature gate on (the launcher pod's, for
        ContainerPathVolumes) or for a program not run here (virt-template's) is left out."""
        ca = base64.b64encode(self.serving.ca).decode()
        for key, kind in (("mutatingWebhookConfigurations", "mutatingwebhookconfiguration"),
                          ("validatingWebhookConfigurations", "validatingwebhookconfiguration")):  # fmt: skip
            for configuration in self.manifest[key] or []:
                if configuration["metadata"]["name"] in GATED_WEBHOOKS:
                    continue
                services = {w["clientConfig"]["service"]["name"] for w in configuration["webhooks"]}
                if not services <= ports.keys():
                    continue
                for webhook in configuration["webhooks"]:
                    service = webhook["clientConfig"]["service"]
                    webhook["clientConfig"] = {"url": f"https://127.0.0.1:{ports[service['name']]}{service.get('path', '/')}",
                                               "caBundle": ca}  # fmt: skip
                configuration["metadata"].pop("creationTimestamp", None)
                self.cluster.kubectl("apply", "--server-side", "--field-manager=virt-operator", "-f", "-",
                                     input=json.dumps(configuration))  # fmt: skip
                self.webhooks.append((kind, configuration["metadata"]["name"]))

    # -- the processes ---------------------------------------------------------------------

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        with self.log(name).open("ab") as log:
            proc = subprocess.Popen([str(self.bin_dir / name), *args], stdout=log, stderr=subprocess.STDOUT,
                                    env={**os.environ, "KUBEVIRT_VERSION": kubevirt_version()}, cwd=self.workdir,
                                    start_new_session=True, preexec_fn=_die_with_parent)  # fmt: skip
        self.procs[name] = proc
        return proc

    def _wait(self, name: str, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}; its log ends:\n{self.output(name)[-4000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} not ready after {timeout:.0f}s; its log ends:\n{self.output(name)[-4000:]}")
            time.sleep(0.2)

    def _serves_tls(self, port: int) -> bool:
        context = ssl.create_default_context(cadata=self.serving.ca.decode())
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            with context.wrap_socket(sock, server_hostname="127.0.0.1"):
                return True
        return False

    def _kubeconfig_as(self, account: str) -> Path:
        """The cluster's kubeconfig, each request made as KubeVirt's service account `account` of
        NAMESPACE (impersonated, with the admin's rights: virt-operator's RBAC is not installed).
        virt-api's VMI mutator keeps a status change only from KubeVirt's own service accounts:
        as any other user, virt-controller's phase changes are reverted and a VMI stays Pending."""
        config = yaml.safe_load(self.cluster.kubeconfig.read_text())
        for user in config["users"]:
            user["user"].update({"as": f"system:serviceaccount:{NAMESPACE}:{account}",
                                 "as-groups": ["system:masters", "system:authenticated"]})  # fmt: skip
        path = self.workdir / f"kubeconfig-{account}"
        path.write_text(yaml.safe_dump(config))
        return path

    def start(self, timeout: float = 120) -> KubeVirtControllers:
        self._prepare()
        self._deployed()
        common = ["--listen=127.0.0.1"]
        tls = self.serving.directory
        api_port = self.serving.port  # the port the webhook configurations are pointed at
        console_port, controller_port = free_ports(2)
        self._spawn("virt-api", [
            *_container_args(self.manifest["apiDeployments"], "virt-api"), *common, f"--port={api_port}",
            f"--kubeconfig={self._kubeconfig_as('kubevirt-apiserver')}",
            f"--console-server-port={console_port}", f"--tls-cert-file={tls / 'tls.crt'}", f"--tls-key-file={tls / 'tls.key'}",
            f"--handler-cert-file={tls / 'tls.crt'}", f"--handler-key-file={tls / 'tls.key'}",
        ])  # fmt: skip
        self._wait("virt-api", lambda: self._serves_tls(api_port), timeout)
        validator_port = free_ports(1)[0]
        self._spawn("kubevirt-validator", [
            f"--kubeconfig={self.cluster.kubeconfig}", f"--listen=127.0.0.1:{validator_port}", f"--namespace={NAMESPACE}",
            f"--tls-cert-file={tls / 'tls.crt'}", f"--tls-key-file={tls / 'tls.key'}",
        ])  # fmt: skip
        self._wait("kubevirt-validator", lambda: self._serves_tls(validator_port), timeout)
        self._register_webhooks({"virt-api": api_port, "kubevirt-operator-webhook": validator_port})
        self._spawn("virt-controller", [
            *_container_args(self.manifest["controllerDeployments"], "virt-controller"), *common, f"--port={controller_port}",
            f"--kubeconfig={self._kubeconfig_as('kubevirt-controller')}",
            f"--prom-cert-file={tls / 'tls.crt'}", f"--prom-key-file={tls / 'tls.key'}",
        ])  # fmt: skip
        self._wait("virt-controller", lambda: "STARTING controllers" in self.output("virt-controller"), timeout)
        return self

    def stop(self) -> None:
        for kind, name in reversed(self.webhooks):
            self.cluster.kubectl("delete", kind, name, "--ignore-not-found", check=False)
        self.webhooks.clear()
        for name, proc in reversed(list(self.procs.items())):
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(5)
        self.procs.clear()

    def __enter__(self) -> KubeVirtControllers:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def mark_node(cluster, node: str) -> None:
    """What virt-handler does for a node it runs on, which launcher pods need to be scheduled
    there: the `kubevirt.io/schedulable` label, its node labeller's machine type (the default,
    q35, which every launcher pod selects), and its device plugins' capacity."""
    cluster.kubectl("label", "node", node, f"{SCHEDULABLE}=true", f"{MACHINE_TYPE_LABEL}=true", "--overwrite")
    patch = {"status": {"capacity": NODE_CAPACITY}}
    cluster.kubectl("patch", "node", node, "--subresource=status", "--type=merge", "-p", json.dumps(patch))


def main() -> int:
    return gobuild.main("kubevirt", ensure_binaries)


if __name__ == "__main__":
    sys.exit(main())
