"""The Helm chart's values as models, and its values.schema.json generated from them.

The platform values (`kubevirt`, `gpu`, `devices`) are the PassthroughConfig's spec, so their
schema is the CRD's own (the same structural schema `crds.py` writes), closed to unknown keys.
How the operator and the agents run is described by the models below. Helm checks values
against the schema on lint, template, install and upgrade, and refuses a misspelt key or a
wrong type with a message naming it, where the templates would silently ignore it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from passthrough.api.crds import structural_schema
from passthrough.api.models import DNS1123_LABEL, PassthroughConfigSpec

SCHEMA_DRAFT = "http://json-schema.org/draft-07/schema#"
VALUES_SCHEMA = Path("charts/passthrough-operator/values.schema.json")

# What `passthrough.durations` reads: 300, 90s, 5m, 1h30m.
DURATION = r"^([0-9]+(\.[0-9]+)?|([0-9]+(\.[0-9]+)?(ms|h|m|s))+)$"
# Prometheus' own durations (a ServiceMonitor's interval): 30s, 1m, 1h30m.
PROMETHEUS_DURATION = r"^(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?$"

Port = Annotated[int, Field(ge=1, le=65535)]
Labels = dict[str, str]


class Values(BaseModel):
    """A part of the values: every key is known, so a misspelt one is an error."""

    model_config = ConfigDict(extra="forbid")


class ConfigValues(Values):
    create: bool = Field(
        description="Render the `cluster` PassthroughConfig from kubevirt, gpu and devices; false when "
        "something else owns that object (GitOps, a platform's own package)."
    )


class ImageValues(Values):
    repository: str = Field(min_length=1, description="Image of the operator and the agent, without its tag.")
    tag: str = Field(default="", description="Image tag; empty: the chart's appVersion.")
    pullPolicy: Literal["Always", "IfNotPresent", "Never"] = Field(description="The containers' imagePullPolicy.")


class SecretRef(Values):
    name: str = Field(min_length=1, description="A kubernetes.io/dockerconfigjson Secret in the release's namespace.")


class Resources(Values):
    """The container's resources (requests and limits), as in a pod spec."""

    requests: dict[str, str | float] | None = Field(default=None, description="Requested cpu, memory, ...")
    limits: dict[str, str | float] | None = Field(default=None, description="Limits of cpu, memory, ...")
    claims: list[dict[str, Any]] | None = Field(default=None, description="Dynamic resource claims, as in a pod spec.")


class Toleration(Values):
    """A toleration, as in a pod spec."""

    key: str = Field(default="", description="Taint key; empty with operator Exists: every taint.")
    operator: Literal["Exists", "Equal"] = Field(default="Equal", description="Exists or Equal.")
    value: str = Field(default="", description="Taint value, with operator Equal.")
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = Field(
        default="", description="Taint effect; empty: every effect."
    )
    tolerationSeconds: int | None = Field(default=None, description="How long a NoExecute taint is tolerated.")


class Affinity(Values):
    """Scheduling constraints, as in a pod spec."""

    nodeAffinity: dict[str, Any] | None = Field(default=None, description="As in a pod spec.")
    podAffinity: dict[str, Any] | None = Field(default=None, description="As in a pod spec.")
    podAntiAffinity: dict[str, Any] | None = Field(default=None, description="As in a pod spec.")


class PodValues(Values):
    """Where and how a component's pods run; the keys both components share."""

    extraArgs: list[str] = Field(default_factory=list, description="Extra command-line flags, e.g. [--verbose].")
    resources: Resources | None = Field(default=None, description="The container's requests and limits.")
    tolerations: list[Toleration] | None = Field(default=None, description="Taints its pods tolerate.")
    priorityClassName: str = Field(default="", description="PriorityClass of its pods; empty: none.")
    podAnnotations: dict[str, str] | None = Field(default=None, description="Annotations of its pods.")
    nodeSelector: dict[str, str] | None = Field(default=None, description="Labels of the nodes its pods may run on.")


class OperatorValues(PodValues):
    """The operator's Deployment: every replica serves the webhooks, the holder of the Lease reconciles."""

    replicas: int = Field(ge=1, description="Replicas; two or more keep the webhooks answering while one restarts.")
    workers: int = Field(ge=1, description="Devices reconciled in parallel.")
    livenessPort: Port = Field(description="Port of Kopf's liveness endpoint, which the liveness probe reads.")
    readinessPort: Port = Field(description="Port of the readiness endpoint: ready once the webhooks listen and the caches are filled.")
    affinity: Affinity | None = Field(
        default=None, description="The operator pod's scheduling constraints; empty: replicas preferably on different nodes."
    )


class IssuerRef(Values):
    """cert-manager's issuerRef; empty: a CA of the chart's own, through a CA Issuer."""

    # `{}` is the default, so `name` is required only once another key is given.
    model_config = ConfigDict(json_schema_extra={"dependencies": {"kind": ["name"], "group": ["name"]}})

    name: str = Field(default="", description="Name of the Issuer or ClusterIssuer.")
    kind: str = Field(default="Issuer", description="Issuer or ClusterIssuer.")
    group: str = Field(default="cert-manager.io", description="API group of the issuer.")


class CertManagerValues(Values):
    enabled: bool = Field(description="cert-manager issues the certificate and its CA injector sets the caBundle.")
    issuerRef: IssuerRef | None = Field(
        default=None, description="The issuer that signs it; empty: a CA of the chart's own (self-signed), through a CA Issuer."
    )


class WebhookValues(Values):
    """The admission webhooks, served by the operator over HTTPS."""

    enabled: bool = Field(description="Register and serve the validating admission webhooks.")
    port: Port = Field(description="The operator's HTTPS port; its Service listens on 443.")
    timeoutSeconds: int = Field(ge=1, le=30, description="How long the API server waits for an answer (1 to 30).")
    certManager: CertManagerValues = Field(description="The serving certificate: generated by the chart, or by cert-manager.")


class DevicePluginValues(Values):
    enabled: bool = Field(
        description="Bind devices to vfio-pci and serve them to the kubelet; false: only report devices."
    )
    poolResources: bool = Field(
        description="Serve GPU pools (nvidia.com/...); false where NVIDIA's sandbox device plugin serves them."
    )
    dra: bool = Field(
        default=False,
        description="Dynamic Resource Allocation instead of device plugins (beta): publish ResourceSlices and serve "
        "the kubelet's DRA plugin API as driver pci.passthrough.io; claims name the devices.",
    )
    perNode: bool = Field(
        default=False,
        description="Each node chooses with its label passthrough.io/mode (dra or device-plugin), read when its agent "
        "starts; `dra` is the default of nodes without it. The DRA mounts, RBAC, webhooks and KubeVirt gates are "
        "rendered, and KubeVirt keeps the entries of devices on device-plugin nodes.",
    )


class AppArmorProfile(Values):
    """An AppArmor profile, as in a container's securityContext."""

    type: Literal["RuntimeDefault", "Unconfined", "Localhost"] | None = Field(
        default=None, description="RuntimeDefault, Unconfined, or Localhost (a profile loaded on the node)."
    )
    localhostProfile: str | None = Field(default=None, description="The loaded profile's name, with type Localhost.")


class AgentValues(PodValues):
    """The node agents' DaemonSet."""

    rescanInterval: Annotated[str, Field(pattern=DURATION)] | Annotated[float, Field(gt=0)] = Field(
        description="Periodic rescan besides hotplug events, SIGHUP and (re)assignments: 300, 90s, 5m, 1h30m."
    )
    hotplug: bool = Field(description="Listen for kernel hotplug uevents.")
    hostNetwork: bool = Field(
        description="Run in the host's network namespace: only for kernels before 4.18, whose hotplug uevents reach no other."
    )
    appArmorProfile: AppArmorProfile = Field(
        description="The agent container's AppArmor profile; empty: the runtime's default (a node without AppArmor "
        "refuses pods that name one)."
    )
    recursiveReadOnly: Literal["Enabled", "IfPossible", "Disabled"] = Field(
        description="The host's /sys and /proc read-only with every mount below them (Enabled: the kubelet refuses the "
        "pod where the runtime cannot), where possible (IfPossible), or only the top mount (Disabled)."
    )
    devicePlugin: DevicePluginValues = Field(description="What the agent does besides reporting devices.")
    binderResources: Resources | None = Field(
        default=None,
        description="The requests and limits of each binder container, binder and binder-standby (they write "
        "sysfs for the agent).",
    )


class ServiceMonitorValues(Values):
    enabled: bool = Field(description="Create a ServiceMonitor (Prometheus Operator) for the metrics Services.")
    interval: str = Field(pattern=PROMETHEUS_DURATION, min_length=2, description="Scrape interval, e.g. 30s.")
    labels: Labels = Field(description="Labels of the ServiceMonitor, for the Prometheus that selects it.")


class DashboardValues(Values):
    enabled: bool = Field(description="Ship the Grafana dashboard as a ConfigMap.")
    labels: Labels = Field(description="Labels of the ConfigMap, for Grafana's dashboard sidecar.")


class MetricsValues(Values):
    """Prometheus metrics, served by the operator and by every agent."""

    enabled: bool = Field(description="Serve metrics and make a Service for them.")
    authentication: bool = Field(
        description="Serve the metrics only to a bearer token whose user may get /metrics (TokenReview, "
        "SubjectAccessReview); the chart's <release>-metrics-reader ClusterRole grants it."
    )
    operatorPort: Port = Field(description="The operator's metrics port.")
    agentPort: Port = Field(description="The agents' metrics port (on each agent pod's address).")
    serviceMonitor: ServiceMonitorValues = Field(description="A ServiceMonitor for the Prometheus Operator.")
    dashboard: DashboardValues = Field(description="A Grafana dashboard of these metrics.")


class UninstallValues(Values):
    """What `helm uninstall` does besides deleting the chart's objects."""

    keepDevices: bool = Field(
        description="Leave every device the agents bound on vfio-pci (for VMs that go on using them without the "
        "operator); false: a pre-delete hook has the agents give back each one that no VM or pod holds."
    )
    giveBackTimeout: Annotated[int, Field(ge=1)] = Field(
        description="Seconds that hook waits for every node's answer; helm uninstall waits for a hook up to its own "
        "--timeout (5m by default)."
    )


class RuntimeValues(Values):
    """How the operator and the node agents run: every key of the values but the platform values."""

    config: ConfigValues = Field(description="The `cluster` PassthroughConfig made from the platform values.")
    image: ImageValues = Field(description="One image for the operator and the agent.")
    imagePullSecrets: list[SecretRef] = Field(default_factory=list, description="Secrets to pull the image with.")
    fullnameOverride: str = Field(
        default="",
        max_length=50,
        pattern=f"^$|{DNS1123_LABEL}",
        description="Name prefix of every object (default: the release name, with -passthrough appended unless "
        "it has passthrough in it).",
    )
    operator: OperatorValues = Field(description="The operator's Deployment.")
    webhook: WebhookValues = Field(description="The admission webhooks the operator serves.")
    agent: AgentValues = Field(description="The node agents' DaemonSet.")
    metrics: MetricsValues = Field(description="Prometheus metrics of the operator and the agents.")
    uninstall: UninstallValues = Field(description="What helm uninstall does with the devices the agents bound.")
    global_: dict[str, Any] = Field(
        default_factory=dict,
        alias="global",
        description="Values Helm shares with subcharts: a parent chart's pass through here; this chart reads none.",
    )


# PassthroughConfig keys the chart derives from other values, not values of their own: one
# switch for one thing (the agents' mode and what KubeVirt is told cannot disagree).
DERIVED = {"dra": "agent.devicePlugin.dra and agent.devicePlugin.perNode"}


def values_schema() -> dict[str, Any]:
    """The chart's values.schema.json (JSON Schema draft-07, which every Helm 3 reads)."""
    platform = {k: v for k, v in structural_schema(PassthroughConfigSpec)["properties"].items() if k not in DERIVED}
    runtime = _inline(RuntimeValues.model_json_schema(by_alias=True, mode="validation"))
    # In values.yaml's order: `config`, the platform values it is made from, then the rest.
    properties = {
        "config": runtime["properties"]["config"],
        **{name: closed(schema) for name, schema in platform.items()},
        **{name: schema for name, schema in runtime["properties"].items() if name != "config"},
    }
    return {
        "$schema": SCHEMA_DRAFT,
        "type": "object",
        "description": "Values of the passthrough-operator chart: the platform values (kubevirt, gpu, devices, discovery; "
        "the PassthroughConfig's spec) and how the operator and the node agents run.",
        "properties": properties,
        "required": runtime["required"],
        "additionalProperties": False,
    }


def closed(node: dict[str, Any]) -> dict[str, Any]:
    """A CRD's structural schema as JSON Schema that refuses unknown keys at every level."""
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key.startswith("x-kubernetes-"):
            continue  # the API server's own keywords; a JSON Schema validator knows none of them
        if key == "properties":
            value = {name: closed(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = closed(value)
        out[key] = value
    if out.get("exclusiveMinimum") is True:  # OpenAPI 3.0's boolean form; draft-07 wants the bound
        out["exclusiveMinimum"] = out.pop("minimum")
    if "properties" in out:
        out["additionalProperties"] = False
    return out


def _inline(schema: dict[str, Any]) -> dict[str, Any]:
    """Pydantic's JSON Schema with every $ref written in place, no titles, and Optional[X] as X."""
    defs = schema.get("$defs", {})

    def walk(node: dict[str, Any]) -> dict[str, Any]:
        if "$ref" in node:
            target = defs[node["$ref"].rsplit("/", 1)[-1]]
            return walk({**target, **{k: v for k, v in node.items() if k != "$ref"}})
        if "anyOf" in node and node.get("default", 0) is None:
            # `X | None = None`: the key may be left out (or set to null, which Helm removes).
            choices = [c for c in node["anyOf"] if c.get("type") != "null"]
            rest = {k: v for k, v in node.items() if k not in ("anyOf", "default")}
            return walk({**choices[0], **rest} if len(choices) == 1 else {"anyOf": choices, **rest})
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ("title", "$defs"):
                continue
            if key == "properties":
                value = {name: walk(sub) for name, sub in value.items()}
            elif key in ("items", "additionalProperties") and isinstance(value, dict):
                value = walk(value)
            elif key == "anyOf":
                value = [walk(choice) for choice in value]
            out[key] = value
        return out

    return walk(schema)


def render(schema: dict[str, Any]) -> str:
    return json.dumps(schema, indent=2) + "\n"


def write_values_schema(path: Path) -> Path:
    text = render(values_schema())
    if not path.exists() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return path
