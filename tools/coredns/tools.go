//go:build tools

// Package coredns pins CoreDNS, the cluster DNS of make cluster-up, as a tool of its own
// module (its Kubernetes client stays out of gozt's go.mod and tools/k8s's). Build it with
// `make coredns` (into .tools/).
package coredns

import _ "github.com/coredns/coredns"
