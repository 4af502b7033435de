//go:build linux

package main

import (
	"crypto/tls"
	"errors"
	"net"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/internal/attack"
	"github.com/gozt/gozt/internal/leaktest"
)

// A flood of connections to a pod's 15008 that start TLS and stall (a ClientHello, then
// nothing) or never start it, from outside the mesh, while pod A's client talks to pod B
// over HBONE: the pod's listener, served by the node-wide poller, takes connections only
// while its HBONE server has room (hbone's AdmitListener), so goroutines stay bounded
// however big the flood, as in node mode (hbone's TestAcceptBoundedUnderHandshakeFlood),
// and pod A's handshake still gets in, long before the stalled ones' deadline: the oldest
// are evicted for each newcomer.
func TestNetnsInPodHandshakeFlood(t *testing.T) {
	leaktest.Check(t)
	node, nsA, nsB, dir := inPodTopology(t)
	startPodServer(t, nsB, inPodB, "8080")
	agent := inpodtest.NewAgent(t, inpodtest.SocketPath(t))
	env := inPodEnv(agent.Path, dir)
	// The node-wide limit is what this is about: the budgets per source IP would refuse
	// most of a flood from one address first (hbone's fair_test.go).
	env["HBONE_SOURCE_HANDSHAKES"], env["HBONE_SOURCE_HANDSHAKE_RATE"], env["HBONE_SOURCE_FAILED_HANDSHAKE_RATE"] = "off", "off", "off"
	env["DNS_PROXY_ADDR"] = "off"
	cfg := testConfig(t, env)
	const maxHands, flood, dialers = 4, 1000, 16
	cfg.maxHandshakes = maxHands
	n, _ := startNode(t, cfg)
	addClientServer(t, t, agent.Accept(), nsA, nsB)
	if code, body := waitReady(t, n, "ready\n"); code != 200 {
		t.Fatalf("readiness after the snapshot: %d %q", code, body)
	}

	hello := attack.ClientHello(&tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}})
	g0 := runtime.NumGoroutine()
	stopPeaks := attack.GoroutinePeak()
	// From dialers at once, so that connections arrive faster than the node starts
	// goroutines: what the admission has to hold back.
	conns := make([][]net.Conn, dialers)
	defer func() {
		for _, cs := range conns {
			for _, c := range cs {
				c.Close()
			}
		}
	}()
	var wg sync.WaitGroup
	errs := make([]error, dialers)
	for d := range dialers {
		wg.Go(func() {
			errs[d] = node.Do(func() error {
				for i := range flood / dialers {
					c, err := net.DialTimeout("tcp", inPodB+":15008", 5*time.Second)
					if err != nil {
						return err
					}
					conns[d] = append(conns[d], c)
					if i%2 == 0 {
						c.Write(hello)
					}
				}
				return nil
			})
		})
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatalf("flood: %v", err)
	}

	// Pod A's first request needs a handshake with pod B's flooded 15008; the later ones
	// reuse the pooled connection.
	var lat []time.Duration
	for i := range 20 {
		start := time.Now()
		out, err := plainGet(nsA, 0, inPodB+":8080", "/during-flood")
		if err != nil || !strings.Contains(out, "200 OK") {
			t.Fatalf("request %d through the mesh during the flood: %v %q", i, err, out)
		}
		lat = append(lat, time.Since(start))
	}
	gPeak := stopPeaks()
	// MaxHandshakes connections in their handshake and as many evicted on their way out,
	// each with its serving goroutine and, in a handshake, crypto/tls's watcher of its
	// context; 60 for the test's own, the requests' and goroutines on their way out.
	if limit := g0 + 2*(2*maxHands) + 60; gPeak > limit {
		t.Errorf("goroutines peaked at %d under a flood of %d on pod B's 15008 (from %d), want at most %d", gPeak, flood, g0, limit)
	}
	// Pod A's handshake waits in the kernel's backlog behind the flood's connections still
	// there (each let in evicts the oldest stalled one), not for the stalled handshakes'
	// 10 s deadline; the requests on the pooled connection after it take milliseconds.
	// (Without the admission, goroutines passed 100 here and pod A's first request failed.)
	first := lat[0]
	slices.Sort(lat)
	if first > 5*time.Second {
		t.Errorf("pod A's first request during the flood took %v, want under 5 s", first)
	}
	if p50 := lat[len(lat)/2]; p50 > time.Second {
		t.Errorf("pod A's requests on the pooled connection took %v (p50) during the flood, want under 1 s", p50)
	}
	t.Logf("flood of %d: goroutines peaked at %d (from %d); pod A's first request %v, p50 %v", flood, gPeak, g0, first, lat[len(lat)/2])
}
