package proxy_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/attack"
)

// BenchmarkVictimUnderAttackNodes is BenchmarkVictimUnderAttack (hbone) end to end: an
// honest client's 1 KiB round trips through node A (SOCKS5) → HBONE → node B → an echo
// backend, two real proxy nodes in this process, while an attacker process (this test
// binary re-executed) attacks node B's 15008:
//
//   - connect-flood: 4 mTLS connections presenting node A's valid identity, each sending
//     about 1000 CONNECTs a second to the live backend and never reading a byte;
//   - stalled-tls: 2,000 TCP connections held open that each sent a ClientHello (the
//     node owes it a key exchange) and then nothing, one replaced every millisecond;
//   - rapid-reset: 4 such connections sending CONNECT then RST_STREAM, as fast as they go.
//
// The controls run in the same round: none, and spin (an attacker process at SCHED_IDLE
// that only burns CPU, which keeps idle vCPUs awake). The attacks run at normal priority,
// paced by their own rates. It reports the victim's p50 and p99, p99 as a ratio to none
// and to spin, and the attack's operations (CONNECTs, connections, frames) a second.
func BenchmarkVictimUnderAttackNodes(b *testing.B) {
	m := startMesh(b)
	be := startBackend(b, m.serverIP+":0", echo)
	target := net.JoinHostPort(m.serverIP, strconv.Itoa(int(be.port())))
	certPEM := attackerPEM(b, m)
	var noneP99, spinP99 time.Duration
	for _, name := range []string{"none", "spin", "connect-flood", "stalled-tls", "rapid-reset", "spin-again", "none-again"} {
		b.Run(name, func(b *testing.B) {
			victim, code, err := socksConnect(m.a.socks(b), m.serverIP, be.port())
			if err != nil {
				b.Fatalf("victim: socks5 code %d: %v", code, err)
			}
			defer victim.Close()
			msg := bytes.Repeat([]byte("v"), 1024)
			buf := make([]byte, len(msg))
			roundTrip := func() {
				if _, err := victim.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(victim, buf); err != nil {
					b.Fatal(err)
				}
			}
			roundTrip()
			var a *nodeAttacker
			if !strings.HasPrefix(name, "none") {
				a = startNodeAttacker(b, strings.TrimSuffix(name, "-again"), m.serverIP+":15008", target, certPEM)
			}
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				roundTrip()
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			if a != nil {
				b.ReportMetric(a.stop(b), "attack-ops/s")
			}
			slices.Sort(lat)
			p99 := lat[len(lat)*99/100]
			switch name {
			case "none":
				noneP99 = p99
			case "spin":
				spinP99 = p99
			}
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(p99.Microseconds()), "p99-µs")
			if noneP99 > 0 {
				b.ReportMetric(float64(p99)/float64(noneP99), "p99/none")
			}
			if spinP99 > 0 {
				b.ReportMetric(float64(p99)/float64(spinP99), "p99/spin")
			}
		})
	}
}

// attackerPEM is node A's client certificate chain and key, PEM, for the attacker process.
func attackerPEM(b *testing.B, m *mesh) string {
	b.Helper()
	cfg, err := m.a.certs.ClientConfig(context.Background(), identity.MustParse("spiffe://"+clientPrinc),
		[]identity.ID{identity.MustParse("spiffe://" + serverPrinc)})
	if err != nil {
		b.Fatal(err)
	}
	c, err := cfg.GetClientCertificate(&tls.CertificateRequestInfo{})
	if err != nil {
		b.Fatal(err)
	}
	key, err := x509.MarshalPKCS8PrivateKey(c.PrivateKey)
	if err != nil {
		b.Fatal(err)
	}
	var out []byte
	for _, der := range c.Certificate {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	return string(append(out, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key})...))
}

// Set by the benchmark in the attacker process it starts.
const (
	nodeAttackEnv   = "GOZT_NODE_ATTACK"        // attack name
	nodeAttackAddr  = "GOZT_NODE_ATTACK_ADDR"   // node B's 15008
	nodeAttackDst   = "GOZT_NODE_ATTACK_TARGET" // the backend, as a CONNECT authority
	nodeAttackCreds = "GOZT_NODE_ATTACK_CERT"   // PEM chain and key
)

// TestNodeAttackerProcess is not a test: it is the attacker process of
// BenchmarkVictimUnderAttackNodes. It attacks until its standard input closes, then
// prints its operations a second.
func TestNodeAttackerProcess(t *testing.T) {
	name := os.Getenv(nodeAttackEnv)
	if name == "" {
		t.Skip("run by BenchmarkVictimUnderAttackNodes")
	}
	creds := []byte(os.Getenv(nodeAttackCreds))
	cert, err := tls.X509KeyPair(creds, creds)
	if err != nil {
		t.Fatal(err)
	}
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, NextProtos: []string{http2.NextProtoTLS}}
	addr, dst := os.Getenv(nodeAttackAddr), os.Getenv(nodeAttackDst)
	stop := make(chan struct{})
	var ops atomic.Int64
	var wg sync.WaitGroup
	run := func(n int, f func()) {
		for range n {
			wg.Add(1)
			go func() { defer wg.Done(); f() }()
		}
	}
	switch name {
	case "spin":
		run(2, func() {
			runtime.LockOSThread() // SCHED_IDLE on this thread only
			unix.SchedSetAttr(0, &unix.SchedAttr{Policy: unix.SCHED_IDLE}, 0)
			for {
				select {
				case <-stop:
					return
				default:
					ops.Add(1)
				}
			}
		})
	case "connect-flood":
		run(4, func() { attack.H2Flood(addr, dst, cfg, time.Millisecond, false, stop, &ops) })
	case "rapid-reset":
		run(4, func() { attack.H2Flood(addr, dst, cfg, 0, true, stop, &ops) })
	case "open-streams":
		run(4, func() { attack.H2Flood(addr, dst, cfg, 0, false, stop, &ops) })
	case "stalled-tls":
		run(1, func() { attack.StalledTLS(addr, cfg, 2000, stop, &ops) })
	default:
		t.Fatalf("unknown attack %q", name)
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

// nodeAttacker is an attacker process started by startNodeAttacker.
type nodeAttacker struct {
	cmd   *exec.Cmd
	stdin io.Closer
	out   *bufio.Scanner
}

func startNodeAttacker(b *testing.B, name, addr, target, certPEM string) *nodeAttacker {
	b.Helper()
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	a := &nodeAttacker{cmd: exec.Command(exe, "-test.run=^TestNodeAttackerProcess$", "-test.v=false", "-test.cpuprofile=")}
	a.cmd.Env = append(os.Environ(), nodeAttackEnv+"="+name, nodeAttackAddr+"="+addr, nodeAttackDst+"="+target, nodeAttackCreds+"="+certPEM)
	a.cmd.Stderr = os.Stderr
	stdin, err := a.cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := a.cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	a.stdin, a.out = stdin, bufio.NewScanner(stdout)
	if err := a.cmd.Start(); err != nil {
		b.Fatal(err)
	}
	if !a.out.Scan() || a.out.Text() != "ready" {
		stdin.Close()
		a.cmd.Wait()
		b.Fatalf("attacker %s did not start: %q", name, a.out.Text())
	}
	return a
}

// stop ends the attack and returns its operations a second.
func (a *nodeAttacker) stop(b *testing.B) float64 {
	b.Helper()
	a.stdin.Close()
	var rate float64
	for a.out.Scan() {
		if _, err := fmt.Sscanf(a.out.Text(), "ops/s %g", &rate); err == nil {
			break
		}
	}
	if err := a.cmd.Wait(); err != nil {
		b.Fatalf("attacker: %v", err)
	}
	return rate
}

// BenchmarkVictimOpenStreams measures the open-streams flood of issue 50 end to end: an
// honest client makes paced 1 KiB round trips (victimRate a second) through node A →
// HBONE → node B → an echo backend on one long-lived connection, while an attacker
// process opens CONNECT streams to the live backend on 4 mTLS connections as fast as it
// can, never reading a byte, and reconnects as node B closes each. Each round makes b.N
// round trips (-benchtime 3000x: 6 s a round): none, open-streams, none-again.
// It reports the victim's p50 and p99, p99 as a ratio to none, the attack's CONNECTs a
// second, the most goroutines this process had, and the p99 of the Go scheduler's
// latency (how long runnable goroutines waited) over the round.
func BenchmarkVictimOpenStreams(b *testing.B) {
	m := startMesh(b)
	be := startBackend(b, m.serverIP+":0", echo)
	target := net.JoinHostPort(m.serverIP, strconv.Itoa(int(be.port())))
	certPEM := attackerPEM(b, m)
	var noneP99 time.Duration
	for _, name := range []string{"none", "open-streams", "none-again"} {
		b.Run(name, func(b *testing.B) {
			victim, code, err := socksConnect(m.a.socks(b), m.serverIP, be.port())
			if err != nil {
				b.Fatalf("victim: socks5 code %d: %v", code, err)
			}
			defer victim.Close()
			var a *nodeAttacker
			if name == "open-streams" {
				a = startNodeAttacker(b, name, m.serverIP+":15008", target, certPEM)
			}
			v, err := attack.RoundTrips(victim, b.N, victimRate, 1024)
			if err != nil {
				b.Fatal(err)
			}
			if a != nil {
				b.ReportMetric(a.stop(b), "attack-ops/s")
			}
			if name == "none" {
				noneP99 = v.P99
			}
			reportVictim(b, v, noneP99)
		})
	}
}

// victimRate is the honest client's pace: round trips a second.
const victimRate = 500

// reportVictim reports what the victim saw, its p99 also as a ratio to baseP99 (if set).
func reportVictim(b *testing.B, v attack.Victim, baseP99 time.Duration) {
	b.ReportMetric(float64(v.P50.Microseconds()), "p50-µs")
	b.ReportMetric(float64(v.P99.Microseconds()), "p99-µs")
	if baseP99 > 0 {
		b.ReportMetric(float64(v.P99)/float64(baseP99), "p99/none")
	}
	b.ReportMetric(float64(v.SchedP99.Microseconds()), "sched-p99-µs")
	b.ReportMetric(float64(v.Goroutines), "max-goroutines")
}
