"""k8s.io/kubelet/pkg/apis/podresources/v1: vendored api.proto and its generated code."""
