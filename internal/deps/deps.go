// Package deps pins the module's chosen dependencies while the packages that use them are
// being written in parallel; it is deleted once every dependency has a real importer.
package deps

import (
	_ "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	_ "github.com/miekg/dns"
	_ "github.com/prometheus/client_golang/prometheus"
	_ "github.com/spiffe/go-spiffe/v2/workloadapi"
	_ "go.yaml.in/yaml/v3"
	_ "golang.org/x/net/http2"
	_ "golang.org/x/sys/unix"
	_ "google.golang.org/grpc"
	_ "google.golang.org/protobuf/proto"
	_ "istio.io/api/security/v1alpha1"
)
