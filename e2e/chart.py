"""The Helm chart as tests install it: rendered by the real helm, its access objects applied.

The helm binary is the one e2e/build.py builds beside the control plane. What a test installs
for real is the chart's access control (service accounts, roles, bindings, the agent's
admission policies); the operator and the agent then run as processes with those accounts'
tokens, not as pods.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import yaml

from e2e import build, identities

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts/passthrough-operator"
# Who may do what: what a test applies of a rendered release.
ACCESS_KINDS = (
    "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding",
    "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
)  # fmt: skip

Helm = Callable[..., str]


def helm(home: Path) -> Helm:
    """A runner of the real helm with a throwaway home; returns stdout, fails with stderr.

    `run(..., refused=True)`: the command must fail; returns all it printed (lint writes its
    findings to stdout, the verdict to stderr).
    """
    binary = build.ensure_binaries() / "helm"
    env = {**os.environ, **{f"HELM_{kind}_HOME": str(home / kind.lower()) for kind in ("CACHE", "CONFIG", "DATA")}}

    def run(*args: str, refused: bool = False) -> str:
        result = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=60)
        if refused:
            assert result.returncode != 0, f"helm {' '.join(args)} succeeded:\n{result.stdout}"
            return result.stdout + result.stderr
        assert result.returncode == 0, f"helm {' '.join(args)}:\n{result.stderr}"
        return result.stdout

    return run


def template(helm: Helm, release: str, namespace: str, *flags: str) -> list[dict]:
    out = helm("template", release, str(CHART), f"--namespace={namespace}", *flags)
    return [d for d in yaml.safe_load_all(out) if d]


def webhook_configuration(helm: Helm, serving, *flags: str, kind: str = "ValidatingWebhookConfiguration") -> dict:
    """The chart's ValidatingWebhookConfiguration (or, with `kind`, its
    MutatingWebhookConfiguration), calling `serving` (an `e2e.processes.WebhookServing` on
    127.0.0.1) instead of the operator's Service; `flags` for helm
    (`--set=agent.devicePlugin.dra=true` adds the DRA webhooks)."""
    objects = template(helm, "passthrough", "passthrough-system", "--show-only=templates/webhook.yaml", *flags)
    [configuration] = [o for o in objects if o["kind"] == kind]
    return serving.point(configuration)


@contextlib.contextmanager
def webhooks_registered(cluster, configuration: dict) -> Iterator[dict]:
    """`configuration` (from `webhook_configuration`) created, and deleted after: the cluster is
    shared, and no later test may meet a webhook whose operator is gone."""
    cluster.kubectl("create", "-f", "-", input=json.dumps(configuration))
    try:
        yield configuration
    finally:
        cluster.kubectl("delete", "validatingwebhookconfiguration", configuration["metadata"]["name"], check=False)


def access(objects: list[dict]) -> list[dict]:
    return [o for o in objects if o["kind"] in ACCESS_KINDS]


@contextlib.contextmanager
def installed(cluster, objects: list[dict]) -> Iterator[list[dict]]:
    """Apply `objects` (server-side); delete them after, cluster-scoped and namespaced alike."""
    manifest = yaml.safe_dump_all(objects)
    try:
        cluster.kubectl("apply", "--server-side", "-f", "-", input=manifest)
        yield objects
    finally:
        cluster.kubectl("delete", "--ignore-not-found", "--wait=false", "-f", "-", input=manifest, check=False)


def wait_for_agent_policies(cluster, namespace: str, fullname: str, node: str, timeout: float = 20) -> None:
    """Until the API server enforces the release's agent policies (it loads new ones within seconds).

    Probed with server-side dry runs as the agent with a token bound to no pod: each policy
    refuses it for naming no node, and nothing is written.
    """
    token = identities.token(cluster, namespace, f"{fullname}-agent", duration="10m")
    device = {"apiVersion": "passthrough.io/v1alpha1", "kind": "NodePCIDevice",
              "metadata": {"name": f"probe-{fullname}", "labels": {"passthrough.io/node": node}}}  # fmt: skip
    probes = {
        f"{fullname}-agent-devices": (("create", "--dry-run=server", "-f", "-"), yaml.safe_dump(device)),
        f"{fullname}-agent-node": (("label", "node", node, "passthrough.io/probe=x", "--dry-run=server"), None),
    }
    deadline = time.monotonic() + timeout
    while probes:
        for policy, (args, body) in list(probes.items()):
            answer = cluster.kubectl(f"--token={token}", *args, input=body, check=False)
            if f"ValidatingAdmissionPolicy '{policy}'" in answer.stderr:
                del probes[policy]
            elif answer.returncode != 0 and "forbidden" not in answer.stderr.lower():
                raise AssertionError(f"probing {policy}: {answer.stderr}")
        if probes and time.monotonic() > deadline:
            raise AssertionError(f"the API server does not enforce {', '.join(probes)} after {timeout:.0f}s")
        time.sleep(0.2)
