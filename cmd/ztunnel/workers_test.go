package main

import (
	"strings"
	"testing"
)

func TestWorkerThreads(t *testing.T) {
	for _, tc := range []struct {
		spec                    string
		cores, limit, goDefault int
		gomaxprocsSet           bool
		want                    int
	}{
		{"", 1, 0, 1, false, 1},
		{"", 2, 0, 2, false, 2},
		{"", 4, 0, 4, false, 2},
		{"", 9, 0, 9, false, 3},
		{"", 64, 0, 64, false, 16},
		{"", 64, 0, 6, false, 6},  // a CPU limit lowered Go's default
		{"", 64, 0, 64, true, 64}, // GOMAXPROCS=64 given
		{"3", 64, 0, 6, false, 3}, // the setting wins over both
		{"3", 2, 0, 2, true, 3},
		{"0", 64, 0, 6, false, 64}, // every core
		{"50%", 64, 0, 64, false, 32},
		{"10%", 4, 0, 4, false, 1}, // rounded up, at least 1
		{"100%", 7, 0, 7, false, 7},
		// ZTUNNEL_CPU_LIMIT (the chart's downward-API limits.cpu) counts as the cores.
		{"", 64, 4, 64, false, 4},   // the Go runtime did not see the limit
		{"", 64, 4, 4, false, 4},    // it did
		{"", 64, 64, 64, false, 16}, // no limit: the downward API gives the node's cores
		{"50%", 64, 8, 64, false, 4},
		{"0", 64, 8, 64, false, 8},
		{"", 64, 4, 64, true, 64},  // GOMAXPROCS still wins
		{"5", 64, 4, 64, false, 5}, // and so does a thread count
	} {
		w, err := parseWorkerThreads(tc.spec)
		if err != nil {
			t.Fatalf("parse %q: %v", tc.spec, err)
		}
		if got := w.threads(tc.cores, tc.limit, tc.goDefault, tc.gomaxprocsSet); got != tc.want {
			t.Errorf("%q on %d cores (limit %d, Go default %d, GOMAXPROCS given %v) = %d threads; want %d",
				tc.spec, tc.cores, tc.limit, tc.goDefault, tc.gomaxprocsSet, got, tc.want)
		}
	}
	for _, bad := range []string{"x", "-1", "0%", "101%", "2.5", "%"} {
		if _, err := loadConfig(env(map[string]string{"ZTUNNEL_WORKER_THREADS": bad}), nil, nil); err == nil ||
			!strings.Contains(err.Error(), "ZTUNNEL_WORKER_THREADS") {
			t.Errorf("ZTUNNEL_WORKER_THREADS=%q: err %v; want one naming the variable", bad, err)
		}
	}
}

// TestNodeRunsWithWorkerThreads starts the binary and reads the thread count it logs.
func TestNodeRunsWithWorkerThreads(t *testing.T) {
	bin := buildZtunnel(t)
	for _, tc := range []struct{ given, want string }{
		{"ZTUNNEL_WORKER_THREADS=1", "threads=1 "},
		{"ZTUNNEL_WORKER_THREADS=3", "threads=3 "},
		{"GOMAXPROCS=5", "threads=5 "},
	} {
		p := startBareNode(t, bin, tc.given)
		if out := p.Output(); !strings.Contains(out, tc.want) {
			t.Errorf("%s: the started line does not say %q:\n%s", tc.given, tc.want, out)
		}
		if err := p.stop(); err != nil {
			t.Errorf("%s: %v", tc.given, err)
		}
	}
}
