package main

import (
	"bytes"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"
)

func TestWithSysmonPolling(t *testing.T) {
	for _, tc := range []struct {
		in, want string
		changed  bool
	}{
		{"", sysmonPolling, true},
		{" ", sysmonPolling, true},
		{"http2debug=1", "http2debug=1," + sysmonPolling, true},
		{"madvdontneed=1,gctrace=1", "madvdontneed=1,gctrace=1," + sysmonPolling, true},
		{"schedtracex=1", "schedtracex=1," + sysmonPolling, true},
		{"schedtrace=0", "schedtrace=0", false},
		{"gctrace=1, schedtrace=1000", "gctrace=1, schedtrace=1000", false},
	} {
		got, changed := withSysmonPolling(tc.in)
		if got != tc.want || changed != tc.changed {
			t.Errorf("withSysmonPolling(%q) = %q, %v; want %q, %v", tc.in, got, changed, tc.want, tc.changed)
		}
	}
}

// TestNodeReexecsWithSysmonPolling runs the binary as a node and reads the environment
// its process (same PID) runs with once it has started.
func TestNodeReexecsWithSysmonPolling(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("the node re-executes itself only on Linux")
	}
	bin := buildZtunnel(t)
	for _, tc := range []struct{ given, want string }{
		{"", "GODEBUG=" + sysmonPolling},
		{"GODEBUG=gctrace=0", "GODEBUG=gctrace=0," + sysmonPolling},
		{"GODEBUG=schedtrace=0", "GODEBUG=schedtrace=0"},
	} {
		var env []string
		if tc.given != "" {
			env = append(env, tc.given)
		}
		p := startBareNode(t, bin, env...)
		procDir := "/proc/" + strconv.Itoa(p.Pid())
		environ, err := os.ReadFile(procDir + "/environ")
		if err != nil {
			t.Fatal(err)
		}
		if comm, err := os.ReadFile(procDir + "/comm"); err != nil || string(comm) != "ztunnel\n" {
			t.Errorf("%s: the process is named %q (%v); want ztunnel, as ps and pkill see it", tc.given, comm, err)
		}
		var godebug []string
		for kv := range bytes.SplitSeq(environ, []byte{0}) {
			if bytes.HasPrefix(kv, []byte("GODEBUG=")) {
				godebug = append(godebug, string(kv))
			}
		}
		if len(godebug) != 1 || godebug[0] != tc.want {
			t.Errorf("given %q, the node runs with %q; want [%s]", tc.given, godebug, tc.want)
		}
		if err := p.stop(); err != nil {
			t.Errorf("%s: %v\n%s", tc.given, err, p.Output())
		}
	}
}

// startBareNode runs bin as a node with every listener off, from the bundled local config
// and a built-in CA, and returns once it has logged that it started.
func startBareNode(t *testing.T, bin string, extra ...string) *proc {
	t.Helper()
	env := []string{
		"LOCAL_XDS_PATH=" + filepath.Join("..", "..", "examples", "localhost.yaml"),
		"CA_PROVIDER=builtin", "CA_DIR=" + filepath.Join(t.TempDir(), "ca"),
	}
	for _, name := range []string{"ADMIN", "STATS", "READINESS", "OUTBOUND", "INBOUND_PLAINTEXT", "INBOUND", "SOCKS5", "DNS_PROXY"} {
		env = append(env, name+"_ADDR=off")
	}
	p := startProc(t, "ztunnel "+strings.Join(extra, " "), append(env, extra...), bin)
	p.waitOutput(t, "ztunnel started", 20*time.Second)
	return p
}
