// Command install prints what virt-operator v1.9.0 would install for a KubeVirt CR in a
// namespace, from virt-operator's own generator (its install strategy, unmodified, and the
// KubeVirt CRD, which virt-operator's own manifests carry, from the same generator): the CRDs,
// the webhook configurations, and the virt-api and virt-controller Deployments (whose
// arguments the tests start the two programs with). The tests install the CRDs and register
// the webhooks from this, so KubeVirt's API is the one KubeVirt installs (e2e/virt.py).
//
// Usage: install <namespace>   (prints one JSON object)
package main

import (
	"encoding/json"
	"fmt"
	"os"

	extv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	v1 "kubevirt.io/api/core/v1"

	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/components"
	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/install"
	"kubevirt.io/kubevirt/pkg/virt-operator/util"
)

// Version is the release the images of the Deployments would carry; the programs themselves
// are built from the same module.
const version = "v1.9.0"

type output struct {
	CRDs                            any `json:"crds"`
	MutatingWebhookConfigurations   any `json:"mutatingWebhookConfigurations"`
	ValidatingWebhookConfigurations any `json:"validatingWebhookConfigurations"`
	APIDeployments                  any `json:"apiDeployments"`
	ControllerDeployments           any `json:"controllerDeployments"`
	CertificateSecrets              any `json:"certificateSecrets"`
	ConfigMaps                      any `json:"configMaps"`
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: install <namespace>")
		os.Exit(2)
	}
	namespace := os.Args[1]
	kv := &v1.KubeVirt{
		ObjectMeta: metav1.ObjectMeta{Name: "kubevirt", Namespace: namespace},
		Spec:       v1.KubeVirtSpec{ImageRegistry: "quay.io/kubevirt", ImageTag: version},
	}
	config := util.GetTargetConfigFromKV(kv)
	strategy, err := install.GenerateCurrentInstallStrategy(config, "", namespace)
	if err != nil {
		fmt.Fprintf(os.Stderr, "virt-operator's install strategy: %v\n", err)
		os.Exit(1)
	}
	// The KubeVirt CRD itself is not in the strategy: it ships with virt-operator's own
	// manifests, from the same generator (tools/resource-generator).
	kubeVirtCRD, err := components.NewKubeVirtCrd()
	if err != nil {
		fmt.Fprintf(os.Stderr, "the KubeVirt CRD: %v\n", err)
		os.Exit(1)
	}
	out := output{
		CRDs:                            append([]*extv1.CustomResourceDefinition{kubeVirtCRD}, strategy.CRDs()...),
		MutatingWebhookConfigurations:   strategy.MutatingWebhookConfigurations(),
		ValidatingWebhookConfigurations: strategy.ValidatingWebhookConfigurations(),
		APIDeployments:                  strategy.ApiDeployments(),
		ControllerDeployments:           strategy.ControllerDeployments(),
		CertificateSecrets:              strategy.CertificateSecrets(),
		ConfigMaps:                      strategy.ConfigMaps(),
	}
	if err := json.NewEncoder(os.Stdout).Encode(out); err != nil {
		fmt.Fprintf(os.Stderr, "encoding: %v\n", err)
		os.Exit(1)
	}
}
