"""runc, built here, and the chart's containers as OCI bundles it runs: the pod shape without a kubelet.

runc is built from the Go module proxy (the release `e2e/controlplane/runc/go.mod` pins) with the
`seccomp` build tag against Debian's libseccomp-dev, which `ensure_runc` installs when its header
is missing, as every Go program of the suite is (`e2e/gobuild.py`): cached beside the control
plane, keyed by everything that goes into it.

`bundle` turns one container of a rendered pod template (the chart's DaemonSet, from
`helm template`) into the `config.json` a container runtime would give runc for it: the
container's user, no-new-privileges, capabilities, read-only root, a RuntimeDefault-like seccomp
profile, the default device rules (no device beyond the runtime's usual /dev/null, /dev/zero,
...), its own mount, pid, IPC, UTS, network and cgroup namespaces, the runtime's default mounts,
and the container's volumeMounts resolved through the pod's volumes (hostPath: the node's path,
emptyDir: a directory of the bundle). The root filesystem is not the image: the node's own
/usr, /lib, ... and this checkout, read-only, so the project's code runs as it is here.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from e2e import gobuild

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODULE = HERE / "controlplane" / "runc"
PACKAGE = "github.com/opencontainers/runc"
SECCOMP_HEADER = Path("/usr/include/seccomp.h")


class RuncUnavailable(gobuild.BuildError):
    """runc cannot be built here (no Go, no compiler, libseccomp-dev not installable)."""


def runc_version() -> str:
    try:
        return gobuild.required_version(MODULE, PACKAGE)
    except gobuild.BuildError as exc:
        raise RuncUnavailable(str(exc)) from exc


def _cache_dir() -> Path:
    # The key has always hashed `go version`'s output as printed, its newline included.
    digest = hashlib.sha256((gobuild.go_version() + "\n").encode())
    for name in ("go.mod", "go.sum"):
        digest.update((MODULE / name).read_bytes())
    digest.update(_ldflags().encode())
    return gobuild.cache_root() / "runc" / f"runc-{runc_version()}-{digest.hexdigest()[:12]}"


def _ldflags() -> str:
    return f"-s -w -X main.version={runc_version().lstrip('v')} -X main.gitCommit=module-proxy"


def _ensure_libseccomp() -> None:
    """Debian's libseccomp-dev (header, pkg-config file): what the seccomp build tag compiles against."""
    if SECCOMP_HEADER.exists():
        return
    print("[runc] installing libseccomp-dev (apt-get)", file=sys.stderr, flush=True)
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", "-o", "DPkg::Lock::Timeout=600", "libseccomp-dev"]
    if subprocess.run(install, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run(["apt-get", "update", "-q", "-o", "DPkg::Lock::Timeout=600"], stdout=subprocess.DEVNULL)
        if subprocess.run(install, stdout=subprocess.DEVNULL).returncode != 0:
            raise RuncUnavailable("apt-get could not install libseccomp-dev, which runc's seccomp support needs")


def ensure_runc() -> Path:
    """The runc binary, built first when the cache lacks it. RuncUnavailable when it cannot be."""
    program = gobuild.Program(MODULE, {"runc": PACKAGE}, tags="seccomp", ldflags=_ldflags())
    try:
        build = gobuild.GoBuild("runc", f"runc {runc_version()} (seccomp)", _cache_dir(), (program,), bin_dir="",
                                cgo=True, prepare=_ensure_libseccomp)  # fmt: skip
        return gobuild.ensure(build) / "runc"
    except RuncUnavailable:
        raise
    except gobuild.BuildError as exc:
        raise RuncUnavailable(str(exc)) from exc


# -- the pod shape as an OCI bundle -----------------------------------------------------------

# What containerd's default seccomp profile (RuntimeDefault) refuses to a container without
# capabilities, refused with EPERM; the rest is allowed. The default profile is an allowlist; for
# a process with no capability these are what it takes away beyond what the kernel already does.
SECCOMP_REFUSED = (
    "acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module", "delete_module",
    "finit_module", "fsconfig", "fsmount", "fsopen", "fspick", "get_kernel_syms", "get_mempolicy",
    "init_module", "ioperm", "iopl", "kcmp", "kexec_file_load", "kexec_load", "keyctl",
    "lookup_dcookie", "mbind", "mount", "mount_setattr", "move_mount", "move_pages",
    "name_to_handle_at", "nfsservctl", "open_by_handle_at", "open_tree", "perf_event_open",
    "pivot_root", "process_vm_readv", "process_vm_writev", "ptrace", "query_module", "quotactl",
    "reboot", "request_key", "set_mempolicy", "setns", "settimeofday", "swapoff", "swapon",
    "sysfs", "_sysctl", "umount2", "unshare", "uselib", "userfaultfd", "ustat",
)  # fmt: skip
# The node's own files the root filesystem is made of (read-only), beside this checkout and
# the Python the checkout's venv runs.
ROOTFS_DIRS = ("/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc")


def _runtime_mounts() -> list[dict[str, Any]]:
    """The mounts every container gets from the runtime (containerd's, as runc's own spec)."""
    return [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
        {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
         "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"]},
        {"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
        {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
        {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
        {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup", "options": ["nosuid", "noexec", "nodev", "relatime", "ro"]},
    ]  # fmt: skip


def pod_template(objects: Sequence[Mapping[str, Any]], kind: str, name_suffix: str) -> dict[str, Any]:
    """The pod template of the rendered workload of `kind` whose name ends with `name_suffix`."""
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    return found["spec"]["template"]


def container(template: Mapping[str, Any], name: str) -> dict[str, Any]:
    [found] = [c for c in template["spec"]["containers"] if c["name"] == name]
    return found


def host_path(template: Mapping[str, Any], container_name: str, path: str) -> str | None:
    """Where `path` in the container leads on the node, through the deepest of its mounts that
    covers it and is a hostPath (None: no hostPath mount covers it, the node's file is not there)."""
    volumes = {v["name"]: v for v in template["spec"].get("volumes", [])}
    best: tuple[int, str] | None = None
    for mount in container(template, container_name).get("volumeMounts", []):
        target = mount["mountPath"].rstrip("/")
        if path != target and not path.startswith(target + "/"):
            continue
        source = volumes[mount["name"]].get("hostPath")
        depth = len(target)
        if best is None or depth > best[0]:
            best = (depth, source["path"].rstrip("/") + path[len(target):] if source else "")
    return (best[1] or None) if best else None


def bundle(
    template: Mapping[str, Any],
    container_name: str,
    directory: Path,
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    cgroup: str = "",
    python: Path = ROOT / ".venv" / "bin" / "python",
) -> Path:
    """Write `directory`/config.json (and its rootfs and emptyDirs) for container `container_name`
    of the pod `template`, running `args` in place of its command. Returns `directory`."""
    spec = template["spec"]
    wanted = container(template, container_name)
    pod_sc, sc = spec.get("securityContext") or {}, wanted.get("securityContext") or {}
    user = {"uid": int(sc.get("runAsUser", pod_sc.get("runAsUser", 0))), "gid": int(sc.get("runAsGroup", pod_sc.get("runAsGroup", 0)))}
    if sc.get("privileged"):
        raise ValueError("a privileged container is not the shape this bundle makes")
    dropped = {c.upper() for c in (sc.get("capabilities") or {}).get("drop", [])}
    if dropped != {"ALL"}:
        raise ValueError(f"only containers that drop ALL capabilities are shaped here, not {sorted(dropped)}")
    directory.mkdir(parents=True, exist_ok=True)
    rootfs = directory / "rootfs"
    rootfs.mkdir(exist_ok=True)
    mounts = _runtime_mounts()
    interpreter = Path(os.path.realpath(python)).parents[1]  # the Python the venv runs (its prefix)
    for source in (*ROOTFS_DIRS, str(interpreter), str(ROOT)):
        if os.path.isdir(source):
            mounts.append({"destination": source, "type": "bind", "source": source, "options": ["rbind", "ro"]})
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    for mount in wanted.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        if "hostPath" in volume:
            source = volume["hostPath"]["path"]
            kind = volume["hostPath"].get("type", "")
            if kind == "DirectoryOrCreate":
                os.makedirs(source, exist_ok=True)
            elif kind == "Directory" and not os.path.isdir(source):
                raise ValueError(f"hostPath {source} (volume {mount['name']}) is not a directory on this node")
        elif "emptyDir" in volume:
            source = str(directory / "volumes" / mount["name"])
            os.makedirs(source, exist_ok=True)
        else:
            raise ValueError(f"volume {mount['name']}: only hostPath and emptyDir are shaped here")
        options = ["rbind", "rprivate"]
        if mount.get("readOnly"):
            options.append("rro" if mount.get("recursiveReadOnly") == "Enabled" else "ro")
        mounts.append({"destination": mount["mountPath"], "type": "bind", "source": source, "options": options})
    profile = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86", "SCMP_ARCH_X32"],
        "syscalls": [{"names": list(SECCOMP_REFUSED), "action": "SCMP_ACT_ERRNO", "errnoRet": 1}],
    }
    if (sc.get("seccompProfile") or {}).get("type") != "RuntimeDefault":
        raise ValueError("only containers with the RuntimeDefault seccomp profile are shaped here")
    config = {
        "ociVersion": "1.2.0",
        "process": {
            "terminal": False,
            "user": user,
            "args": list(args),
            "env": [f"{k}={v}" for k, v in {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                                             "PYTHONUNBUFFERED": "1", **(env or {})}.items()],  # fmt: skip
            "cwd": "/",
            "capabilities": {k: [] for k in ("bounding", "effective", "inheritable", "permitted", "ambient")},
            "noNewPrivileges": sc.get("allowPrivilegeEscalation") is False,
        },
        "root": {"path": "rootfs", "readonly": bool(sc.get("readOnlyRootFilesystem"))},
        "hostname": container_name,
        "mounts": mounts,
        "linux": {
            # The default device rules: nothing; runc adds the runtime's usual allowlist
            # (null, zero, full, random, urandom, tty, ptmx, pts).
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
            "cgroupsPath": cgroup or f"/passthrough-oci/{container_name}",
            "namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount", "cgroup")],
            "seccomp": profile,
            "maskedPaths": ["/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/sys/firmware", "/proc/scsi"],
            "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
            "rootfsPropagation": "rprivate",
        },
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    return directory


def main() -> int:
    """`python -m e2e.oci` (make realkernel): runc, ready. Where it cannot be built, one line says
    why and the tests that run containers skip (exit 0), except under CI=true (exit 1)."""
    return gobuild.main("runc", ensure_runc, optional="the tests that run containers")


if __name__ == "__main__":
    sys.exit(main())
