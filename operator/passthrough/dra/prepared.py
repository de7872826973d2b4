"""What a prepared claim leaves on the node, and the record of it: the CDI specs and KEP-5304
metadata files the container runtime reads (written whole or not at all, since the runtime may
read one at any moment), removed again on unprepare; and `checkpoint.json` in the plugin
directory, so that a repeated prepare answers the same, an unprepare after a restart finds its
files, and no second claim is prepared a device (or IOMMU group) one already holds (`holder`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from passthrough.dra import cdi
from passthrough.dra.slice import DRIVER

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.json"


@dataclass
class PreparedClaim:
    namespace: str
    name: str
    devices: list[dict[str, Any]] = field(default_factory=list)  # cdi.PreparedDevice fields + cdi_ids
    files: list[str] = field(default_factory=list)  # CDI specs and metadata files written for it


def holder(prepared: Mapping[str, PreparedClaim], iommu_group: int, besides: str) -> PreparedClaim | None:
    """The claim other than `besides` (a uid) prepared here with a device of `iommu_group`, if
    any. The group is the unit: its /dev/vfio node goes to whoever holds one of its devices, so
    a second claim of any member would reach the first one's device."""
    for uid, claim in sorted(prepared.items()):
        if uid != besides and any(d.get("iommu_group") == iommu_group for d in claim.devices):
            return claim
    return None


def write_files(claim: dict[str, Any], devices: list[cdi.PreparedDevice], cdi_dir: Path, plugin_dir: Path) -> PreparedClaim:
    """The CDI spec with the vfio device nodes, and per request the metadata file (under
    `plugin_dir`) with the CDI spec that mounts it; returns what was written and the CDI ids."""
    meta = claim["metadata"]
    uid, namespace, name = meta["uid"], meta["namespace"], meta["name"]
    pod_claim = (meta.get("annotations") or {}).get(cdi.POD_CLAIM_ANNOTATION, "")
    prepared = PreparedClaim(namespace=namespace, name=name)
    cdi_dir.mkdir(parents=True, exist_ok=True)
    spec_file = cdi.vfio_spec_file(cdi_dir, uid)
    write_whole(spec_file, json.dumps(cdi.vfio_spec(uid, devices), indent=2))
    prepared.files.append(str(spec_file))
    by_request: dict[str, list[cdi.PreparedDevice]] = {}
    for device in devices:
        by_request.setdefault(device.request, []).append(device)
    for request, members in by_request.items():
        host = cdi.metadata_host_path(plugin_dir, namespace, name, request)
        host.parent.mkdir(parents=True, exist_ok=True)
        write_whole(host, cdi.metadata_stream(DRIVER, claim, request, members))
        spec = cdi.metadata_spec(DRIVER, uid, request, host, cdi.metadata_container_path(DRIVER, name, request, pod_claim))
        spec_file = cdi.metadata_spec_file(cdi_dir, DRIVER, uid, request)
        write_whole(spec_file, json.dumps(spec, indent=2))
        prepared.files += [str(spec_file), str(host.parent.parent)]
    ids = cdi.cdi_ids(uid, DRIVER, devices)
    prepared.devices = [{**asdict(d), "attributes": dict(d.attributes), "cdi_ids": ids[d.name]} for d in devices]
    return prepared


def remove_files(prepared: PreparedClaim) -> None:
    for path in map(Path, prepared.files):
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def load_checkpoint(plugin_dir: Path) -> dict[str, PreparedClaim]:
    """The claims prepared here, by uid; none when the checkpoint is missing or unreadable."""
    path = plugin_dir / CHECKPOINT
    try:
        data = json.loads(path.read_text())
        return {uid: PreparedClaim(**claim) for uid, claim in data.items()}
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, TypeError) as exc:
        log.warning("%s is unreadable (%s): prepared claims are prepared again when the kubelet asks", path, exc)
        return {}


def save_checkpoint(plugin_dir: Path, prepared: dict[str, PreparedClaim]) -> None:
    write_whole(plugin_dir / CHECKPOINT, json.dumps({uid: asdict(c) for uid, c in prepared.items()}, indent=2))


def write_whole(path: Path, text: str) -> None:
    """Whole or not at all: the runtime may read a CDI spec at any moment."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    os.replace(temporary, path)
