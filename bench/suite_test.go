package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// smokeConfig is a suite run too short to measure anything, long enough to run every case.
func smokeConfig(t *testing.T) SuiteConfig {
	return SuiteConfig{
		NoZtunnel: true,
		NoCapture: true,
		EchoAddr:  "127.0.0.1:0",
		Reps:      2,
		Duration:  50 * time.Millisecond,
		IdleConns: 10,
		WorkDir:   t.TempDir(),
	}
}

func TestSuiteSmokeDirect(t *testing.T) {
	leaktest.Check(t)
	var progress bytes.Buffer
	cfg := smokeConfig(t)
	cfg.Progress = &progress
	rep, err := RunSuite(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Errors) > 0 {
		t.Fatalf("failed runs: %+v", rep.Errors)
	}
	// Every case but idle (no proxy to measure on the direct path), twice.
	if want := 2 * (len(cfg.cases()) - 1); len(rep.Runs) != want {
		t.Errorf("%d runs; want %d", len(rep.Runs), want)
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	for _, want := range []string{"direct", "Gbit/s, 1 conn", "conns/s", "p99.9 µs"} {
		if !strings.Contains(table.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, table.String())
		}
	}
	var js bytes.Buffer
	if err := rep.WriteJSON(&js); err != nil {
		t.Fatal(err)
	}
	var decoded struct {
		Runs  []map[string]any `json:"runs"`
		Table []Row            `json:"table"`
	}
	if err := json.Unmarshal(js.Bytes(), &decoded); err != nil {
		t.Fatalf("json: %v", err)
	}
	if len(decoded.Runs) != len(rep.Runs) || len(decoded.Table) == 0 || decoded.Table[0].Values["direct"] <= 0 {
		t.Errorf("json has %d runs and table %+v", len(decoded.Runs), decoded.Table)
	}
	var svg bytes.Buffer
	if err := rep.WriteSVG(&svg); err != nil {
		t.Fatal(err)
	}
	if s := svg.String(); !strings.HasPrefix(s, "<svg") || strings.Count(s, "<polyline") != 3 {
		t.Errorf("svg has %d lines; want 3 (pingpong, rr, connrate on direct)", strings.Count(s, "<polyline"))
	}
}

// Only runs the named cases and nothing else; "throughput" names both throughput cases, and
// a name the suite does not have is refused before anything starts.
func TestSuiteOnly(t *testing.T) {
	leaktest.Check(t)
	cfg := smokeConfig(t)
	cfg.Reps = 1
	cfg.Only = []string{"pingpong", "throughput"}
	rep, err := RunSuite(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"pingpong", "throughput/1", "throughput/8"}; !slices.Equal(rep.Cases, want) {
		t.Errorf("cases %v; want %v", rep.Cases, want)
	}
	if len(rep.Runs) != 3 {
		t.Errorf("%d runs; want 3", len(rep.Runs))
	}
	var table bytes.Buffer
	rep.WriteTable(&table)
	if strings.Contains(table.String(), "conns/s") || !strings.Contains(table.String(), "pingpong") {
		t.Errorf("table does not match the cases run:\n%s", table.String())
	}

	cfg.Only = []string{"pingpong", "latency"}
	if _, err := RunSuite(context.Background(), cfg); err == nil || !strings.Contains(err.Error(), `"latency"`) {
		t.Errorf("unknown case: err %v; want one naming it", err)
	}
}

func TestSuiteStopsOnCancel(t *testing.T) {
	leaktest.Check(t)
	cfg := smokeConfig(t)
	cfg.Duration = time.Minute
	ctx, cancel := context.WithCancel(context.Background())
	time.AfterFunc(200*time.Millisecond, cancel)
	start := time.Now()
	rep, err := RunSuite(ctx, cfg)
	if err == nil || rep == nil {
		t.Fatalf("cancelled suite: report %v, err %v; want a partial report and an error", rep != nil, err)
	}
	if d := time.Since(start); d > 15*time.Second {
		t.Errorf("cancelled suite took %v", d)
	}
}

func TestSuiteSmokePeers(t *testing.T) {
	leaktest.Check(t)
	for _, tool := range []string{"bash", "ss", "openssl", "stunnel", "haproxy", "nginx", "go"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("peers smoke test needs %s (peers.sh would install it; tests do not)", tool)
		}
	}
	repo, err := findRepo()
	if err != nil {
		t.Skip(err)
	}
	script := filepath.Join(repo, "..", "shared", "bench", "peers.sh")
	if _, err := os.Stat(script); err != nil {
		t.Skipf("no peers.sh at %s", script)
	}
	// No network and no long builds in tests: ghostunnel (a module download and build) is left out.
	t.Setenv("GOPROXY", "off")
	t.Setenv("GHOSTUNNEL_VERSION", "v0.0.0-not-in-tests")
	cfg := smokeConfig(t)
	cfg.Peers, cfg.PeersScript, cfg.Reps = true, script, 1
	rep, err := RunSuite(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Paths) < 2 {
		t.Fatalf("paths %v, notes %v; want direct and at least one chain", rep.Paths, rep.Notes)
	}
	if len(rep.Errors) > 0 {
		t.Errorf("failed runs: %+v", rep.Errors)
	}
	for _, r := range rep.Runs {
		if r.Path != "direct" && len(r.Procs) == 0 {
			t.Errorf("%s via %s: no proxy processes measured", r.Case, r.Path)
		}
	}
}

// Relative paths are made absolute up front (the nodes run in other directories and are
// handed paths under Repo and WorkDir), and a ztunnel binary that cannot run stops the
// suite before anything starts.
func TestSuitePaths(t *testing.T) {
	dir := t.TempDir()
	t.Chdir(dir)
	if err := os.Mkdir("bin", 0o755); err != nil {
		t.Fatal(err)
	}
	for name, mode := range map[string]os.FileMode{"bin/ztunnel": 0o755, "bin/plain": 0o644} {
		if err := os.WriteFile(name, []byte("#!/bin/sh\n"), mode); err != nil {
			t.Fatal(err)
		}
	}
	cfg := SuiteConfig{Repo: ".", WorkDir: "work", Ztunnel: "bin/ztunnel"}
	if err := cfg.setDefaults(); err != nil || cfg.Repo != dir || cfg.WorkDir != filepath.Join(dir, "work") || cfg.Ztunnel != filepath.Join(dir, "bin", "ztunnel") {
		t.Errorf("repo %q, workdir %q, ztunnel %q, err %v; want all under %s", cfg.Repo, cfg.WorkDir, cfg.Ztunnel, err, dir)
	}
	for _, tc := range []struct{ bin, want string }{
		{"bin/plain", "permission denied"},
		{"bin/missing", "no such file or directory"},
		{"bin", "is a directory"},
	} {
		cfg := smokeConfig(t)
		cfg.Repo, cfg.Ztunnel = dir, tc.bin
		rep, err := RunSuite(context.Background(), cfg)
		if rep != nil || err == nil || !strings.HasPrefix(err.Error(), "bench: suite: ztunnel binary: ") ||
			!strings.Contains(err.Error(), filepath.Join(dir, tc.bin)) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("ztunnel %s: report %v, err %v; want no report and an error naming %s: %s", tc.bin, rep != nil, err, filepath.Join(dir, tc.bin), tc.want)
		}
	}
}

// A path that was asked for and cannot run fails the suite, with the note that says why,
// instead of vanishing from the table.
func TestSuiteAskedForPathFails(t *testing.T) {
	leaktest.Check(t)
	cfg := smokeConfig(t)
	cfg.NoZtunnel, cfg.Ztunnel, cfg.Reps = false, "/bin/false", 1
	rep, err := RunSuite(context.Background(), cfg)
	if err == nil || !strings.Contains(err.Error(), "ztunnel asked for but did not start") {
		t.Fatalf("err = %v; want the ztunnel path named", err)
	}
	if rep == nil || !strings.Contains(fmt.Sprint(rep.Notes), "ztunnel left out") {
		t.Errorf("report %v; want the note saying why", rep)
	}
}
