"""k8s.io/kubelet/pkg/apis/dra-health/v1: vendored api.proto and its generated code."""
