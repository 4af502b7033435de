package main

import (
	"net"
	"strings"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
)

// With a control plane configured but unreachable, the node starts, serves its local
// config, and reports "state manager" pending until the first xDS sync.
func TestNodeWaitsForControlPlane(t *testing.T) {
	leaktest.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close() // nothing listens here: the xDS client keeps retrying with backoff
	n, _ := startNode(t, testConfig(t, map[string]string{"XDS_ADDRESS": "http://" + dead}))
	code, body := get(t, "http://"+n.addrs["READINESS_ADDR"].String()+"/healthz/ready")
	if code != 500 || !strings.Contains(body, "state manager") {
		t.Fatalf("readiness with an unreachable control plane: %d %q; want 500 naming the state manager", code, body)
	}
	if n.xds == nil {
		t.Fatal("node did not start an xDS client for XDS_ADDRESS")
	}
}
