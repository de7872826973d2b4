"""k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1: vendored api.proto and its generated code."""
