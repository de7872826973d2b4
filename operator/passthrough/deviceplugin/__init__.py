"""The kubelet device plugins (API v1beta1) through which the agent offers vfio-pci devices to VMs.

`allocation`: what Allocate and GetPreferredAllocation answer (pure); `server`: one plugin on
one socket; `manager`: every plugin of the node, registered and re-registered with the
kubelet; `podresources`: which devices pods hold; `kubeletapi`: the vendored protos.
"""
