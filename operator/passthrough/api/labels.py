"""The labels this project puts on objects that others select by."""

NODE_LABEL = "passthrough.io/node"  # a NodePCIDevice's and a PCIDevice's node: an agent lists its own by it
VFIO_LABEL = "passthrough.io/vfio"  # on a Node: "true" when its IOMMU is on and vfio-pci can be loaded
