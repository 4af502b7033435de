package proxy_test

import (
	"bufio"
	"bytes"
	"cmp"
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

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
			var a *attack.Attacker
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
				ops, _ := a.Stop(b)
				b.ReportMetric(ops, "attack-ops/s")
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
func attackerPEM(b *testing.B, m *mesh) string { return principalPEM(b, m, clientPrinc, serverPrinc) }

// principalPEM is a certificate chain and key, PEM, for principal (as the mesh's CA issues it
// through node A's certificate manager), for a process of the benchmark's.
func principalPEM(b *testing.B, m *mesh, principal, peer string) string {
	b.Helper()
	cfg, err := m.a.certs.ClientConfig(context.Background(), identity.MustParse("spiffe://"+principal),
		[]identity.ID{identity.MustParse("spiffe://" + peer)})
	if err != nil {
		b.Fatal(err)
	}
	c, err := cfg.GetClientCertificate(&tls.CertificateRequestInfo{})
	if err != nil {
		b.Fatal(err)
	}
	pem, err := attack.CertPEM(*c)
	if err != nil {
		b.Fatal(err)
	}
	return pem
}

// startNodeAttacker starts the attacker process (attack.Main) against node B's 15008.
func startNodeAttacker(b *testing.B, kind, addr, target, certPEM string) *attack.Attacker {
	return attack.Start(b, attack.Spec{Test: "TestNodeAttackerProcess", Kind: kind, Addr: addr, Dst: target, CertPEM: certPEM})
}

// TestNodeAttackerProcess is not a test: it is the attacker process of the victim
// benchmarks (attack.Main).
func TestNodeAttackerProcess(t *testing.T) {
	if !attack.Child() {
		t.Skip("run by BenchmarkVictimUnderAttackNodes and BenchmarkVictimOpenStreams")
	}
	if err := attack.Main(); err != nil {
		t.Fatal(err)
	}
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
//
// VICTIM_ATTACK names another attack of attack.Main's (stalled-tls, say) to run instead.
// With VICTIM_NODE_PROCESS set, the same rounds run again with node B in a process of its
// own (process-none, ...), as the control's server runs: node B's work for the attack then
// shares no Ps with node A, the victim and the backend. With HBONE_CONTROL set to a binary
// built from tools/istio/hbonecontrol (`make hbone-control`), they run once more with
// Istio's own Go HBONE server in node B's place (istio-none, istio-open-streams,
// istio-none-again): the control for what the attack does to the client of a server that
// is not gozt. It also reports the CPU this process used a second (both nodes, the victim
// and the backend; not the attacker's, node B's own process's or the control's).
func BenchmarkVictimOpenStreams(b *testing.B) {
	m := startMesh(b)
	be := startBackend(b, m.serverIP+":0", echo)
	target := net.JoinHostPort(m.serverIP, strconv.Itoa(int(be.port())))
	certPEM := attackerPEM(b, m)
	kind := cmp.Or(os.Getenv("VICTIM_ATTACK"), "open-streams")
	rounds := func(prefix string) {
		var noneP99 time.Duration
		for _, name := range []string{"none", kind, "none-again"} {
			b.Run(prefix+name, func(b *testing.B) {
				if b.N == 1 && !smokeRun() {
					// The testing package's probe before the measured run: an attack
					// started and stopped here would leave its backlog to that run.
					return
				}
				// A server still working off the last round's attack may not take the
				// victim's connection at once: wait for it, and report how long it took.
				t0 := time.Now()
				victim, code, err := socksConnect(m.a.socks(b), m.serverIP, be.port())
				for err != nil && time.Since(t0) < time.Minute {
					time.Sleep(100 * time.Millisecond)
					victim, code, err = socksConnect(m.a.socks(b), m.serverIP, be.port())
				}
				if err != nil {
					b.Fatalf("victim: socks5 code %d: %v", code, err)
				}
				defer victim.Close()
				if waited := time.Since(t0); waited > time.Second {
					b.ReportMetric(waited.Seconds(), "connect-s")
				}
				var a *attack.Attacker
				if name == kind {
					a = startNodeAttacker(b, name, m.serverIP+":15008", target, certPEM)
				}
				v, err := attack.RoundTrips(victim, b.N, victimRate, 1024)
				if err != nil {
					b.Fatal(err)
				}
				if a != nil {
					ops, _ := a.Stop(b)
					b.ReportMetric(ops, "attack-ops/s")
				}
				if name == "none" {
					noneP99 = v.P99
				}
				reportVictim(b, v, noneP99)
			})
		}
	}
	rounds("")
	control := os.Getenv("HBONE_CONTROL")
	if control == "" && os.Getenv("VICTIM_NODE_PROCESS") == "" {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := m.b.shutdown(ctx); err != nil {
		b.Fatal(err)
	}
	if os.Getenv("VICTIM_NODE_PROCESS") != "" {
		stop := startNodeProcess(b, m)
		rounds("process-")
		stop()
	}
	if control != "" {
		attack.StartControl(b, control, m.serverIP+":15008", principalPEM(b, m, serverPrinc, clientPrinc))
		rounds("istio-")
	}
}

// startNodeProcess runs node B again in a process of its own (this test binary,
// TestNodeBProcess), as the control runs: the attacked node's work then shares no Ps
// with node A, the victim and the backend. stop ends it.
func startNodeProcess(b *testing.B, m *mesh) (stop func()) {
	b.Helper()
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^TestNodeBProcess$", "-test.v=false", "-test.cpuprofile=")
	cmd.Env = append(os.Environ(), "GOZT_NODE_B=1", "GOZT_NODE_B_CA="+m.caDir, "GOZT_NODE_B_YAML="+m.yaml, "GOZT_NODE_B_IP="+m.serverIP)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	stop = sync.OnceFunc(func() {
		stdin.Close()
		cmd.Wait()
	})
	b.Cleanup(stop)
	if line, _ := bufio.NewReader(stdout).ReadString('\n'); line != "ready\n" {
		b.Fatalf("node B process did not start: %q", line)
	}
	return stop
}

// TestNodeBProcess is not a test: it is node B in a process of its own, for
// BenchmarkVictimOpenStreams (VICTIM_NODE_PROCESS).
func TestNodeBProcess(t *testing.T) {
	if os.Getenv("GOZT_NODE_B") == "" {
		t.Skip("run by BenchmarkVictimOpenStreams")
	}
	m := &mesh{caDir: os.Getenv("GOZT_NODE_B_CA"), yaml: os.Getenv("GOZT_NODE_B_YAML"), serverIP: os.Getenv("GOZT_NODE_B_IP")}
	startNode(t, "node-b", m.caDir, m.yaml, m.serverConfig())
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin)
}

// smokeRun reports a -benchtime 1x run (make bench-smoke), whose only run is the probe.
func smokeRun() bool {
	f := flag.Lookup("test.benchtime")
	return f != nil && f.Value.String() == "1x"
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
	b.ReportMetric(v.CPU, "cpu-s/s")
}
