"""The kubelet's gRPC APIs this agent speaks, vendored from k8s.io/kubelet with their generated code.

`deviceplugin_v1beta1`: Registration (the kubelet's) and DevicePlugin (ours).
`podresources_v1`: PodResourcesLister (the kubelet's), to learn which devices pods hold.
The *_pb2*.py files are generated (`make protos`, see `codegen`); never edit them by hand.
"""
