//go:build linux

package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/internal/attack"
	"github.com/gozt/gozt/internal/netns/netnstest"
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
// nothing), open-streams, none-again, INPOD_ATTACK_ROUNDS times (default 3). It logs the victim's p50 and p99, p99 against the
// round's none, the node's goroutine peak and the Go scheduler's p99 latency. It runs only
// with INPOD_ATTACK=1 (and root): it measures, it asserts nothing about speed.
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
	addClientServer(t, t, agent.Accept(), nsA, nsB)
	if code, body := waitReady(t, n, "ready\n"); code != 200 {
		t.Fatalf("readiness after the snapshot: %d %q", code, body)
	}
	certPEM := identityPEM(t, n, "spiffe://cluster.local/ns/default/sa/attacker")
	trips, rounds := envInt(t, "INPOD_ATTACK_TRIPS", 3000), envInt(t, "INPOD_ATTACK_ROUNDS", 3)
	for r := range rounds {
		var noneP99 time.Duration
		for _, name := range []string{"none", "burn", "open-streams", "none-again"} {
			victim, err := dialIn(nsA, "tcp", echoAddr)
			if err != nil {
				t.Fatal(err)
			}
			var stop func() float64
			if name == "open-streams" || name == "burn" {
				stop = startPodAttacker(t, node, name, inPodB+":15008", echoAddr, certPEM)
			}
			v, err := attack.RoundTrips(victim, trips, 500, 1024)
			victim.Close()
			if err != nil {
				t.Fatalf("round %d %s: victim: %v", r, name, err)
			}
			ops := 0.0
			if stop != nil {
				ops = stop()
			}
			if name == "none" {
				noneP99 = v.P99
			}
			t.Logf("round %d %-12s p50 %6dµs p99 %6dµs %5.2f×none  sched p99 %6dµs  goroutines %4d  attack %.0f ops/s",
				r, name, v.P50.Microseconds(), v.P99.Microseconds(), float64(v.P99)/float64(noneP99), v.SchedP99.Microseconds(), v.Goroutines, ops)
		}
	}
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
func identityPEM(t *testing.T, n *node, id string) string {
	t.Helper()
	cfg, err := n.certs.ClientConfig(context.Background(), identity.MustParse(id), []identity.ID{identity.MustParse("spiffe://cluster.local/ns/default/sa/server")})
	if err != nil {
		t.Fatal(err)
	}
	c, err := cfg.GetClientCertificate(&tls.CertificateRequestInfo{})
	if err != nil {
		t.Fatal(err)
	}
	key, err := x509.MarshalPKCS8PrivateKey(c.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	var out []byte
	for _, der := range c.Certificate {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	return string(append(out, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key})...))
}

// Set by TestInPodOpenStreamsBench in the attacker process it starts.
const (
	podAttack      = "GOZT_POD_ATTACK"        // open-streams or burn
	podAttackAddr  = "GOZT_POD_ATTACK_ADDR"   // pod B's 15008
	podAttackDst   = "GOZT_POD_ATTACK_TARGET" // the CONNECT authority
	podAttackCreds = "GOZT_POD_ATTACK_CERT"   // PEM chain and key
)

// startPodAttacker runs this test binary as the attacker process in ns; the returned
// function stops it and returns its CONNECTs a second.
func startPodAttacker(t *testing.T, ns *netnstest.NS, name, addr, dst, certPEM string) (stop func() float64) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("ip", "netns", "exec", ns.Name, exe, "-test.run=^TestInPodAttackerProcess$", "-test.v=false")
	cmd.Env = append(os.Environ(), podAttack+"="+name, podAttackAddr+"="+addr, podAttackDst+"="+dst, podAttackCreds+"="+certPEM)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	out := bufio.NewScanner(stdout)
	if !out.Scan() || out.Text() != "ready" {
		stdin.Close()
		cmd.Wait()
		t.Fatalf("attacker did not start: %q", out.Text())
	}
	return func() float64 {
		stdin.Close()
		var rate float64
		for out.Scan() {
			if _, err := fmt.Sscanf(out.Text(), "ops/s %g", &rate); err == nil {
				break
			}
		}
		if err := cmd.Wait(); err != nil {
			t.Errorf("attacker: %v", err)
		}
		return rate
	}
}

// TestInPodAttackerProcess is not a test: it is TestInPodOpenStreamsBench's attacker
// process. It attacks until its standard input closes, then prints its operations a
// second (CONNECTs, or a burner's turns).
func TestInPodAttackerProcess(t *testing.T) {
	addr := os.Getenv(podAttackAddr)
	if addr == "" {
		t.Skip("run by TestInPodOpenStreamsBench")
	}
	creds := []byte(os.Getenv(podAttackCreds))
	cert, err := tls.X509KeyPair(creds, creds)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, NextProtos: []string{http2.NextProtoTLS}}
	stop := make(chan struct{})
	var ops atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		if os.Getenv(podAttack) == "burn" {
			wg.Go(func() { attack.Burn(stop, &ops) })
		} else {
			wg.Go(func() { attack.H2Flood(addr, os.Getenv(podAttackDst), cfg, 0, false, stop, &ops) })
		}
	}
	for ops.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	start, ops0 := time.Now(), ops.Load()
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin)
	n := ops.Load() - ops0
	close(stop)
	wg.Wait()
	fmt.Printf("ops/s %g\n", float64(n)/time.Since(start).Seconds())
}
