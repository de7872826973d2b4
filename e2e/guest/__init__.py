"""The real-kernel rig: stock Debian kernels under QEMU with an emulated IOMMU and PCIe devices.

kernel.py fetches and unpacks the kernels, initramfs.py makes the guest's root (the host's /
read-only under a tmpfs overlay), machine.py boots it and drives it through the command
server (server.py, which runs in the guest) and QEMU's monitor (qmp.py), node.py runs the real
kubelet and agent in it against the local control plane, vmm.py a nested QEMU that opens
devices with vfio-pci, realnode.py a node that runs pods for real in it (containerd, runc, CNI,
kube-proxy and the kubelet). Nothing is imported here: the command server's start in the guest
(under TCG) pays for every import.
"""
