package bench

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// requireCapture skips t unless the capture path can run here, saying why.
func requireCapture(t *testing.T) {
	t.Helper()
	if why := captureMissing(); why != "" {
		t.Skipf("capture path: %s (CI runs as root with iproute2 and iptables)", why)
	}
}

// leftNamespaces returns this process's capture namespaces that still exist.
func leftNamespaces(t *testing.T) []string {
	t.Helper()
	out, err := exec.Command("ip", "netns", "list").CombinedOutput()
	if err != nil {
		t.Fatalf("ip netns list: %v\n%s", err, out)
	}
	var left []string
	for line := range strings.SplitSeq(string(out), "\n") {
		name, _, _ := strings.Cut(strings.TrimSpace(line), " ")
		if strings.HasPrefix(name, "gozt-bench-") && strings.HasSuffix(name, "-"+strconv.Itoa(os.Getpid())) {
			left = append(left, name)
		}
	}
	return left
}

// checkNothingLeft fails t if any of this process's namespaces, or any process a run of rep
// measured, outlived the suite.
func checkNothingLeft(t *testing.T, rep *Report) {
	t.Helper()
	if left := leftNamespaces(t); len(left) > 0 {
		t.Errorf("namespaces left after the suite: %v", left)
	}
	for _, r := range rep.Runs {
		for _, p := range r.Procs {
			if running(p.PID) {
				t.Errorf("%s (pid %d) still running after the suite", p.Name, p.PID)
			}
		}
	}
}

// running reports whether pid is a live process (not gone, not a zombie).
func running(pid int) bool {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	return err == nil && !strings.Contains(string(b), ") Z ")
}

// The production path end to end: pod A's client captured by iptables into ztunnel A, HBONE
// over a veth pair to ztunnel B, the echo server in pod B; and its veth baseline. Every case
// runs on both (idle on capture only), the report compares capture with veth, and nothing
// is left behind.
func TestSuiteSmokeCapture(t *testing.T) {
	requireCapture(t)
	leaktest.Check(t)
	cfg := smokeConfig(t)
	cfg.NoCapture, cfg.Reps = false, 1
	rep, err := RunSuite(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(rep.Paths, "veth") || !slices.Contains(rep.Paths, "capture") {
		t.Fatalf("paths %v, notes %v; want veth and capture", rep.Paths, rep.Notes)
	}
	if len(rep.Errors) > 0 {
		t.Errorf("failed runs: %+v", rep.Errors)
	}
	if notes := fmt.Sprint(rep.Notes); !strings.Contains(notes, "the Rust ztunnel's binary is needed") {
		t.Errorf("notes %v; want one saying the Rust paths need its binary", rep.Notes)
	}
	if got := rep.Baselines["capture"]; !slices.Equal(got, []string{"veth"}) {
		t.Errorf("capture's baselines %v; want [veth]", got)
	}
	rows := map[string]Row{}
	for _, r := range rep.Table() {
		rows[r.Case+" "+r.Metric] = r
	}
	for _, m := range []string{"throughput/1 Gbit/s, 1 conn", "throughput/8 Gbit/s, 8 conns", "pingpong p50 µs", "rr p50 µs", "connrate conns/s"} {
		for _, p := range []string{"veth", "capture"} {
			if v := rows[m].Values[p]; v <= 0 {
				t.Errorf("%s via %s = %v; want > 0", m, p, v)
			}
		}
		if r := rows[m].Ratios["veth"]["capture"]; r <= 0 {
			t.Errorf("%s: capture / veth = %v; want > 0", m, r)
		}
		if _, ok := rows[m].Ratios["direct"]["capture"]; ok {
			t.Errorf("%s: capture compared with direct (loopback), not with veth", m)
		}
	}
	if v := rows["idle KiB per idle conn, rep 1"].Values["capture"]; v <= 0 {
		t.Errorf("idle KiB per idle conn via capture = %v; want > 0", v)
	}
	// The smoke run's 50 ms runs (a few hundred connections, a few hundred MB) can cost the
	// proxies less than one clock tick of CPU on a loaded machine (make check beside another
	// benchmark gave 0 s/GB), so these figures may be 0, but they must be there.
	for _, m := range []string{"throughput/1 proxy CPU s/GB", "connrate proxy CPU ms/conn"} {
		if v, ok := rows[m].Values["capture"]; !ok || v < 0 {
			t.Errorf("%s via capture = %v (present %v); want a figure", m, v, ok)
		}
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	for _, want := range []string{"capture", "veth", "× veth", "× direct"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	checkNothingLeft(t, rep)
}

// A capture topology that fails half way (its ztunnel cannot start) is one note, and what
// was already made is removed before the suite goes on.
func TestCaptureFailureLeavesNothing(t *testing.T) {
	requireCapture(t)
	leaktest.Check(t)
	cfg := smokeConfig(t)
	cfg.NoCapture, cfg.Reps = false, 1
	cfg.Ztunnel = "/bin/false"
	rep, err := RunSuite(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if slices.Contains(rep.Paths, "capture") || slices.Contains(rep.Paths, "veth") {
		t.Errorf("paths %v with a ztunnel that exits at once", rep.Paths)
	}
	if notes := fmt.Sprint(rep.Notes); !strings.Contains(notes, "capture and veth left out") || !strings.Contains(notes, "ztunnel-cap-a exited") {
		t.Errorf("notes %v; want one saying why capture was left out", rep.Notes)
	}
	if left := leftNamespaces(t); len(left) > 0 {
		t.Errorf("namespaces left after a failed start: %v", left)
	}
}

// Cancelling the suite (Ctrl-C in zbench) while the capture path is up removes its
// namespaces and stops its ztunnels.
func TestSuiteCaptureCancelled(t *testing.T) {
	requireCapture(t)
	leaktest.Check(t)
	cfg := smokeConfig(t)
	cfg.NoCapture, cfg.Reps, cfg.Duration = false, 1, time.Minute
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Cancel once the first run has begun: every path is up by then.
	cfg.Progress = writerFunc(func(b []byte) {
		if bytes.Contains(b, []byte(" via ")) {
			cancel()
		}
	})
	start := time.Now()
	rep, err := RunSuite(ctx, cfg)
	if err == nil {
		t.Fatalf("cancelled suite returned no error; paths %v, notes %v", rep.Paths, rep.Notes)
	}
	if d := time.Since(start); d > 30*time.Second {
		t.Errorf("cancelled suite took %v", d)
	}
	if !slices.Contains(rep.Paths, "capture") {
		t.Fatalf("paths %v, notes %v: capture never came up", rep.Paths, rep.Notes)
	}
	if left := leftNamespaces(t); len(left) > 0 {
		t.Errorf("namespaces left after cancel: %v", left)
	}
	if pids := runningBinary(filepath.Join(cfg.WorkDir, "ztunnel")); len(pids) > 0 {
		t.Errorf("ztunnel processes %v still running after cancel", pids)
	}
}

// runningBinary returns the live processes running the executable bin.
func runningBinary(bin string) []int {
	var pids []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if exe, err := os.Readlink(filepath.Join("/proc", e.Name(), "exe")); err == nil && exe == bin && running(pid) {
			pids = append(pids, pid)
		}
	}
	return pids
}

type writerFunc func([]byte)

func (f writerFunc) Write(b []byte) (int, error) {
	f(b)
	return len(b), nil
}
