package attack

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// The attacker runs as a process of its own (a test binary re-executed), so that the
// attacked node's process measures only its own work. Its Spec travels in this variable,
// as JSON; Start sets it and Main reads it.
const envSpec = "GOZT_ATTACK"

// CertPEM is cert's chain and key, PEM, for an attacker process.
func CertPEM(cert tls.Certificate) (string, error) {
	key, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
	if err != nil {
		return "", err
	}
	var out []byte
	for _, der := range cert.Certificate {
		out = append(out, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})...)
	}
	return string(append(out, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: key})...)), nil
}

// Spec is an attacker process: what it does (the kinds are Main's), to whom, and how
// the machine runs it.
type Spec struct {
	Kind    string // what it does (Main)
	Addr    string // the HBONE server's address
	Dst     string // the CONNECT authority
	CertPEM string // the chain and key it presents (CertPEM)
	// Parallel is how many of the kind run at once (connections for the floods and
	// handshakes, threads for burn and spin, sets of held connections for stalled-tls and
	// no-tls); 0 is the kind's own number.
	Parallel int
	// Read makes the HTTP/2 floods read the server's frames as a client does, rather than
	// never reading a byte.
	Read bool

	Test     string   `json:"-"` // the test function that calls Main in the child
	Prefix   []string `json:"-"` // goes before the binary on the command line (ip netns exec NAME, say)
	Sched    string   `json:"-"` // the process's scheduling: "" or "normal", "idle" (SCHED_IDLE), "nice" (nice 19)
	Affinity []int    `json:"-"` // the CPUs the process may run on (nil: any)
}

// Attacker is a running attacker process.
type Attacker struct {
	cmd   *exec.Cmd
	stdin io.Closer
	out   *bufio.Scanner
}

// EnvCPUs, if set (say to 0.5), confines each attacker process to that many CPUs (see
// confine): the attacker as a machine of its own rather than a share of the tested one's.
const EnvCPUs = "ATTACK_CPUS"

// Start runs this test binary again as the attacker process s says, and returns once it
// attacks. Sched and Affinity apply to every thread of the process: it is forked from a
// thread given them, and Linux threads inherit both from the thread that made them.
func Start(tb testing.TB, s Spec) *Attacker {
	tb.Helper()
	exe, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	spec, err := json.Marshal(s)
	if err != nil {
		tb.Fatal(err)
	}
	args := append(append([]string(nil), s.Prefix...), exe, "-test.run=^"+s.Test+"$", "-test.v=false", "-test.cpuprofile=")
	a := &Attacker{cmd: exec.Command(args[0], args[1:]...)}
	a.cmd.Env = append(os.Environ(), envSpec+"="+string(spec))
	a.cmd.Stderr = os.Stderr
	stdin, err := a.cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	stdout, err := a.cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	a.stdin, a.out = stdin, bufio.NewScanner(stdout)
	started := make(chan error, 1)
	go func() {
		if s.Sched != "" || s.Affinity != nil {
			runtime.LockOSThread() // never unlocked: the thread ends with this goroutine
			if err := scheduleThread(s.Sched, s.Affinity); err != nil {
				started <- err
				return
			}
		}
		started <- a.cmd.Start()
	}()
	if err := <-started; err != nil {
		tb.Fatalf("attacker %s: %v", s.Kind, err)
	}
	if v := os.Getenv(EnvCPUs); v != "" {
		cpus, err := strconv.ParseFloat(v, 64)
		if err == nil && cpus <= 0 {
			err = errors.New("not a positive number")
		}
		var release func()
		if err == nil {
			release, err = confine(a.cmd.Process.Pid, cpus)
		}
		if err == nil {
			tb.Cleanup(release) // once the process has exited
		} else {
			a.cmd.Process.Kill()
			a.cmd.Wait()
			tb.Fatalf("%s=%q: %v", EnvCPUs, v, err)
		}
	}
	if !a.out.Scan() || a.out.Text() != "ready" {
		stdin.Close()
		a.cmd.Wait()
		tb.Fatalf("attacker %s did not start: %q", s.Kind, a.out.Text())
	}
	return a
}

// Stop ends the attack and returns its operations a second and the CPU seconds the
// attacker process used a second, both counted from when it began to attack.
func (a *Attacker) Stop(tb testing.TB) (opsPerSec, cpu float64) {
	tb.Helper()
	a.stdin.Close()
	for a.out.Scan() {
		if _, err := fmt.Sscanf(a.out.Text(), "ops/s %g cpu %g", &opsPerSec, &cpu); err == nil {
			break
		}
	}
	if err := a.cmd.Wait(); err != nil {
		tb.Fatalf("attacker: %v", err)
	}
	return opsPerSec, cpu
}

// Child reports whether this process is an attacker that Start started.
func Child() bool { return os.Getenv(envSpec) != "" }

// Main is the attacker process's body: it attacks as its Spec says until its standard
// input closes, then prints its operations a second and CPU seconds a second. The kinds,
// with their own Parallel:
//   - connect-flood: 4 mTLS connections, each sending a CONNECT every millisecond
//     (H2Flood);
//   - open-streams: the same as fast as they go;
//   - rapid-reset: 4 connections sending CONNECT then RST_STREAM as fast as they go;
//   - ping, settings, empty-data: 4 connections sending PINGs, SETTINGS, or empty DATA
//     on one CONNECT stream, as fast as they go;
//   - handshakes: 2 loops of TLS handshakes, each connection closed once done;
//   - stalled-tls: 2,000 connections that sent a ClientHello and nothing more;
//   - stalled-redial: the same, each dialed again 100 ms after the server ends it (the
//     cluster drill's attacker);
//   - no-tls: 500 connections, one more a millisecond, that sent nothing or the first
//     bytes of a ClientHello (NoTLS);
//   - burn: 4 threads kept busy, sending nothing (the control for a flood's CPU);
//   - spin: 2 threads kept busy at SCHED_IDLE (the control that only keeps idle vCPUs
//     awake).
func Main() error {
	var s Spec
	if err := json.Unmarshal([]byte(os.Getenv(envSpec)), &s); err != nil {
		return fmt.Errorf("attack: %s: %w", envSpec, err)
	}
	var cfg *tls.Config
	if s.CertPEM != "" {
		cert, err := tls.X509KeyPair([]byte(s.CertPEM), []byte(s.CertPEM))
		if err != nil {
			return err
		}
		cfg = &tls.Config{Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, NextProtos: []string{http2.NextProtoTLS}}
	}
	stop := make(chan struct{})
	var ops atomic.Int64
	h2 := func(f Flood, every time.Duration) func() {
		return func() { H2Flood(s.Addr, cfg, f, every, s.Read, stop, &ops) }
	}
	var n int
	var attack func()
	switch s.Kind {
	case "connect-flood":
		n, attack = 4, h2(Connects(s.Dst, false), time.Millisecond)
	case "open-streams":
		n, attack = 4, h2(Connects(s.Dst, false), 0)
	case "rapid-reset":
		n, attack = 4, h2(Connects(s.Dst, true), 0)
	case "ping":
		n, attack = 4, h2(Pings, 0)
	case "settings":
		n, attack = 4, h2(Settings, 0)
	case "empty-data":
		n, attack = 4, h2(EmptyData(s.Dst), 0)
	case "handshakes":
		n, attack = 2, func() { Handshakes(s.Addr, cfg, stop, &ops) }
	case "stalled-tls":
		n, attack = 1, func() { StalledTLS(s.Addr, cfg, 2000, stop, &ops) }
	case "stalled-redial":
		n, attack = 1, func() { StalledRedial(s.Addr, cfg, 2000, stop, &ops) }
	case "no-tls":
		n, attack = 1, func() { NoTLS(s.Addr, 500, stop, &ops) }
	case "burn":
		n, attack = 4, func() { Burn(stop, &ops) }
	case "spin":
		n, attack = 2, func() {
			runtime.LockOSThread() // SCHED_IDLE on this thread only
			idleThread()
			Burn(stop, &ops)
		}
	default:
		return fmt.Errorf("attack: unknown kind %q", s.Kind)
	}
	if cfg == nil && s.Kind != "burn" && s.Kind != "spin" && s.Kind != "no-tls" {
		return errors.New("attack: " + s.Kind + " needs a certificate")
	}
	if s.Parallel > 0 {
		n = s.Parallel
	}
	var wg sync.WaitGroup
	for range n {
		wg.Go(attack)
	}
	for ops.Load() == 0 {
		time.Sleep(time.Millisecond)
	}
	start, ops0, cpu0 := time.Now(), ops.Load(), processCPU()
	fmt.Println("ready")
	io.Copy(io.Discard, os.Stdin)
	secs := time.Since(start).Seconds()
	rate, cpu := float64(ops.Load()-ops0)/secs, (processCPU()-cpu0)/secs
	close(stop)
	wg.Wait()
	fmt.Printf("ops/s %g cpu %g\n", rate, cpu)
	return nil
}

// StartControl runs Istio's HBONE server (the binary at path, tools/istio/hbonecontrol) on
// addr, presenting certPEM, until the test ends; prefix, if any, goes before the binary on
// the command line (ip netns exec NAME, say).
func StartControl(tb testing.TB, path, addr, certPEM string, prefix ...string) {
	tb.Helper()
	args := append(prefix, path, "-addr", addr)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Env = append(os.Environ(), "HBONE_CONTROL_CERT="+certPEM)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		tb.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		tb.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		tb.Fatal(err)
	}
	out := bufio.NewReader(stdout)
	drained := make(chan struct{})
	tb.Cleanup(func() {
		stdin.Close()
		<-drained
		cmd.Wait()
	})
	line, _ := out.ReadString('\n')
	// Istio's log goes to standard output, a line per connection and per failed
	// handshake: unread, the pipe fills and the server blocks in its logging.
	go func() {
		defer close(drained)
		io.Copy(io.Discard, out)
	}()
	if line != "ready\n" {
		tb.Fatalf("%s did not start: %q", path, line)
	}
}
