"""Dynamic Resource Allocation mode (`passthrough agent --dra`): the node's devices as a
ResourceSlice, and claims prepared by binding their IOMMU group and handing over CDI devices.

`slice`: what is published (pure); `cdi`: the CDI specs and KEP-5304 metadata a prepared claim
gets (pure); `health`: the device health reports the kubelet streams from the driver (pure);
`driver`: the kubelet plugin itself; `kubeletapi`: the vendored protos.
"""
