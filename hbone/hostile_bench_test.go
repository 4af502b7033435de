package hbone

import (
	"bufio"
	"bytes"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/hbone/internal/testcert"
	"golang.org/x/net/http2"
	"golang.org/x/sys/unix"
)

// floodConn is what one hostile connection sends, frame after frame, until the server
// ends the connection.
type floodConn func(p *rawPeer, i int) error

var floods = []struct {
	name string
	send floodConn
}{
	{"rapid-reset", func(p *rawPeer, i int) error {
		id := uint32(2*i + 1)
		if err := p.headers(id, false, ":method", "CONNECT", ":authority", "10.0.0.1:80"); err != nil {
			return err
		}
		return p.write(func() error { return p.fr.WriteRSTStream(id, http2.ErrCodeCancel) })
	}},
	// CONNECTs to the live backend, never answered with a byte or a WINDOW_UPDATE: each
	// holds a handler, a backend socket and its stream until the connection ends.
	{"connect-flood", func(p *rawPeer, i int) error {
		return p.headers(uint32(2*i+1), false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	}},
	{"ping", func(p *rawPeer, i int) error {
		return p.write(func() error { return p.fr.WritePing(false, [8]byte{byte(i)}) })
	}},
	{"settings", func(p *rawPeer, i int) error { return p.write(func() error { return p.fr.WriteSettings() }) }},
	{"empty-data", func(p *rawPeer, i int) error {
		if i == 0 {
			if err := p.headers(1, false, ":method", "CONNECT", ":authority", "10.0.0.1:80"); err != nil {
				return err
			}
		}
		return p.write(func() error { return p.fr.WriteData(1, false, nil) })
	}},
}

// flood runs one attacker against addr until stop closes: over an mTLS connection it sends
// send(p, 0), send(p, 1), ... until the server ends the connection, then starts again on
// a new one. With a nil send it only handshakes, again and again. ops counts the frames
// sent and the connections opened.
func flood(addr string, cfg *tls.Config, send floodConn, stop <-chan struct{}, ops *atomic.Int64) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		tc, err := tls.Dial("tcp", addr, cfg)
		ops.Add(1)
		if err != nil || send == nil {
			if tc != nil {
				tc.Close()
			}
			continue // a refused handshake is the server's answer too
		}
		p := newRawPeer(tc, true)
		go func() {
			for range p.frames {
			}
		}()
		for i := 0; ; i++ {
			if send(p, i) != nil {
				break
			}
			ops.Add(1)
			select {
			case <-stop:
				i = -2
			default:
			}
			if i < 0 {
				break
			}
		}
		tc.Close()
		<-p.done
	}
}

// handshakeFlood opens TCP connections to addr that never start TLS (half of them after a
// few bytes of a ClientHello), keeping up to hold of them open, until stop closes.
func handshakeFlood(addr string, hold int, stop <-chan struct{}, ops *atomic.Int64) {
	var open []net.Conn
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	for n := 0; ; {
		select {
		case <-stop:
			return
		case <-time.After(time.Millisecond):
		}
		if len(open) == hold {
			open[0].Close()
			open = open[1:]
		}
		c, err := net.Dial("tcp", addr)
		if err != nil {
			continue
		}
		if n%2 == 1 {
			c.Write([]byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00})
		}
		open = append(open, c)
		n++
		ops.Add(1)
	}
}

// attacks are the hostile peers BenchmarkVictimUnderAttack sets on the server, between
// two controls: "none", and "spin", an attacker process that only burns the CPU it is
// given. A VM's idle vCPUs halt to the host, and a message that finds one asleep waits for
// it to wake (docs/PERFORMANCE.md): any busy process, at whatever priority, keeps them
// awake and so makes the victim faster. The attacks are compared with "spin".
var attacks = func() []string {
	names := []string{"none", "spin"}
	for _, f := range floods {
		names = append(names, f.name)
	}
	return append(names, "no-tls", "untrusted-cert", "spin-again", "none-again")
}()

// runAttack runs attack name against addr until stop closes, presenting cert (the
// "untrusted-cert" attack makes one of its own CA instead).
func runAttack(name, addr string, cert tls.Certificate, stop <-chan struct{}, ops *atomic.Int64) {
	cfg := &tls.Config{Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, NextProtos: []string{"h2"}}
	switch name {
	case "spin", "spin-again":
		for {
			select {
			case <-stop:
				return
			default:
				ops.Add(1)
			}
		}
	case "no-tls":
		handshakeFlood(addr, 500, stop, ops)
		return
	case "untrusted-cert":
		flood(addr, testcert.NewCA().ClientConfig(clientID), nil, stop, ops)
		return
	}
	for _, f := range floods {
		if f.name == name {
			flood(addr, cfg, f.send, stop, ops)
			return
		}
	}
	panic("unknown attack " + name)
}

var (
	victimSched = flag.String("victim.attacker", "idle", "BenchmarkVictimUnderAttack: the attacker process's scheduling: idle (SCHED_IDLE), nice (nice 19) or normal")
	victimCPU   = flag.Int("victim.attackcpu", -1, "BenchmarkVictimUnderAttack: pin the attacker process to this CPU (-1: any)")
)

// Set by the benchmark in the attacker process it starts.
const (
	attackerEnv     = "HBONE_ATTACKER"      // attack name
	attackerAddrEnv = "HBONE_ATTACKER_ADDR" // server address
	attackerCertEnv = "HBONE_ATTACKER_CERT" // client certificate and key, PEM
)

// TestAttackerProcess is not a test: it is the attacker process BenchmarkVictimUnderAttack
// starts from this test binary. It runs two attackers until its standard input closes,
// then prints how many operations (frames, connections) they did.
func TestAttackerProcess(t *testing.T) {
	name := os.Getenv(attackerEnv)
	if name == "" {
		t.Skip("run by BenchmarkVictimUnderAttack")
	}
	cert, err := tls.X509KeyPair([]byte(os.Getenv(attackerCertEnv)), []byte(os.Getenv(attackerCertEnv)))
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	var ops atomic.Int64
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() { defer wg.Done(); runAttack(name, os.Getenv(attackerAddrEnv), cert, stop, &ops) }()
	}
	for ops.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	ops0, cpu0 := ops.Load(), selfCPU()
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin)
	close(stop)
	wg.Wait()
	fmt.Println("ops", ops.Load()-ops0, selfCPU()-cpu0)
}

// attacker is an attacker process started by startAttacker.
type attacker struct {
	cmd    *exec.Cmd
	stdin  io.Closer
	stdout io.Reader
	out    *bufio.Scanner
	start  time.Time
}

// startAttacker runs attack name against addr in a child process scheduled as
// -victim.attacker and -victim.attackcpu say, and returns once it is attacking. The child
// is forked from a thread given that policy and affinity, so each of its threads has them:
// Linux schedules threads, and they inherit both from the thread that made them.
func startAttacker(b *testing.B, name, addr string) *attacker {
	b.Helper()
	exe, err := os.Executable()
	if err != nil {
		b.Fatal(err)
	}
	c := cliTLS.Certificates[0]
	key, err := x509.MarshalPKCS8PrivateKey(c.PrivateKey)
	if err != nil {
		b.Fatal(err)
	}
	pemCert := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Certificate[0]})
	pemCert = append(pemCert, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key})...)
	a := &attacker{cmd: exec.Command(exe, "-test.run=^TestAttackerProcess$", "-test.v=false")}
	a.cmd.Env = append(os.Environ(), attackerEnv+"="+name, attackerAddrEnv+"="+addr, attackerCertEnv+"="+string(pemCert))
	a.cmd.Stderr = os.Stderr
	stdin, err := a.cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := a.cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	a.stdin, a.stdout, a.out = stdin, stdout, bufio.NewScanner(stdout)

	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
		if err := scheduleThread(*victimSched, *victimCPU); err != nil {
			started <- err
			return
		}
		started <- a.cmd.Start()
	}()
	if err := <-started; err != nil {
		b.Fatalf("attacker %s: %v", name, err)
	}
	if !a.out.Scan() || a.out.Text() != "ready" {
		a.stdin.Close()
		a.cmd.Wait()
		b.Fatalf("attacker %s did not start: %q", name, a.out.Text())
	}
	a.start = time.Now()
	return a
}

// scheduleThread gives the calling thread policy ("idle", "nice" or "normal") and, if
// cpu >= 0, that one CPU.
func scheduleThread(policy string, cpu int) error {
	switch policy {
	case "idle":
		if err := unix.SchedSetAttr(0, &unix.SchedAttr{Policy: unix.SCHED_IDLE}, 0); err != nil {
			return fmt.Errorf("SCHED_IDLE: %w", err)
		}
	case "nice":
		if err := unix.Setpriority(unix.PRIO_PROCESS, 0, 19); err != nil { // 0: this thread
			return fmt.Errorf("nice 19: %w", err)
		}
	case "normal":
	default:
		return fmt.Errorf("-victim.attacker=%q: want idle, nice or normal", policy)
	}
	if cpu >= 0 {
		var set unix.CPUSet
		set.Set(cpu)
		if err := unix.SchedSetaffinity(0, &set); err != nil {
			return fmt.Errorf("CPU %d: %w", cpu, err)
		}
	}
	return nil
}

// stop ends the attack and returns its operations per second and the CPU seconds the
// attacker process used per second, both counted from when it said it was ready.
func (a *attacker) stop(b *testing.B) (opsPerSec, cpu float64) {
	b.Helper()
	a.stdin.Close()
	var ops int64
	for a.out.Scan() {
		if _, err := fmt.Sscanf(a.out.Text(), "ops %d %g", &ops, &cpu); err == nil {
			break
		}
	}
	io.Copy(io.Discard, a.stdout)
	if err := a.cmd.Wait(); err != nil {
		b.Fatalf("attacker: %v", err)
	}
	secs := time.Since(a.start).Seconds()
	return float64(ops) / secs, cpu / secs
}

func cpuSeconds(ru *syscall.Rusage) float64 {
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano()).Seconds()
}

func selfCPU() float64 {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return cpuSeconds(&ru)
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
	for _, name := range attacks {
		b.Run(name, func(b *testing.B) {
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
			var a *attacker
			if !strings.HasPrefix(name, "none") {
				a = startAttacker(b, name, e.ln.Addr().String())
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
				ops, acpu := a.stop(b)
				b.ReportMetric(ops, "attack-ops/s")
				b.ReportMetric(acpu, "attacker-cpu")
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
			b.ReportMetric(cpu, "cpu")
			b.ReportMetric(float64(int64(ms.HeapInuse)-int64(heap0))/(1<<20), "heap-MiB")
		})
	}
}
