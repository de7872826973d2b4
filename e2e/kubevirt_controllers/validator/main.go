// Command validator serves virt-operator v1.9.0's own admission webhooks for the KubeVirt CR
// (create, update, delete: KubeVirt's admitters, unmodified), the part of virt-operator the
// tests need: its update validator is what refuses a CR that names a feature gate in both
// featureGates and disabledFeatureGates. virt-operator itself does not run here: the rest of
// it installs Deployments and DaemonSets, which e2e/virt.py stands in for.
//
// Usage: validator --kubeconfig FILE --listen ADDR:PORT --tls-cert-file FILE --tls-key-file FILE --namespace NS
package main

import (
	"flag"
	"fmt"
	"net/http"
	"os"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"kubevirt.io/client-go/kubecli"

	"kubevirt.io/kubevirt/pkg/controller"
	validating_webhooks "kubevirt.io/kubevirt/pkg/util/webhooks/validating-webhooks"
	virtconfig "kubevirt.io/kubevirt/pkg/virt-config"
	"kubevirt.io/kubevirt/pkg/virt-operator/resource/generate/components"
	operator_webhooks "kubevirt.io/kubevirt/pkg/virt-operator/webhooks"
)

func main() {
	kubeconfig := flag.String("kubeconfig", "", "kubeconfig of the cluster")
	listen := flag.String("listen", "127.0.0.1:8444", "address to serve on")
	certFile := flag.String("tls-cert-file", "", "serving certificate")
	keyFile := flag.String("tls-key-file", "", "serving key")
	namespace := flag.String("namespace", "kubevirt", "namespace of the KubeVirt CR")
	flag.Parse()

	config, err := clientcmd.BuildConfigFromFlags("", *kubeconfig)
	if err != nil {
		fail("kubeconfig: %v", err)
	}
	virtClient, err := kubecli.GetKubevirtClientFromRESTConfig(config)
	if err != nil {
		fail("KubeVirt client: %v", err)
	}
	k8sClient, err := kubernetes.NewForConfig(config)
	if err != nil {
		fail("Kubernetes client: %v", err)
	}
	factory := controller.NewKubeInformerFactory(virtClient.RestClient(), virtClient, k8sClient, nil, *namespace)
	crdInformer, kubeVirtInformer := factory.CRD(), factory.KubeVirt()
	stop := make(chan struct{})
	factory.Start(stop)
	cache.WaitForCacheSync(stop, crdInformer.HasSynced, kubeVirtInformer.HasSynced)
	clusterConfig, err := virtconfig.NewClusterConfig(crdInformer, kubeVirtInformer, *namespace)
	if err != nil {
		fail("cluster config: %v", err)
	}

	// The paths virt-operator serves them at (pkg/virt-operator/application.go).
	var mux http.ServeMux
	mux.HandleFunc("/kubevirt-validate-delete", func(w http.ResponseWriter, r *http.Request) {
		validating_webhooks.Serve(w, r, operator_webhooks.NewKubeVirtDeletionAdmitter(virtClient))
	})
	mux.HandleFunc(components.KubeVirtUpdateValidatePath, func(w http.ResponseWriter, r *http.Request) {
		validating_webhooks.Serve(w, r, operator_webhooks.NewKubeVirtUpdateAdmitter(k8sClient, clusterConfig))
	})
	mux.HandleFunc(components.KubeVirtCreateValidatePath, func(w http.ResponseWriter, r *http.Request) {
		validating_webhooks.Serve(w, r, operator_webhooks.NewKubeVirtCreateAdmitter(virtClient))
	})
	fmt.Fprintf(os.Stderr, "serving virt-operator's KubeVirt webhooks on %s\n", *listen)
	if err := http.ListenAndServeTLS(*listen, *certFile, *keyFile, &mux); err != nil {
		fail("serving: %v", err)
	}
}

func fail(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
	os.Exit(1)
}
