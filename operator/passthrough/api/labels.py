"""The labels this project puts on objects that others select by."""

NODE_LABEL = "passthrough.io/node"  # a NodePCIDevice's and a PCIDevice's node: an agent lists its own by it
VFIO_LABEL = "passthrough.io/vfio"  # on a Node: "true" when its IOMMU is on and vfio-pci can be loaded
# On a Node, the two halves of VFIO_LABEL, as `passthrough discover --check` says them: "enabled" or
# "disabled"; "loaded" or "missing".
IOMMU_LABEL = "passthrough.io/iommu"
VFIO_PCI_LABEL = "passthrough.io/vfio-pci"
