"""Real identities for tests: service-account tokens the API server issues, in kubeconfigs.

Each identity is a separate user to the API server (`system:serviceaccount:<ns>:<name>`),
authenticated and authorized for real, so RBAC, admission policies and webhooks see who
asks. A token bound to a Pod scheduled on a node carries that node's name in
`request.userInfo.extra["authentication.kubernetes.io/node-name"]`, as a DaemonSet pod's
token does.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


def kubeconfig_with_token(cluster, token: str, path: Path) -> Path:
    """The cluster's kubeconfig, logging in with `token` instead of the admin's."""
    config = yaml.safe_load(cluster.kubeconfig.read_text())
    config["users"] = [{"name": "service-account", "user": {"token": token}}]
    config["contexts"][0]["context"]["user"] = "service-account"
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


def service_account(cluster, namespace: str, name: str) -> str:
    """Create the ServiceAccount (if missing); returns its user name."""
    cluster.kubectl("create", "serviceaccount", name, "-n", namespace, check=False)
    return f"system:serviceaccount:{namespace}:{name}"


def token(cluster, namespace: str, name: str, bound_pod: str | None = None, duration: str = "1h") -> str:
    """A token of the ServiceAccount; bound to `bound_pod` (of the same namespace) when given."""
    args = ["create", "token", name, "-n", namespace, f"--duration={duration}"]
    if bound_pod:
        args += ["--bound-object-kind=Pod", f"--bound-object-name={bound_pod}"]
    return cluster.kubectl(*args).stdout.strip()


def pod_on_node(cluster, namespace: str, name: str, node: str, service_account_name: str) -> None:
    """A Pod object placed on `node` (nothing runs it): what a node-bound token is bound to."""
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "nodeName": node,
            "serviceAccountName": service_account_name,
            "automountServiceAccountToken": False,
            "containers": [{"name": "agent", "image": "passthrough-operator:test"}],
        },
    }
    cluster.kubectl("apply", "-f", "-", input=json.dumps(pod))


def user_kubeconfig(cluster, namespace: str, name: str, path: Path, bound_pod: str | None = None) -> Path:
    """A kubeconfig of the ServiceAccount `namespace/name` (created if missing)."""
    service_account(cluster, namespace, name)
    return kubeconfig_with_token(cluster, token(cluster, namespace, name, bound_pod), path)


@dataclass(frozen=True)
class Identity:
    """A user of the cluster: its user name and a kubeconfig that logs in as it."""

    cluster: Any
    user: str
    kubeconfig: Path

    def kubectl(self, *args: str, input: str | None = None) -> subprocess.CompletedProcess:
        """kubectl as this user (never raises: refusals are what tests look at)."""
        return self.cluster.kubectl(f"--kubeconfig={self.kubeconfig}", *args, input=input, check=False)

    def can_i(self, verb: str, resource: str, *flags: str) -> bool:
        """`kubectl auth can-i`, asked by the user itself (a SelfSubjectAccessReview: RBAC's answer)."""
        return self.kubectl("auth", "can-i", verb, resource, *flags).stdout.strip() == "yes"


def identity(cluster, namespace: str, name: str, folder: Path, bound_pod: str | None = None) -> Identity:
    """The ServiceAccount `namespace/name` (created if missing) as a user, its kubeconfig in `folder`."""
    path = user_kubeconfig(cluster, namespace, name, folder / f"{namespace}.{name}.{bound_pod or 'sa'}.kubeconfig", bound_pod)
    return Identity(cluster, f"system:serviceaccount:{namespace}:{name}", path)


def bind(cluster, who: Identity, cluster_role: str, namespace: str | None = None) -> str:
    """Grant `cluster_role` to `who`: in `namespace` (a RoleBinding), else cluster-wide; returns the binding's name."""
    _, _, account_ns, account = who.user.split(":")
    name = f"{account_ns}.{account}.{cluster_role}"
    if namespace:
        cluster.kubectl("create", "rolebinding", name, f"--clusterrole={cluster_role}", f"--serviceaccount={account_ns}:{account}",
                        "-n", namespace)  # fmt: skip
    else:
        cluster.kubectl("create", "clusterrolebinding", name, f"--clusterrole={cluster_role}",
                        f"--serviceaccount={account_ns}:{account}")  # fmt: skip
    return name
