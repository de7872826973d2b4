"""The kubelet's DRA gRPC APIs the agent's DRA driver speaks, vendored from k8s.io/kubelet with their generated code.

`dra_v1`: DRAPlugin (ours: NodePrepareResources, NodeUnprepareResources), the service the
kubelet of 1.37 prefers. `pluginregistration_v1`: Registration (ours: GetInfo,
NotifyRegistrationStatus), which the kubelet's plugin watcher calls on a socket in
`<kubelet root>/plugins_registry/`. `drahealth_v1`: DRAResourceHealth (ours: NodeWatchResources,
KEP-4680), which the kubelet streams the health of allocated devices from when registration lists
`v1.DRAResourceHealth`. The *_pb2*.py files are generated (`make protos`, one
codegen for these and the device-plugin protos: `passthrough.deviceplugin.kubeletapi.codegen`);
never edit them by hand.
"""
