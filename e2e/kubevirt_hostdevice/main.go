// Command kubevirthostdevice runs KubeVirt's own virt-launcher code, unmodified, that turns the
// compute container's environment into the domain's host devices in device-plugin mode: the
// address pools over PCI_RESOURCE_<NAME> (and MDEV_PCI_RESOURCE_<NAME>, USB_RESOURCE_<NAME>)
// and the generic and GPU builders, the calls virt-launcher's domain manager makes for a VMI's
// hostDevices and gpus. The tests (tests/integration/test_kubevirt_hostdevice.py) run it with
// exactly the environment the kubelet gave a launcher's compute container, so which address
// each of the VM's devices gets is KubeVirt's answer, not ours.
//
// Usage: kubevirthostdevice < vmi.json, its environment the container's.
// Prints {"hostDevices": result, "gpus": result} as JSON, each result the <hostdev> elements
// one builder made (their XML) or its error.
package main

import (
	"encoding/json"
	"encoding/xml"
	"fmt"
	"os"

	v1 "kubevirt.io/api/core/v1"

	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/device/hostdevice/generic"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/device/hostdevice/gpu"
)

// result is one builder's answer: each <hostdev> element as libvirt would receive it, or the
// builder's error (the domain would not be made).
type result struct {
	XML   []string `json:"xml"`
	Error string   `json:"error,omitempty"`
}

func marshal(devices []api.HostDevice, err error) result {
	if err != nil {
		return result{XML: []string{}, Error: err.Error()}
	}
	out := result{XML: []string{}}
	for _, d := range devices {
		text, err := xml.Marshal(d)
		if err != nil {
			return result{XML: []string{}, Error: err.Error()}
		}
		out.XML = append(out.XML, string(text))
	}
	return out
}

func run() error {
	var vmi v1.VirtualMachineInstance
	if err := json.NewDecoder(os.Stdin).Decode(&vmi); err != nil {
		return fmt.Errorf("stdin: not a VirtualMachineInstance: %w", err)
	}
	devices := vmi.Spec.Domain.Devices
	// The order of virt-launcher's domain manager: the generic host devices, then the GPUs.
	return json.NewEncoder(os.Stdout).Encode(map[string]result{
		"hostDevices": marshal(generic.CreateHostDevices(devices.HostDevices)),
		"gpus":        marshal(gpu.CreateHostDevices(devices.GPUs)),
	})
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "error:", err)
		os.Exit(2)
	}
}
