//go:build tools

// Package helm pins the helm command as a tool of its own module, so its Kubernetes
// dependencies stay out of gozt's go.mod. Build it with `make helm` (into .tools/).
package helm

import _ "helm.sh/helm/v3/cmd/helm"
