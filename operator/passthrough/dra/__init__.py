"""Dynamic Resource Allocation mode (`passthrough agent --dra`): the node's devices as a
ResourceSlice, and claims prepared by binding their IOMMU group and handing over CDI devices.

`slice`: what is published, as a pool of slices of at most 128 devices (pure); `cdi`: the CDI
specs and KEP-5304 metadata a prepared claim gets (pure); `health`: the device health reports the
kubelet streams from the driver (pure); `others`: which devices other servers have (another
device plugin, another DRA driver's slice on the node), not ours to publish or prepare (pure);
`binding`: the binding condition each device carries and the driver's answer in a claim's
status once its IOMMU group is on vfio-pci (pure);
`driver`: the kubelet plugin itself; `kubeletapi`: the vendored protos.
"""
