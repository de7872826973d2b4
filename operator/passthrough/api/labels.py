"""The labels this project puts on objects that others select by."""

NODE_LABEL = "passthrough.io/node"  # a NodePCIDevice's and a PCIDevice's node: an agent lists its own by it
VFIO_LABEL = "passthrough.io/vfio"  # on a Node: "true" when its IOMMU is on and vfio-pci can be loaded
# On a Node, the two halves of VFIO_LABEL, as `passthrough discover --check` says them: "enabled" or
# "disabled"; "loaded" or "missing".
IOMMU_LABEL = "passthrough.io/iommu"
VFIO_PCI_LABEL = "passthrough.io/vfio-pci"
# On a Node, while `helm uninstall` runs: the chart's pre-delete hook asks the node's agent to give
# back every device it bound that nothing holds (GIVE_BACK_LABEL, a token of that request), and the
# agent answers with the same token (GIVEN_BACK_LABEL) once a scan has done so and reported why
# each device left on vfio-pci stays.
GIVE_BACK_LABEL = "passthrough.io/give-back"
GIVEN_BACK_LABEL = "passthrough.io/given-back"
# On a Node, the admin's: how its agent serves devices, "dra" or "device-plugin", where the chart
# lets nodes choose (agent.devicePlugin.perNode); read when the agent starts. SERVING_LABEL is the
# agent's answer, the mode it serves in: the operator decides by it what a device on that node needs
# (a DeviceClass claim or a permittedHostDevices entry).
MODE_LABEL = "passthrough.io/mode"
SERVING_LABEL = "passthrough.io/serving"
DRA_MODE, DEVICE_PLUGIN_MODE = "dra", "device-plugin"
