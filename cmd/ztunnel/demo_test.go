//go:build linux

package main

import (
	"context"
	"net"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/netns/netnstest"
)

// runDemo runs scripts/demo.sh with a prebuilt binary and returns its output and exit
// error. As root it runs inside a fresh network namespace, so its fixed
// addresses (127.0.0.2/3, ports 15000-15080 and 8080) cannot collide with anything else on
// the machine (the bench suite uses the same two-node topology); prepare, if not nil, is
// given that namespace first.
func runDemo(t *testing.T, bin string, prepare func(*netnstest.NS)) (string, error) {
	t.Helper()
	args := []string{"bash", "../../scripts/demo.sh"}
	if os.Geteuid() == 0 {
		if _, err := exec.LookPath("ip"); err == nil {
			ns := netnstest.New(t, "demo")
			args = append([]string{"ip", "netns", "exec", ns.Name}, args...)
			if prepare != nil {
				prepare(ns)
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	// SIGTERM, not SIGKILL, so the script's trap stops what it started.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	cmd.Env = append(os.Environ(), "ZTUNNEL_BIN="+bin, raceEnv)
	out, err := cmd.CombinedOutput()
	return string(out), err
}

func requireDemoTools(t *testing.T) {
	t.Helper()
	for _, tool := range []string{"bash", "curl", "python3"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("make demo needs %s, which is not installed", tool)
		}
	}
}

// TestDemo runs `make demo`'s script end to end: two nodes, SOCKS5 -> HBONE mTLS -> echo,
// and checks that its summary tells the story.
func TestDemo(t *testing.T) {
	requireDemoTools(t)
	bin := buildZtunnel(t)
	out, err := runDemo(t, bin, nil)
	if err != nil {
		t.Fatalf("demo.sh: %v\n%s", err, out)
	}
	for _, want := range []string{
		// The traffic arrived, by IP and by service name, and came back.
		"echo: POST /by-ip host=127.0.0.3:8080",
		"hello from default/client through the mesh",
		"echo: GET /by-name host=echo.default.svc.cluster.local",
		// The identities each node holds.
		"spiffe://cluster.local/ns/default/sa/client  [Available]",
		"spiffe://cluster.local/ns/default/sa/server  [Available]",
		// Both ends logged the tunnel with the peer identities.
		"direction=outbound",
		"direction=inbound",
		"dst.identity=spiffe://cluster.local/ns/default/sa/server",
		// Counters from both reporters, over mTLS.
		"istio_tcp_connections_opened_total     source      client -> server (service echo.default.svc.cluster.local)  mutual_tls  flags=-  = 1",
		"istio_tcp_connections_opened_total     destination",
		"RESULT: ok",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("demo output lacks %q", want)
		}
	}
	if t.Failed() {
		t.Logf("demo output:\n%s", out)
	}
}

// TestDemoFailures checks the script exits non-zero and says why when the demo cannot
// run (an address is taken) or its traffic does not get through (HBONE is blocked).
func TestDemoFailures(t *testing.T) {
	requireDemoTools(t)
	netnstest.Require(t, "iptables") // both cases need a private namespace
	bin := buildZtunnel(t)

	t.Run("address taken", func(t *testing.T) {
		var squatter net.Listener
		out, err := runDemo(t, bin, func(ns *netnstest.NS) {
			if err := ns.Do(func() (err error) {
				squatter, err = net.Listen("tcp", "127.0.0.3:8080")
				return err
			}); err != nil {
				t.Fatal(err)
			}
		})
		squatter.Close()
		if err == nil || !strings.Contains(out, "127.0.0.3:8080 is already in use") {
			t.Errorf("demo.sh with its echo address taken: %v\n%s", err, out)
		}
	})

	t.Run("hbone blocked", func(t *testing.T) {
		out, err := runDemo(t, bin, func(ns *netnstest.NS) {
			ns.MustExec(t, "iptables", "-w", "-A", "OUTPUT", "-p", "tcp", "-d", "127.0.0.3", "--dport", "15008", "-j", "REJECT", "--reject-with", "tcp-reset")
		})
		if err == nil || !strings.Contains(out, "RESULT: FAILED") || strings.Contains(out, "RESULT: ok") {
			t.Errorf("demo.sh with HBONE blocked: %v\n%s", err, out)
		}
	})
}
