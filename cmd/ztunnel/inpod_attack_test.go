//go:build linux

package main

import (
	"cmp"
	"context"
	"crypto/tls"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/internal/attack"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/testutil"
)

// TestInPodOpenStreamsBench is issue 50's open-streams flood in in-pod mode, the mode
// production runs (proxy's BenchmarkVictimOpenStreams is the same in dedicated mode): pod
// A's client makes paced 1 KiB round trips (500 a second) to an echo server in pod B, over
// HBONE through the pods' listeners as istio-cni's rules capture them, while an attacker
// process in the node's namespace (outside the mesh) with a valid certificate of its own
// identity opens CONNECTs to pod B's echo server on 4 connections to pod B's 15008, as fast
// as it can, never reading a byte, reconnecting as each is closed. Rounds of
// INPOD_ATTACK_TRIPS round trips (default 3000: 6 s): none, burn (the control: an attacker
// process that keeps threads as busy as the flood's, at the same priority, and sends
// nothing), open-streams, none-again, INPOD_ATTACK_ROUNDS times (default 3);
// INPOD_ATTACK_KIND names another attack of attack.Main's (stalled-tls, say) to run
// instead of open-streams. With HBONE_CONTROL set to a binary built from
// tools/istio/hbonecontrol, pod B then leaves the node and Istio's Go HBONE server takes
// its 15008, and the rounds run again (istio-none, ...). It logs the victim's p50 and p99,
// p99 against the round's none, the node's goroutine peak, the Go scheduler's p99 latency
// and the CPU the node's process used a second (pod A's client and pod B's echo server
// are in it too), and the connections a second the node refused for their source's
// budgets. It runs only with INPOD_ATTACK=1 (and root): it measures, it asserts nothing
// about speed.
func TestInPodOpenStreamsBench(t *testing.T) {
	if os.Getenv("INPOD_ATTACK") != "1" {
		t.Skip("INPOD_ATTACK=1 runs the in-pod open-streams flood measurement")
	}
	netnstest.Require(t, "iptables")
	node, nsA, nsB, dir := inPodTopology(t)
	echoAddr := inPodB + ":9000"
	startPodEcho(t, nsB, echoAddr)
	agent := inpodtest.NewAgent(t, inpodtest.SocketPath(t))
	env := inPodEnv(agent.Path, dir)
	env["DNS_PROXY_ADDR"] = "off"
	n, _ := startNode(t, testConfig(t, env))
	zds := agent.Accept()
	addClientServer(t, t, zds, nsA, nsB)
	if code, body := waitReady(t, n, "ready\n"); code != 200 {
		t.Fatalf("readiness after the snapshot: %d %q", code, body)
	}
	certPEM := identityPEM(t, n, "spiffe://cluster.local/ns/default/sa/attacker")
	trips, rounds := envInt(t, "INPOD_ATTACK_TRIPS", 3000), envInt(t, "INPOD_ATTACK_ROUNDS", 3)
	kind := cmp.Or(os.Getenv("INPOD_ATTACK_KIND"), "open-streams")
	measure := func(prefix string) {
		for r := range rounds {
			var noneP99 time.Duration
			for _, name := range []string{"none", "burn", kind, "none-again"} {
				victim, err := dialIn(nsA, "tcp", echoAddr)
				if err != nil {
					t.Fatal(err)
				}
				refused0, start := sourceRefusals(t, n), time.Now()
				var a *attack.Attacker
				if name == kind || name == "burn" {
					a = attack.Start(t, attack.Spec{
						Test: "TestInPodAttackerProcess", Kind: name, Addr: inPodB + ":15008", Dst: echoAddr, CertPEM: certPEM,
						Prefix: []string{"ip", "netns", "exec", node.Name},
					})
				}
				v, err := attack.RoundTrips(victim, trips, 500, 1024)
				refused := (sourceRefusals(t, n) - refused0) / time.Since(start).Seconds()
				victim.Close()
				if err != nil {
					t.Fatalf("round %d %s%s: victim: %v", r, prefix, name, err)
				}
				ops := 0.0
				if a != nil {
					ops, _ = a.Stop(t)
				}
				if name == "none" {
					noneP99 = v.P99
				}
				t.Logf("round %d %-18s p50 %6dµs p99 %6dµs %5.2f×none  sched p99 %6dµs  goroutines %4d  cpu %.3f  attack %.0f ops/s  refused %.0f/s",
					r, prefix+name, v.P50.Microseconds(), v.P99.Microseconds(), float64(v.P99)/float64(noneP99), v.SchedP99.Microseconds(), v.Goroutines, v.CPU, ops, refused)
			}
		}
	}
	measure("")
	control := os.Getenv("HBONE_CONTROL")
	if control == "" {
		return
	}
	// The control: pod B leaves the node (its listeners close) and loses istio-cni's
	// rules, and Istio's Go HBONE server takes its 15008 with pod B's identity; pod A's
	// client still goes through the node, which dials pod B's 15008 over HBONE.
	if nack := zds.Send(inpodtest.DelReq("uid-b")); nack != "" {
		t.Fatalf("delete pod B: NACK %q", nack)
	}
	for _, ipt := range []string{"iptables", "ip6tables"} {
		for _, table := range []string{"nat", "mangle"} {
			nsB.MustExec(t, ipt, "-t", table, "-F")
		}
	}
	serverPEM := identityPEM(t, n, "spiffe://cluster.local/ns/default/sa/server")
	testutil.Eventually(t, "pod B's 15008 to be free", func() bool {
		return nsB.Do(func() error {
			ln, err := net.Listen("tcp", inPodB+":15008")
			if err == nil {
				ln.Close()
			}
			return err
		}) == nil
	})
	attack.StartControl(t, control, inPodB+":15008", serverPEM, "ip", "netns", "exec", nsB.Name)
	measure("istio-")
}

// sourceRefusals is how many HBONE connections the node has refused for their source's
// budgets (hbone_dropped_total's source_* reasons).
func sourceRefusals(t *testing.T, n *ztunnel) float64 {
	m := testutil.Gather(t, n.registry)
	sum := 0.0
	for _, r := range []string{"source_handshakes", "source_handshake_rate", "source_failed_handshakes"} {
		v, _ := m.Sum("hbone_dropped_total", map[string]string{"reason": r})
		sum += v
	}
	return sum
}

// startPodEcho serves an echo on addr inside ns until the test ends.
func startPodEcho(t *testing.T, ns *netnstest.NS, addr string) {
	t.Helper()
	var ln net.Listener
	if err := ns.Do(func() (err error) {
		ln, err = net.Listen("tcp", addr)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() {
				defer c.Close()
				io.Copy(c, c)
			})
		}
	})
}

// identityPEM is a certificate chain and key for id from the node's CA, PEM.
func identityPEM(t *testing.T, n *ztunnel, id string) string {
	t.Helper()
	cfg, err := n.certs.ClientConfig(context.Background(), identity.MustParse(id), []identity.ID{identity.MustParse("spiffe://cluster.local/ns/default/sa/server")})
	if err != nil {
		t.Fatal(err)
	}
	c, err := cfg.GetClientCertificate(&tls.CertificateRequestInfo{})
	if err != nil {
		t.Fatal(err)
	}
	pem, err := attack.CertPEM(*c)
	if err != nil {
		t.Fatal(err)
	}
	return pem
}

// TestInPodAttackerProcess is not a test: it is TestInPodOpenStreamsBench's attacker
// process (attack.Main).
func TestInPodAttackerProcess(t *testing.T) {
	if !attack.Child() {
		t.Skip("run by TestInPodOpenStreamsBench")
	}
	if err := attack.Main(); err != nil {
		t.Fatal(err)
	}
}
