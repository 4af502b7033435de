package main

import (
	"errors"
	"net"
	"strings"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
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
	// Until the first attempt fails the task has no error yet; then it says why.
	code, body := waitReady(t, n, "state manager: xds: connect: ")
	if code != 500 || !strings.Contains(body, "pending: state manager\n") || !strings.Contains(body, dead+": connect: connection refused") {
		t.Fatalf("readiness with an unreachable control plane: %d %q; want 500 naming the state manager and its error", code, body)
	}
	if n.xds == nil {
		t.Fatal("node did not start an xDS client for XDS_ADDRESS")
	}
}

// waitReady polls the node's /healthz/ready until its body contains want, and returns the
// last answer.
func waitReady(t *testing.T, n *ztunnel, want string) (int, string) {
	t.Helper()
	url := "http://" + n.addrs["READINESS_ADDR"].String() + "/healthz/ready"
	var code int
	var body string
	_ = testutil.Poll(testutil.Timeout, func() error { // the caller judges the last answer
		if code, body = get(t, url); !strings.Contains(body, want) {
			return errors.New("not yet")
		}
		return nil
	})
	return code, body
}
