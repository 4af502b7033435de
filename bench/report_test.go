package bench

import (
	"bytes"
	"strings"
	"testing"
	"time"
)

func TestReportTableMediansRatiosAndFreshMemory(t *testing.T) {
	rep := &Report{Paths: []string{"direct", "relay", "ztunnel"}}
	add := func(c, p string, rep_ int, gbps float64, procs []ProcUsage, idleDelta int64) {
		rep.Runs = append(rep.Runs, &Result{
			Case: c, Path: p, Rep: rep_, Elapsed: time.Second,
			Bytes: int64(gbps * 1e9 / 8), Procs: procs, IdleConns: 100, IdleRSSDelta: idleDelta,
		})
	}
	procs := []ProcUsage{{Proc: Proc{Name: "p", PID: 1}, CPUSeconds: 1}}
	for i, g := range []float64{10, 30, 20} { // median 20
		add("throughput/1", "direct", i+1, g, nil, 0)
	}
	for i, g := range []float64{4, 5, 6} { // median 5
		add("throughput/1", "relay", i+1, g, procs, 0)
	}
	for i, g := range []float64{2, 4, 3} { // median 3
		add("throughput/1", "ztunnel", i+1, g, procs, 0)
	}
	// Memory per idle connection: only the first repetition counts.
	for i, d := range []int64{100 << 10, 10 << 10, 10 << 10} {
		add("idle", "ztunnel", i+1, 0, procs, d)
	}

	rows := map[string]Row{}
	for _, r := range rep.Table() {
		rows[r.Case+" "+r.Metric] = r
	}
	g := rows["throughput/1 Gbit/s, 1 conn"]
	if g.Values["direct"] != 20 || g.Values["relay"] != 5 || g.Values["ztunnel"] != 3 {
		t.Errorf("medians %v; want direct 20, relay 5, ztunnel 3", g.Values)
	}
	if r := g.Ratios["relay"]["ztunnel"]; r != 0.6 {
		t.Errorf("ztunnel/relay = %v; want 0.6", r)
	}
	if r := g.Ratios["direct"]["relay"]; r != 0.25 {
		t.Errorf("relay/direct = %v; want 0.25", r)
	}
	cpu := rows["throughput/1 proxy CPU s/GB"]
	if _, ok := cpu.Values["direct"]; ok {
		t.Errorf("direct has a proxy CPU figure: %v", cpu.Values)
	}
	if _, ok := cpu.Ratios["direct"]; ok {
		t.Errorf("ratios to direct for a figure direct lacks: %v", cpu.Ratios)
	}
	idle := rows["idle KiB per idle conn, rep 1"]
	if idle.Values["ztunnel"] != 1 {
		t.Errorf("idle KiB/conn %v; want rep 1's 1 KiB, not the median", idle.Values)
	}
	// Spread: half the range over the median. direct 10..30 around 20, relay 4..6 around 5.
	if sd, sr := g.Spread["direct"], g.Spread["relay"]; sd != 0.5 || sr != 0.2 {
		t.Errorf("spread direct %v, relay %v; want 0.5 and 0.2", sd, sr)
	}
	if len(idle.Spread) != 0 {
		t.Errorf("a rep-1 figure has a spread: %v", idle.Spread)
	}

	rep.Reps = 3
	var out bytes.Buffer
	rep.WriteTable(&out)
	for _, want := range []string{"throughput/1", "× relay", "0.60", "20.00", "± is how far", "± over reps", "±50%", "±20%", "±33%"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("table lacks %q:\n%s", want, out.String())
		}
	}
}

// A path that names its baseline is shown as a ratio to that one only: capture to veth,
// veth to direct, and the other paths to the defaults as before.
func TestReportPathsNameTheirBaselines(t *testing.T) {
	rep := &Report{
		Paths:     []string{"direct", "ztunnel", "veth", "capture"},
		Baselines: map[string][]string{"veth": {"direct"}, "capture": {"veth"}},
	}
	for p, gbps := range map[string]float64{"direct": 40, "ztunnel": 10, "veth": 20, "capture": 5} {
		rep.Runs = append(rep.Runs, &Result{Case: "throughput/1", Path: p, Rep: 1, Elapsed: time.Second, Bytes: int64(gbps * 1e9 / 8)})
	}
	row := rep.Table()[0]
	want := map[string]map[string]float64{
		"direct": {"direct": 1, "ztunnel": 0.25, "veth": 0.5},
		"veth":   {"veth": 1, "capture": 0.25},
	}
	for b, ratios := range want {
		for p, w := range ratios {
			if got := row.Ratios[b][p]; got != w {
				t.Errorf("%s / %s = %v; want %v", p, b, got, w)
			}
		}
		if len(row.Ratios[b]) != len(ratios) {
			t.Errorf("ratios to %s: %v; want %v", b, row.Ratios[b], ratios)
		}
	}
	if _, ok := row.Ratios["relay"]; ok {
		t.Errorf("ratios to relay, which was not measured: %v", row.Ratios)
	}
	var out bytes.Buffer
	rep.WriteTable(&out)
	lines := strings.Split(out.String(), "\n")
	var ratioRows []string
	for _, l := range lines {
		if f := strings.Fields(l); len(f) > 1 && f[0] == "×" {
			ratioRows = append(ratioRows, strings.Join(f, " "))
		}
	}
	// Columns: direct ztunnel veth capture; a path's own and others' cells stay empty.
	if w := []string{"× direct 0.25 0.50", "× veth 0.25"}; strings.Join(ratioRows, "|") != strings.Join(w, "|") {
		t.Errorf("ratio rows %q; want %q\n%s", ratioRows, w, out.String())
	}
}
