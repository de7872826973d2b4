"""k8s.io/kubelet/pkg/apis/pluginregistration/v1: vendored api.proto and its generated code."""
