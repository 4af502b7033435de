package bench

import (
	"context"
	"os"
	"slices"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
)

// The Rust ztunnel beside gozt: its pair, both mixed pairs, gozt's pair of the same shape
// and the in-pod path with Rust nodes all forward (the probe checks every byte), every case
// runs on them, and nothing is left behind. It needs the Rust ztunnel's binary by path.
func TestSuiteRust(t *testing.T) {
	bin := os.Getenv("ZTUNNEL_RS")
	if bin == "" {
		t.Skip("the Rust ztunnel's binary is needed: set ZTUNNEL_RS=/path/to/ztunnel")
	}
	requireCapture(t)
	leaktest.Check(t)
	cfg := smokeConfig(t)
	cfg.NoCapture, cfg.Reps, cfg.ZtunnelRS = false, 1, bin
	cfg.Only = []string{"pingpong", "throughput/1"}
	rep, err := RunSuite(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"capture", "capture-rs", "ztunnel-ns", "ztunnel-rs", "gozt→rs", "rs→gozt"} {
		if !slices.Contains(rep.Paths, p) {
			t.Errorf("path %s missing; paths %v, notes %v", p, rep.Paths, rep.Notes)
		}
	}
	if len(rep.Errors) > 0 {
		t.Errorf("failed runs: %+v", rep.Errors)
	}
	for _, r := range rep.Table() {
		if r.Case == "pingpong" && r.Metric == "p50 µs" {
			if r.RustRatios["ztunnel-ns"] <= 0 || r.RustRatios["capture"] <= 0 {
				t.Errorf("× ztunnel-rs %v; want ztunnel-ns and capture", r.RustRatios)
			}
		}
	}
	checkNothingLeft(t, rep)
}
