"""k8s.io/kubelet/pkg/apis/dra/v1: vendored api.proto and its generated code."""
