package main

import (
	"context"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/netns"
)

// runDemo runs scripts/demo.sh with a prebuilt binary and returns its exit error and
// output. As root on Linux it runs inside a fresh network namespace, so its fixed
// addresses (127.0.0.2/3, ports 15000-15080 and 8080) cannot collide with anything else on
// the machine (the bench suite uses the same two-node topology); prepare, if not nil, runs
// inside that namespace first.
func runDemo(t *testing.T, bin string, prepare func() error) (string, error) {
	t.Helper()
	args := []string{"bash", "../../scripts/demo.sh"}
	if runtime.GOOS == "linux" && os.Geteuid() == 0 {
		if _, err := exec.LookPath("ip"); err == nil {
			ns := netns.New(t, "demo")
			args = append([]string{"ip", "netns", "exec", ns.Name}, args...)
			if prepare != nil {
				if err := ns.Do(prepare); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, args[0], args[1:]...)
	// SIGTERM, not SIGKILL, so the script's trap stops what it started.
	cmd.Cancel = func() error { return cmd.Process.Signal(syscall.SIGTERM) }
	cmd.WaitDelay = 10 * time.Second
	cmd.Env = append(os.Environ(), "ZTUNNEL_BIN="+bin)
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

// TestDemoFailsLoudly checks the script exits non-zero and shows the logs when a part
// cannot start: the echo server's address is already taken.
func TestDemoFailsLoudly(t *testing.T) {
	requireDemoTools(t)
	if runtime.GOOS != "linux" || os.Geteuid() != 0 {
		t.Skip("needs root to take the echo address in a private network namespace")
	}
	netns.Require(t)
	bin := buildZtunnel(t)
	var squatter net.Listener
	out, err := runDemo(t, bin, func() error {
		var err error
		squatter, err = net.Listen("tcp", "127.0.0.3:8080")
		return err
	})
	if squatter != nil {
		squatter.Close()
	}
	if err == nil {
		t.Fatalf("demo.sh succeeded with its echo address taken:\n%s", out)
	}
	if !strings.Contains(out, "Address already in use") || strings.Contains(out, "RESULT: ok") {
		t.Errorf("demo output does not explain the failure:\n%s", out)
	}
}
