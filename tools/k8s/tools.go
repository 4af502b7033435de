//go:build tools

// Package k8s pins the Kubernetes binaries (kube-apiserver and kubectl for make k8s-check;
// the controller manager, scheduler, kubelet and kube-proxy for make cluster-up) as tools of
// its own module, so Kubernetes stays out of gozt's go.mod. k8s.io/kubernetes requires its staging modules (k8s.io/api, ...) at v0.0.0
// and replaces them with directories of its repository; the replace block points each one at
// its published v0.34.x instead. Build them with `make kube-apiserver kubectl` and
// `make k8s-node-tools` (into .tools/).
// kubectl comes from the same release so that it is within the supported version skew.
package k8s

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
