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
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"golang.org/x/sys/unix"

	"github.com/gozt/gozt/identity"
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
		run(4, func() { h2Flood(addr, dst, cfg, time.Millisecond, false, stop, &ops) })
	case "rapid-reset":
		run(4, func() { h2Flood(addr, dst, cfg, 0, true, stop, &ops) })
	case "open-streams":
		run(4, func() { h2Flood(addr, dst, cfg, 0, false, stop, &ops) })
	case "stalled-tls":
		run(1, func() { stalledTLS(addr, cfg, 2000, stop, &ops) })
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

// h2Flood keeps one mTLS HTTP/2 connection to addr sending CONNECT dst, one per every
// (0: as fast as it can), each followed by RST_STREAM with reset; it never reads. When the
// node closes the connection it opens another.
func h2Flood(addr, dst string, cfg *tls.Config, every time.Duration, reset bool, stop <-chan struct{}, ops *atomic.Int64) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		tc, err := tls.Dial("tcp", addr, cfg)
		if err != nil {
			time.Sleep(10 * time.Millisecond) // refused: the node's answer
			continue
		}
		context.AfterFunc(stopCtx(stop), func() { tc.Close() })
		fr := http2.NewFramer(tc, tc)
		var hbuf bytes.Buffer
		enc := hpack.NewEncoder(&hbuf)
		if _, err := tc.Write([]byte(http2.ClientPreface)); err != nil || fr.WriteSettings() != nil {
			tc.Close()
			continue
		}
		next := time.Now()
		for id := uint32(1); id < 1<<31; id += 2 {
			if every > 0 {
				next = next.Add(every)
				time.Sleep(time.Until(next))
			}
			hbuf.Reset()
			enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
			enc.WriteField(hpack.HeaderField{Name: ":authority", Value: dst})
			if fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: hbuf.Bytes(), EndHeaders: true}) != nil {
				break
			}
			if reset && fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
				break
			}
			ops.Add(1)
		}
		tc.Close()
	}
}

// stalledTLS holds up to hold TCP connections to addr open, each having sent a
// ClientHello and nothing more; past hold, one is replaced every millisecond.
func stalledTLS(addr string, cfg *tls.Config, hold int, stop <-chan struct{}, ops *atomic.Int64) {
	hello := firstFlight(cfg)
	var open []net.Conn
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for {
		select {
		case <-stop:
			return
		default:
		}
		if len(open) == hold {
			time.Sleep(time.Millisecond)
			open[0].Close()
			open = open[1:]
		}
		c, err := net.DialTimeout("tcp", addr, time.Second)
		if err != nil {
			continue
		}
		c.Write(hello)
		open = append(open, c)
		ops.Add(1)
	}
}

// firstFlight is a TLS client's ClientHello record with cfg.
func firstFlight(cfg *tls.Config) []byte {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	go tls.Client(a, cfg).Handshake()
	hdr := make([]byte, 5)
	io.ReadFull(b, hdr)
	body := make([]byte, int(hdr[3])<<8|int(hdr[4]))
	io.ReadFull(b, body)
	return append(hdr, body...)
}

func stopCtx(stop <-chan struct{}) context.Context {
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-stop; cancel() }()
	return ctx
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
// can, never reading a byte, and reconnects as node B closes each. Each round runs for
// victimRound whatever b.N (run it with -benchtime 1x): none, open-streams, none-again.
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
			r := pacedVictim(b, victim)
			if a != nil {
				b.ReportMetric(a.stop(b), "attack-ops/s")
			}
			if name == "none" {
				noneP99 = r.p99
			}
			r.report(b, noneP99)
		})
	}
}

// victimRate and victimRound are the honest client's pace and each round's length.
const (
	victimRate  = 500
	victimRound = 6 * time.Second
)

// victimResult is what a paced victim saw in a round.
type victimResult struct {
	p50, p99, schedP99 time.Duration
	goroutines         int
}

func (r victimResult) report(b *testing.B, baseP99 time.Duration) {
	b.ReportMetric(float64(r.p50.Microseconds()), "p50-µs")
	b.ReportMetric(float64(r.p99.Microseconds()), "p99-µs")
	if baseP99 > 0 {
		b.ReportMetric(float64(r.p99)/float64(baseP99), "p99/none")
	}
	b.ReportMetric(float64(r.schedP99.Microseconds()), "sched-p99-µs")
	b.ReportMetric(float64(r.goroutines), "max-goroutines")
}

// pacedVictim makes 1 KiB round trips on c, victimRate a second, for victimRound.
func pacedVictim(b *testing.B, c net.Conn) victimResult {
	msg := bytes.Repeat([]byte("v"), 1024)
	buf := make([]byte, len(msg))
	sched0 := schedLatencies()
	stopPeak := goroutinePeak()
	lat := make([]time.Duration, 0, int(victimRound.Seconds()*victimRate))
	next := time.Now()
	for end := next.Add(victimRound); time.Now().Before(end); {
		time.Sleep(time.Until(next))
		next = next.Add(time.Second / victimRate)
		t0 := time.Now()
		if _, err := c.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(t0))
	}
	slices.Sort(lat)
	return victimResult{
		p50: lat[len(lat)/2], p99: lat[len(lat)*99/100],
		schedP99: histQuantile(sched0, schedLatencies(), 0.99), goroutines: stopPeak(),
	}
}

// goroutinePeak samples this process's goroutines every 2 ms until the returned function
// is called, which returns the most seen.
func goroutinePeak() (stop func() int) {
	done := make(chan struct{})
	peak := 0
	var wg sync.WaitGroup
	wg.Go(func() {
		tick := time.NewTicker(2 * time.Millisecond)
		defer tick.Stop()
		for {
			peak = max(peak, runtime.NumGoroutine())
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	})
	return func() int { close(done); wg.Wait(); return peak }
}

// schedLatencies is the Go scheduler's histogram of how long goroutines waited to run.
func schedLatencies() *metrics.Float64Histogram {
	s := []metrics.Sample{{Name: "/sched/latencies:seconds"}}
	metrics.Read(s)
	return s[0].Value.Float64Histogram()
}

// histQuantile is the q quantile of what after counted beyond before (the upper bound of
// the bucket it falls in).
func histQuantile(before, after *metrics.Float64Histogram, q float64) time.Duration {
	var total uint64
	for i := range after.Counts {
		total += after.Counts[i] - before.Counts[i]
	}
	want := uint64(float64(total) * q)
	var seen uint64
	for i := range after.Counts {
		if seen += after.Counts[i] - before.Counts[i]; seen > want {
			return time.Duration(after.Buckets[i+1] * float64(time.Second))
		}
	}
	return 0
}
