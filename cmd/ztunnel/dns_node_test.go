package main

import (
	"testing"

	mdns "github.com/miekg/dns"

	"github.com/gozt/gozt/internal/leaktest"
)

// The node answers a mesh service name from its local config on DNS_PROXY_ADDR.
func TestNodeServesDNS(t *testing.T) {
	leaktest.Check(t)
	n, _ := startNode(t, testConfig(t, map[string]string{"DNS_PROXY_ADDR": "127.0.0.1:0"}))
	addr := n.addrs["DNS_PROXY_ADDR"]
	if addr == nil {
		t.Fatal("no DNS listener bound")
	}
	q := new(mdns.Msg)
	q.SetQuestion("echo.default.svc.cluster.local.", mdns.TypeA)
	for _, proto := range []string{"udp", "tcp"} {
		resp, _, err := (&mdns.Client{Net: proto}).Exchange(q, addr.String())
		if err != nil {
			t.Fatalf("%s: %v", proto, err)
		}
		if len(resp.Answer) != 1 {
			t.Fatalf("%s: %d answers; want 1: %v", proto, len(resp.Answer), resp)
		}
		if a, ok := resp.Answer[0].(*mdns.A); !ok || a.A.String() != "127.10.0.1" {
			t.Fatalf("%s: answer %v; want A 127.10.0.1 (the echo service VIP in examples/localhost.yaml)", proto, resp.Answer[0])
		}
	}
}
