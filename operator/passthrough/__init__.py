"""passthrough-operator: PCI and GPU passthrough for KubeVirt virtual machines."""
