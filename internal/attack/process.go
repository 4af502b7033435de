package attack

import (
	"bufio"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
)

// The attacker runs as a process of its own (a test binary re-executed), so that the
// attacked node's process measures only its own work. Its settings travel in these
// variables; Attacker starts it and Main is its body.
const (
	envKind  = "GOZT_ATTACK"        // what to do (Main)
	envAddr  = "GOZT_ATTACK_ADDR"   // the HBONE server's address
	envDst   = "GOZT_ATTACK_TARGET" // the CONNECT authority
	envCreds = "GOZT_ATTACK_CERT"   // PEM chain and key (CertPEM)
)

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

// Attacker is a running attacker process.
type Attacker struct {
	cmd   *exec.Cmd
	stdin io.Closer
	out   *bufio.Scanner
}

// EnvCPUs, if set (say to 0.5), confines each attacker process to that many CPUs (see
// confine): the attacker as a machine of its own rather than a share of the tested one's.
const EnvCPUs = "ATTACK_CPUS"

// Start runs this test binary again as an attacker process doing kind (see Main) to addr,
// presenting certPEM, and returns once it attacks. test names the test function that
// calls Main in the child; prefix, if any, goes before the binary on the command line
// (ip netns exec NAME, say).
func Start(tb testing.TB, test, kind, addr, dst, certPEM string, prefix ...string) *Attacker {
	tb.Helper()
	exe, err := os.Executable()
	if err != nil {
		tb.Fatal(err)
	}
	args := append(prefix, exe, "-test.run=^"+test+"$", "-test.v=false", "-test.cpuprofile=")
	a := &Attacker{cmd: exec.Command(args[0], args[1:]...)}
	a.cmd.Env = append(os.Environ(), envKind+"="+kind, envAddr+"="+addr, envDst+"="+dst, envCreds+"="+certPEM)
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
	if err := a.cmd.Start(); err != nil {
		tb.Fatal(err)
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
		tb.Fatalf("attacker %s did not start: %q", kind, a.out.Text())
	}
	return a
}

// Stop ends the attack and returns its operations a second.
func (a *Attacker) Stop(tb testing.TB) float64 {
	tb.Helper()
	a.stdin.Close()
	var rate float64
	for a.out.Scan() {
		if _, err := fmt.Sscanf(a.out.Text(), "ops/s %g", &rate); err == nil {
			break
		}
	}
	if err := a.cmd.Wait(); err != nil {
		tb.Fatalf("attacker: %v", err)
	}
	return rate
}

// Child reports whether this process is an attacker that Start started.
func Child() bool { return os.Getenv(envKind) != "" }

// Main is the attacker process's body: it attacks as its variables say until its
// standard input closes, then prints its operations a second. The kinds:
//   - connect-flood: 4 mTLS connections, each sending a CONNECT every millisecond and
//     never reading (H2Flood);
//   - open-streams: the same as fast as they go;
//   - rapid-reset: 4 connections sending CONNECT then RST_STREAM as fast as they go;
//   - stalled-tls: 2,000 connections that sent a ClientHello and nothing more;
//   - burn: 4 threads kept busy, sending nothing (the control for a flood's CPU);
//   - spin: 2 threads kept busy at SCHED_IDLE (the control that only keeps idle vCPUs
//     awake).
func Main() error {
	kind, addr, dst := os.Getenv(envKind), os.Getenv(envAddr), os.Getenv(envDst)
	creds := []byte(os.Getenv(envCreds))
	var cfg *tls.Config
	if len(creds) > 0 {
		cert, err := tls.X509KeyPair(creds, creds)
		if err != nil {
			return err
		}
		cfg = &tls.Config{Certificates: []tls.Certificate{cert}, InsecureSkipVerify: true, MinVersion: tls.VersionTLS13, NextProtos: []string{http2.NextProtoTLS}}
	}
	if cfg == nil && !strings.Contains("burn spin", kind) {
		return errors.New("attack: " + kind + " needs a certificate")
	}
	stop := make(chan struct{})
	var ops atomic.Int64
	var wg sync.WaitGroup
	run := func(n int, f func()) {
		for range n {
			wg.Go(f)
		}
	}
	switch kind {
	case "connect-flood":
		run(4, func() { H2Flood(addr, dst, cfg, time.Millisecond, false, stop, &ops) })
	case "open-streams":
		run(4, func() { H2Flood(addr, dst, cfg, 0, false, stop, &ops) })
	case "rapid-reset":
		run(4, func() { H2Flood(addr, dst, cfg, 0, true, stop, &ops) })
	case "stalled-tls":
		run(1, func() { StalledTLS(addr, cfg, 2000, stop, &ops) })
	case "burn":
		run(4, func() { Burn(stop, &ops) })
	case "spin":
		run(2, func() {
			runtime.LockOSThread() // SCHED_IDLE on this thread only
			idleThread()
			Burn(stop, &ops)
		})
	default:
		return fmt.Errorf("attack: unknown kind %q", kind)
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
	return nil
}
