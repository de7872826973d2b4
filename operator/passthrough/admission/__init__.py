"""Admission of VMs, VMIs and pods that use namespace-assigned devices (`passthrough.io/<name>`)."""
