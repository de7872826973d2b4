"""Boot a real kernel under QEMU with emulated PCIe devices, and drive it: the rig's host side.

`boot()` starts qemu-system-x86_64 (TCG: this machine's /dev/kvm does not run an ordinary
guest kernel) with an emulated Intel IOMMU and the devices of TOPOLOGY, waits for the command
server in the guest and returns a Guest: run commands and Python in it, start background
processes, read its console, and reach QEMU's monitor (QMP) for what a node sees in
production (device_del, pcie_aer_inject_error). The guest only reaches the host's loopback
(10.0.2.2 through QEMU's user-mode network, no default route), and the host reaches it only
through a hostfwd on 127.0.0.1.
"""

from __future__ import annotations

import json
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from e2e.cluster import _die_with_parent, free_ports
from e2e.guest import initramfs
from e2e.guest.kernel import Kernel, RigUnavailable, ensure_tools
from e2e.guest.qmp import QMP

ROOT = Path(__file__).resolve().parents[2]
VENV_PYTHON = ROOT / ".venv" / "bin" / "python"


class GuestError(RuntimeError):
    """The guest did not boot, or a command in it failed; the message carries what to read."""


class GuestTimeout(GuestError):
    """A command ran past its timeout in the guest and was killed. `stuck`: it is still there,
    blocked in the kernel (a sysfs write that waits uninterruptibly, as an unbind of a held
    device does); its pid is `pid`."""

    def __init__(self, message: str, stuck: bool, pid: int) -> None:
        super().__init__(message)
        self.stuck, self.pid = stuck, pid


# -- the machine ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Function:
    """One emulated PCI function and what the guest kernel is expected to make of it."""

    model: str  # QEMU's device model
    vendor_id: str
    device_id: str
    class_code: str
    driver: str  # the driver the guest binds at boot ("" none: no kernel driver matches)
    options: str = ""  # more QEMU properties


@dataclass(frozen=True)
class Slot:
    """A pcie-root-port and the device behind it. The root ports have ACS, so each slot is
    an IOMMU group of its own; the functions of a slot share it."""

    name: str
    functions: tuple[Function, ...]


E1000E = Function("e1000e", "8086", "10d3", "020000", "e1000e")
NVME = Function("nvme", "1b36", "0010", "010802", "nvme", "serial=rk-nvme,drive=nvme-disk")
EDU = Function("edu", "1234", "11e8", "00ff00", "")
TESTDEV = Function("pci-testdev", "1b36", "0005", "00ff00", "")
DISPLAY = Function("bochs-display", "1234", "1111", "038000", "bochs-drm")
AUDIO = Function("ich9-intel-hda", "8086", "293e", "040300", "snd_hda_intel")
# A function whose AER errors reach the guest's AER driver, for health: QEMU's e1000e has an AER
# capability but its Device Control error-reporting enables are read-only zero, so an error
# injected there is logged in the device and never sent upstream (tried: counters stay 0).
# virtio-pci with aer=on has both, and its modern ID, not a legacy one.
AER_DEVICE = Function("virtio-rng-pci", "1af4", "1044", "00ff00", "virtio-pci", "aer=on,disable-legacy=on")

TOPOLOGY: tuple[Slot, ...] = (
    Slot("nic", (E1000E,)),
    Slot("nvme", (NVME,)),
    Slot("edu", (EDU,)),
    Slot("testdev", (TESTDEV,)),
    Slot("gpu", (DISPLAY, AUDIO)),  # a GPU-like pair: display + HDMI audio, one group
    Slot("dualnic", (E1000E, E1000E)),  # a dual-port NIC, one group
    Slot("aer", (AER_DEVICE,)),  # last: the slots before it keep their buses
)
ROOT_PORT_SLOT = 0x10  # the first root port's slot on bus 00; SeaBIOS numbers their buses 1, 2, ...
NVME_DISK_MIB = 64


def slot_bus(index: int) -> int:
    return index + 1


def address(slot: str, function: int = 0, topology: Sequence[Slot] = TOPOLOGY) -> str:
    """The guest's PCI address of a slot's function, e.g. address("gpu", 1) -> 0000:05:00.1."""
    index = next(i for i, s in enumerate(topology) if s.name == slot)
    return f"0000:{slot_bus(index):02x}:00.{function}"


def expected(topology: Sequence[Slot] = TOPOLOGY) -> dict[str, tuple[str, Function]]:
    """Every emulated function behind a root port: address -> (slot name, Function)."""
    return {address(s.name, f, topology): (s.name, fn) for s in topology for f, fn in enumerate(s.functions)}


def qemu_args(
    kernel: Kernel,
    initrd: Path,
    layout: initramfs.Layout,
    workdir: Path,
    port: int,
    topology: Sequence[Slot] = TOPOLOGY,
    memory_mib: int = 1280,
    append: str = "",
) -> list[str]:
    # no_timer_check: under TCG on busy cores the kernel's check of the IO-APIC timer can miss its
    # ticks and panic ("timer doesn't work through Interrupt-remapped IO-APIC"), seen here.
    cmdline = f"console=ttyS0 rdinit=/init panic=-1 mitigations=off loglevel=4 no_timer_check {append}".strip()
    args = [
        "qemu-system-x86_64",
        "-accel", "tcg,tb-size=256",
        "-machine", "q35",
        "-cpu", "max",  # RDRAND among others: the guest's entropy is there from the start
        "-smp", "1",  # faster than two under TCG here
        "-m", str(memory_mib),
        "-nodefaults", "-display", "none", "-no-reboot",
        # The IOMMU first: devices created before it are not behind it.
        "-device", "intel-iommu,caching-mode=on",
        "-kernel", str(kernel.image), "-initrd", str(initrd), "-append", cmdline,
        "-chardev", f"file,id=console,path={workdir / 'console.log'}", "-serial", "chardev:console",
        "-qmp", f"unix:{workdir / 'qmp.sock'},server=on,wait=off",
        # Bus 00 holds the rig's own devices (integrated: discovery leaves them out).
        "-netdev", f"user,id=net,ipv6=off,hostfwd=tcp:127.0.0.1:{port}-:{initramfs.GUEST_PORT}",
        "-device", "virtio-net-pci,netdev=net,bus=pcie.0,addr=0x3",
        "-fsdev", f"local,id=hostroot,path=/,security_model=none,readonly=on,multidevs=remap",
        "-device", f"virtio-9p-pci,fsdev=hostroot,mount_tag={initramfs.ROOT_TAG},bus=pcie.0,addr=0x4",
        "-fsdev", f"local,id=results,path={layout.share},security_model=none,multidevs=remap",
        "-device", f"virtio-9p-pci,fsdev=results,mount_tag={initramfs.SHARE_TAG},bus=pcie.0,addr=0x5",
        "-device", "virtio-rng-pci,bus=pcie.0,addr=0x6",
        "-drive", f"if=none,id=nvme-disk,format=raw,file={workdir / 'nvme.raw'}",
    ]  # fmt: skip
    for index, slot in enumerate(topology):
        port_id = f"rp-{slot.name}"
        args += ["-device", f"pcie-root-port,id={port_id},bus=pcie.0,chassis={index + 1},addr={ROOT_PORT_SLOT + index:#x}"]
        for function, fn in enumerate(slot.functions):
            props = [fn.model, f"bus={port_id}", f"addr=00.{function}", f"id={slot.name}-{function}"]
            if function == 0 and len(slot.functions) > 1:
                props.append("multifunction=on")
            if fn.options:
                props.append(fn.options)
            args += ["-device", ",".join(props)]
    return args


# -- the guest ------------------------------------------------------------------------------


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    seconds: float


class GuestProcess:
    """A process started in the guest in the background; its output is in `log` (on the share)."""

    def __init__(self, guest: Guest, pid: int, log: Path, argv: Sequence[str]) -> None:
        self.guest, self.pid, self.log, self.argv = guest, pid, log, list(argv)

    def poll(self) -> int | None:
        return self.guest.call("poll", pid=self.pid)["rc"]

    def signal(self, signum: int) -> None:
        self.guest.call("signal", pid=self.pid, signum=signum)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL what is still there after `timeout`; the exit code."""
        self.signal(15)
        rc = self.guest.call("wait", pid=self.pid, timeout=timeout, wait=timeout + 10)["rc"]
        if rc is None:
            self.signal(9)
            rc = self.guest.call("wait", pid=self.pid, timeout=10, wait=20)["rc"]
        return rc

    def output(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return ""


class Guest:
    """A booted guest. Paths on the results share (`share`) are the same on both sides."""

    def __init__(self, kernel: Kernel, workdir: Path, share: Path, port: int, proc: subprocess.Popen, topology: Sequence[Slot]):
        self.kernel, self.workdir, self.share, self.port, self.proc = kernel, workdir, share, port, proc
        self.topology = tuple(topology)
        self.python_path = VENV_PYTHON
        self.boot_seconds = 0.0
        self._monitor: QMP | None = None

    # -- the command channel

    def call(self, op: str, wait: float = 120.0, **request: Any) -> dict[str, Any]:
        """One request to the guest's command server; GuestError with its traceback on a failure."""
        if self.proc.poll() is not None:
            raise GuestError(f"QEMU exited ({self.proc.returncode}) before {op}\n{self.console_tail()}")
        with socket.create_connection(("127.0.0.1", self.port), timeout=wait) as sock:
            sock.sendall(json.dumps({"op": op, **request}).encode() + b"\n")
            data = b""
            while not data.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                data += chunk
        if not data:
            raise ConnectionError(f"the guest's command server closed the connection ({op})")
        answer = json.loads(data)
        if "error" in answer:
            raise GuestError(f"{op} failed in the guest:\n{answer['error']}")
        return answer

    def run(self, *argv: str, timeout: float = 300, env: dict[str, str] | None = None, input: str | None = None, check: bool = True) -> Result:
        answer = self.call("run", argv=list(argv), timeout=timeout, env=env, input=input, wait=timeout + 30)
        if answer.get("timeout"):
            state = "killed, and still blocked in the kernel" if answer["stuck"] else "killed"
            raise GuestTimeout(
                f"{shlex.join(argv)} ran past {timeout}s in the guest ({state})\n{answer['stderr'][-2000:]}",
                answer["stuck"], answer["pid"],
            )
        result = Result(answer["rc"], answer["stdout"], answer["stderr"], answer["seconds"])
        if check and result.rc != 0:
            raise GuestError(f"{shlex.join(argv)} exited {result.rc} in the guest\n{result.stderr[-3000:]}")
        return result

    def sh(self, script: str, **kwargs: Any) -> Result:
        return self.run("/bin/sh", "-c", script, **kwargs)

    def passthrough(self, *args: str, **kwargs: Any) -> Result:
        """The `passthrough` command in the guest, the venv's python called directly."""
        return self.run(str(self.python_path), "-m", "passthrough.cli", *args, **kwargs)

    def python(self, code: str, timeout: float = 300, **args: Any) -> Any:
        """Exec `code` in the command server's process (imports stay warm); `args` are in `args`,
        and what it assigns to `result` (JSON) comes back."""
        return self.call("python", code=code, args=args, wait=timeout)["result"]

    def spawn(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None) -> GuestProcess:
        log = self.share / f"{name}.log"
        pid = self.call("spawn", argv=list(argv), env=env, log=str(log))["pid"]
        return GuestProcess(self, pid, log, argv)

    def read(self, path: str) -> str:
        return self.python("result = open(args['path']).read()", path=path)

    def write(self, path: str, text: str) -> None:
        self.python("import pathlib; pathlib.Path(args['path']).write_text(args['text'])", path=path, text=text)

    def guest_qmp(self, socket_path: str, command: str, timeout: float = 30.0, **arguments: Any) -> Any:
        """A QMP command to a QEMU running in the guest (its monitor socket is a guest path)."""
        return self.call("qmp", path=socket_path, command=command, arguments=arguments, timeout=timeout, wait=timeout + 30)["result"]

    # -- the host side of the machine

    @property
    def monitor(self) -> QMP:
        """The rig's own QEMU monitor (device_del, pcie_aer_inject_error via .hmp())."""
        if self._monitor is None:
            self._monitor = QMP(str(self.workdir / "qmp.sock"))
        return self._monitor

    def console_tail(self, lines: int = 40) -> str:
        try:
            text = (self.workdir / "console.log").read_text(errors="replace")
        except FileNotFoundError:
            text = ""
        try:
            qemu = (self.workdir / "qemu.log").read_text(errors="replace").strip()
        except FileNotFoundError:
            qemu = ""
        tail = "\n".join(text.splitlines()[-lines:])
        return f"--- console ({self.workdir / 'console.log'}), last {lines} lines:\n{tail}" + (f"\n--- qemu:\n{qemu[-2000:]}" if qemu else "")

    def stop(self, timeout: float = 20.0) -> None:
        """Power the machine off (QMP quit; SIGKILL if QEMU does not go)."""
        if self.proc.poll() is None:
            try:
                self.monitor.execute("quit")
            except (OSError, ConnectionError, RuntimeError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self._monitor is not None:
            self._monitor.close()
            self._monitor = None

    def __enter__(self) -> Guest:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def boot(
    kernel: Kernel,
    workdir: Path,
    topology: Sequence[Slot] = TOPOLOGY,
    memory_mib: int = 1280,
    append: str = "",
    timeout: float = 300.0,
) -> Guest:
    """Boot `kernel` and return once the command server in it answers. GuestError (with the
    console's tail) when it does not within `timeout`; the machine is stopped then."""
    ensure_tools()
    if not VENV_PYTHON.exists():
        raise RigUnavailable(f"{VENV_PYTHON} missing: the guest runs the project's venv (make venv)")
    workdir.mkdir(parents=True, exist_ok=True)
    share = workdir / "share"
    share.mkdir(exist_ok=True)
    layout = initramfs.Layout(repo=ROOT, python=VENV_PYTHON, share=share)
    initrd = initramfs.build(kernel, layout, workdir / "initramfs.cpio")
    with open(workdir / "nvme.raw", "wb") as disk:
        disk.truncate(NVME_DISK_MIB << 20)
    (port,) = free_ports(1)
    args = qemu_args(kernel, initrd, layout, workdir, port, topology, memory_mib, append)
    (workdir / "qemu.cmdline").write_text(shlex.join(args) + "\n")
    started = time.monotonic()
    with open(workdir / "qemu.log", "wb") as log:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    guest = Guest(kernel, workdir, share, port, proc, topology)
    try:
        _wait_ready(guest, started + timeout)
    except BaseException:
        guest.stop()
        raise
    guest.boot_seconds = time.monotonic() - started
    return guest


def _wait_ready(guest: Guest, deadline: float) -> None:
    console = guest.workdir / "console.log"
    while True:
        if guest.proc.poll() is not None:
            raise GuestError(f"QEMU exited ({guest.proc.returncode}) while {guest.kernel.package} booted\n{guest.console_tail()}")
        text = console.read_text(errors="replace") if console.exists() else ""
        if initramfs.BOOT_FAILED in text or "Kernel panic" in text:
            raise GuestError(f"{guest.kernel.package} failed to boot\n{guest.console_tail()}")
        try:
            guest.call("ping", wait=3)
            return
        except (OSError, ConnectionError, ValueError):
            pass  # slirp accepts before anything listens in the guest; the server is not up yet
        if time.monotonic() > deadline:
            server_log = guest.share / "server.log"
            extra = f"\n--- command server:\n{server_log.read_text()[-2000:]}" if server_log.exists() else ""
            raise GuestError(f"{guest.kernel.package} booted, but its command server did not answer in time\n{guest.console_tail()}{extra}")
        time.sleep(0.5)


def qemu_processes() -> list[int]:
    """Pids of qemu-system processes this user runs (what a teardown must leave none of)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().startswith("qemu-system"):
                    pids.append(int(entry.name))
            except OSError:
                continue
    return pids


def main() -> int:
    """`python -m e2e.guest.machine [SERIES]`: boot once, print what the guest sees, stop."""
    import tempfile

    from e2e.guest.kernel import kernel

    series = sys.argv[1] if len(sys.argv) > 1 else "6.1"
    with tempfile.TemporaryDirectory(prefix="realkernel-") as workdir:
        with boot(kernel(series), Path(workdir)) as guest:
            print(f"booted {guest.kernel.package} in {guest.boot_seconds:.1f}s")
            print(guest.sh("uname -r; ls /sys/kernel/iommu_groups; for d in /sys/bus/pci/devices/*; do echo $d $(cat $d/vendor $d/device) $(basename $(readlink $d/driver) 2>/dev/null) $(basename $(readlink $d/iommu_group)); done").stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
