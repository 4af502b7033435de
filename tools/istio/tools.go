//go:build tools

// Package istio pins Istio's binaries (istiod's pilot-discovery, istio-cni's install-cni and
// CNI plugin, istioctl) as tools of their own module, so Istio stays out of gozt's go.mod.
// Its Helm charts come from the same module's source (manifests/charts in the module cache),
// so the charts and the binaries are one version. Build them with `make istio-tools`.
package istio

import (
	_ "istio.io/istio/cni/cmd/install-cni"
	_ "istio.io/istio/cni/cmd/istio-cni"
	_ "istio.io/istio/istioctl/cmd/istioctl"
	_ "istio.io/istio/pilot/cmd/pilot-discovery"
)
