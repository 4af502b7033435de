package hbone

import (
	"bytes"
	"flag"
	"io"
	"runtime"
	"slices"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/hbone/internal/testcert"
	"github.com/gozt/gozt/internal/attack"
)

// attacks are the hostile peers BenchmarkVictimUnderAttack sets on the server: each is
// an internal/attack kind run two at a time (two connections, or two threads), its
// HTTP/2 floods reading what the server sends as a client does. Between them run two
// controls: "none", and "spin", an attacker process that only burns the CPU it is given
// (burn, at the attacker's scheduling). A VM's idle vCPUs halt to the host, and a message
// that finds one asleep waits for it to wake (docs/PERFORMANCE.md): any busy process, at
// whatever priority, keeps them awake and so makes the victim faster. The attacks are
// compared with "spin".
var attacks = []struct{ name, kind string }{
	{"none", ""},
	{"spin", "burn"},
	{"rapid-reset", "rapid-reset"},
	{"connect-flood", "open-streams"}, // never answered with a byte or a WINDOW_UPDATE: each holds a handler, a backend socket and its stream
	{"ping", "ping"},
	{"settings", "settings"},
	{"empty-data", "empty-data"},
	{"no-tls", "no-tls"},
	{"untrusted-cert", "handshakes"}, // with a certificate of a CA the server does not trust
	{"spin-again", "burn"},
	{"none-again", ""},
}

var (
	victimSched = flag.String("victim.attacker", "idle", "BenchmarkVictimUnderAttack: the attacker process's scheduling: idle (SCHED_IDLE), nice (nice 19) or normal")
	victimCPU   = flag.Int("victim.attackcpu", -1, "BenchmarkVictimUnderAttack: pin the attacker process to this CPU (-1: any)")
)

// TestAttackerProcess is not a test: it is the attacker process BenchmarkVictimUnderAttack
// starts from this test binary (attack.Main).
func TestAttackerProcess(t *testing.T) {
	if !attack.Child() {
		t.Skip("run by BenchmarkVictimUnderAttack")
	}
	if err := attack.Main(); err != nil {
		t.Fatal(err)
	}
}

// startAttacker runs attack kind against addr in a child process scheduled as
// -victim.attacker and -victim.attackcpu say, and returns once it is attacking.
func startAttacker(b *testing.B, name, kind, addr string) *attack.Attacker {
	b.Helper()
	cert := cliTLS.Certificates[0]
	if name == "untrusted-cert" {
		cert = testcert.NewCA().Issue(clientID)
	}
	certPEM, err := attack.CertPEM(cert)
	if err != nil {
		b.Fatal(err)
	}
	s := attack.Spec{
		Test: "TestAttackerProcess", Kind: kind, Addr: addr, Dst: "10.0.0.1:80", CertPEM: certPEM,
		Parallel: 2, Read: true, Sched: *victimSched,
	}
	if *victimCPU >= 0 {
		s.Affinity = []int{*victimCPU}
	}
	return attack.Start(b, s)
}

func selfCPU() float64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

// BenchmarkVictimUnderAttack measures a well-behaved client's 1 KiB round trips (through
// a proxy-like handler to a TCP echo backend) while a hostile peer in another process
// attacks the same server over two connections at a time. The attacker process runs at
// SCHED_IDLE by default (-victim.attacker, -victim.attackcpu), so it gets only the CPU
// this process leaves idle: what the victim loses is what the server spends on the
// attack, not the attacker's own work; the attack's rate is what that idle CPU allows, so
// read it beside the latency. It reports the victim's p50 and p99, p99 as a ratio to
// "none" and to "spin" of the same round, this process's CPU seconds per second (server,
// victim and backend), the attack's operations (frames or connections) per second, the
// attacker's CPU seconds per second, and the heap the server grew by.
func BenchmarkVictimUnderAttack(b *testing.B) {
	testCA()
	var noneP99, spinP99 time.Duration
	for _, at := range attacks {
		b.Run(at.name, func(b *testing.B) {
			backend, stopBackend := tcpEcho(b)
			defer stopBackend()
			e := newEnv(b, ServerConfig{}, proxyTo(backend))
			s := e.dial(b, "10.0.0.1:80")
			defer s.Close()
			msg := bytes.Repeat([]byte("v"), 1024)
			buf := make([]byte, len(msg))
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			heap0 := ms.HeapInuse
			var a *attack.Attacker
			if at.kind != "" {
				a = startAttacker(b, at.name, at.kind, e.ln.Addr().String())
			}
			lat := make([]time.Duration, 0, b.N)
			cpu0, wall0 := selfCPU(), time.Now()
			b.ResetTimer()
			for range b.N {
				t0 := time.Now()
				if _, err := s.Write(msg); err != nil {
					b.Fatal(err)
				}
				if _, err := io.ReadFull(s, buf); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			cpu := (selfCPU() - cpu0) / time.Since(wall0).Seconds()
			runtime.ReadMemStats(&ms)
			if a != nil {
				ops, acpu := a.Stop(b)
				b.ReportMetric(ops, "attack-ops/s")
				b.ReportMetric(acpu, "attacker-cpu")
			}
			slices.Sort(lat)
			p99 := lat[len(lat)*99/100]
			switch at.name {
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
			b.ReportMetric(cpu, "cpu")
			b.ReportMetric(float64(int64(ms.HeapInuse)-int64(heap0))/(1<<20), "heap-MiB")
		})
	}
}
