"""The control-plane build cache: complete entries are reused, anything else is rebuilt (the
runner itself: tests/unit/test_gobuild.py)."""

import json

from e2e import build, gobuild


def _entry(tmp_path):
    directory = tmp_path / "k8s-v1-etcd-v3-abc"
    (directory / "bin").mkdir(parents=True)
    for name in build.BINARIES:
        (directory / "bin" / name).write_bytes(b"\x7fELF" + name.encode())
    (directory / "manifest.json").write_text(json.dumps(gobuild.manifest(directory / "bin", build.BINARIES)))
    return directory


def test_a_complete_entry_is_reused(tmp_path):
    directory = _entry(tmp_path)
    assert build.cached_binaries(directory) == directory / "bin"


def test_an_entry_without_manifest_is_an_interrupted_build(tmp_path):
    directory = _entry(tmp_path)
    (directory / "manifest.json").unlink()
    assert build.cached_binaries(directory) is None


def test_a_binary_changed_after_the_build_is_stale(tmp_path):
    directory = _entry(tmp_path)
    (directory / "bin" / "kube-apiserver").write_bytes(b"truncated")
    assert build.cached_binaries(directory) is None


def test_a_missing_binary_is_stale(tmp_path):
    directory = _entry(tmp_path)
    (directory / "bin" / "etcd").unlink()
    assert build.cached_binaries(directory) is None


def test_cache_key_changes_with_the_pinned_release(tmp_path, monkeypatch):
    before = build.cache_key()
    modules = tmp_path / "controlplane"
    for target in build.targets():
        (modules / target.name).mkdir(parents=True)
        for name in ("go.mod", "go.sum"):
            (modules / target.name / name).write_bytes((target.module / name).read_bytes())
    kube_mod = modules / "kubernetes" / "go.mod"
    kube_mod.write_text(kube_mod.read_text().replace("k8s.io/kubernetes v1.", "k8s.io/kubernetes v9."))
    monkeypatch.setattr(build, "MODULES", modules)
    assert build.cache_key() != before
    assert build.kubernetes_version().startswith("v9.")


def test_pinned_releases_are_current_enough():
    major, minor = (int(x) for x in build.kubernetes_version().lstrip("v").split(".")[:2])
    assert (major, minor) >= (1, 34)
    assert build.etcd_version().startswith("v3.")
