//go:build tools

// The programs built from this module besides ./install (e2e/virt.py builds them by package
// path); this file keeps them in go.mod's requirements.
package tools

import (
	_ "kubevirt.io/kubevirt/cmd/virt-api"
	_ "kubevirt.io/kubevirt/cmd/virt-controller"
)
