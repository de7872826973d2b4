"""Images for the real node without a registry: archives containerd imports.

- pause: our static `pause` program (`e2e/controlplane/node/containerd/pause`) as the one layer
  of an OCI image layout, written here (a few hundred bytes of JSON and one tar);
- the project's image: `make image`'s build (`e2e/image.py`), saved by buildah as a
  docker-archive under the name the chart pulls, so the chart's default reference finds it.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

from e2e.realnode import config


def _blob(layout: tarfile.TarFile, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    info = tarfile.TarInfo(f"blobs/sha256/{digest}")
    info.size = len(data)
    layout.addfile(info, io.BytesIO(data))
    return {"digest": f"sha256:{digest}", "size": len(data)}


def _json(value: dict) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def pause_archive(pause_binary: Path, out: Path, name: str = config.PAUSE_IMAGE) -> Path:
    """An OCI image layout (tar) of one layer holding /pause, its entrypoint, named `name`."""
    layer_buffer = io.BytesIO()
    with tarfile.open(fileobj=layer_buffer, mode="w", format=tarfile.PAX_FORMAT) as layer:
        data = pause_binary.read_bytes()
        info = tarfile.TarInfo("pause")
        info.size, info.mode = len(data), 0o755
        layer.addfile(info, io.BytesIO(data))
    layer_bytes = layer_buffer.getvalue()
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/pause"], "User": "65535:65535"},
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{hashlib.sha256(layer_bytes).hexdigest()}"]},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, mode="w", format=tarfile.PAX_FORMAT) as layout:
        config_ref = {"mediaType": "application/vnd.oci.image.config.v1+json", **_blob(layout, _json(image_config))}
        layer_ref = {"mediaType": "application/vnd.oci.image.layer.v1.tar", **_blob(layout, layer_bytes)}
        manifest = {
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": config_ref,
            "layers": [layer_ref],
        }
        manifest_ref = {
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            **_blob(layout, _json(manifest)),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"io.containerd.image.name": name, "org.opencontainers.image.ref.name": name.rsplit(":", 1)[1]},
        }
        for file_name, content in (
            ("oci-layout", _json({"imageLayoutVersion": "1.0.0"})),
            ("index.json", _json({"schemaVersion": 2, "manifests": [manifest_ref]})),
        ):
            info = tarfile.TarInfo(file_name)
            info.size = len(content)
            layout.addfile(info, io.BytesIO(content))
    return out


def project_archive(out: Path) -> Path:
    """The project's image (built first when stale) as a docker-archive named as the chart pulls it."""
    from e2e import image

    built = image.build()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    image.buildah("push", built.name, f"docker-archive:{out}:{built.name}", step=f"buildah push {built.name}")
    return out
