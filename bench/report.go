package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"slices"
	"strings"
	"time"
)

// Report is everything one suite run measured.
type Report struct {
	Started  time.Time     `json:"started"`
	Elapsed  time.Duration `json:"elapsed_ns"`
	CPUs     int           `json:"cpus"`
	Reps     int           `json:"reps"`
	Duration time.Duration `json:"run_duration_ns"`
	Paths    []string      `json:"paths"`
	// Baselines names, per path, the paths its figures are shown as ratios to; a path not
	// named here is compared with defaultBaselines. A path measured over other links than
	// loopback (the capture path over a veth pair) names a baseline on the same links.
	Baselines map[string][]string `json:"baselines,omitempty"`
	// Rust names, per gozt path, the Rust ztunnel's path of the same shape (ztunnel-ns and
	// the mixed pairs: ztunnel-rs; capture: capture-rs), shown as the "× ztunnel-rs" line.
	Rust   map[string]string `json:"rust,omitempty"`
	Cases  []string          `json:"cases"`
	Notes  []string          `json:"notes,omitempty"`
	Errors []RunError        `json:"errors,omitempty"`
	Runs   []*Result         `json:"runs"`
}

// RunError is a run that failed; the suite records it and goes on.
type RunError struct {
	Case string `json:"case"`
	Path string `json:"path"`
	Rep  int    `json:"rep"`
	Err  string `json:"error"`
}

// A metric is one row of the table: a figure taken from each run of one case.
type metric struct {
	caseName string
	label    string
	higher   bool // whether a larger value is better
	format   string
	get      func(*Result) (float64, bool)
	// fresh metrics take the first repetition only: memory figures of later repetitions
	// carry what earlier bulk runs left in the proxies' heaps.
	fresh bool
}

// latencyMetric is a percentile of a case's latency histogram, in µs.
func latencyMetric(c, label string, p float64) metric {
	return metric{caseName: c, label: label, format: "%.0f", get: func(r *Result) (float64, bool) {
		if r.Latency == nil || r.Latency.Count() == 0 {
			return 0, false
		}
		return float64(r.Latency.Percentile(p)) / 1e3, true
	}}
}

// procMetric is a figure about the proxy processes, absent on paths without any.
func procMetric(c, label, format string, f func(*Result) float64) metric {
	return metric{caseName: c, label: label, format: format, get: func(r *Result) (float64, bool) {
		if len(r.Procs) == 0 {
			return 0, false
		}
		return f(r), true
	}}
}

// rateMetric is a figure every run has, where more is better.
func rateMetric(c, label, format string, f func(*Result) float64) metric {
	return metric{caseName: c, label: label, higher: true, format: format, get: func(r *Result) (float64, bool) {
		return f(r), true
	}}
}

func freshMetric(m metric) metric {
	m.fresh = true
	return m
}

var metrics = []metric{
	rateMetric("throughput/1", "Gbit/s, 1 conn", "%.2f", (*Result).Gbps),
	procMetric("throughput/1", "proxy CPU s/GB", "%.2f", (*Result).CPUPerGB),
	rateMetric("throughput/8", "Gbit/s, 8 conns", "%.2f", (*Result).Gbps),
	procMetric("throughput/8", "proxy CPU s/GB", "%.2f", (*Result).CPUPerGB),
	latencyMetric("pingpong", "p50 µs", 50),
	latencyMetric("pingpong", "p99 µs", 99),
	latencyMetric("rr", "p50 µs", 50),
	latencyMetric("rr", "p90 µs", 90),
	latencyMetric("rr", "p99 µs", 99),
	latencyMetric("rr", "p99.9 µs", 99.9),
	procMetric("rr", "vCPU per 1000 rps", "%.3f", (*Result).VCPUPer1000RPS),
	freshMetric(procMetric("rr", "peak RSS per proc MB, rep 1", "%.1f", func(r *Result) float64 { return float64(r.PeakRSSPerProc()) / 1e6 })),
	freshMetric(procMetric("rr", "peak anon RSS per proc MB, rep 1", "%.1f", func(r *Result) float64 { return float64(r.PeakAnonPerProc()) / 1e6 })),
	rateMetric("connrate", "conns/s", "%.0f", (*Result).OpsPerSec),
	latencyMetric("connrate", "setup p50 µs", 50),
	latencyMetric("connrate", "setup p99 µs", 99),
	procMetric("connrate", "proxy CPU ms/conn", "%.3f", func(r *Result) float64 { return r.CPUPerOp().Seconds() * 1e3 }),
	freshMetric(procMetric("idle", "KiB per idle conn, rep 1", "%.1f", func(r *Result) float64 { return r.BytesPerIdleConn() / 1024 })),
}

// Row is one metric's median per path, how far the repetitions strayed from it, and its
// ratio to each baseline path.
type Row struct {
	Case   string             `json:"case"`
	Metric string             `json:"metric"`
	Higher bool               `json:"higher_is_better"`
	Values map[string]float64 `json:"values"`
	// Spread is half the range of the repetitions' values over their median, per path with
	// two or more. A ratio between two paths is only news when it differs from 1 by more
	// than their spreads.
	Spread map[string]float64            `json:"spread,omitempty"`
	Ratios map[string]map[string]float64 `json:"ratios,omitempty"` // baseline -> path -> value/baseline
	// RustRatios is each gozt path's value over its Rust counterpart's (Report.Rust).
	RustRatios map[string]float64 `json:"rust_ratios,omitempty"`
}

// defaultBaselines are the paths a figure is also shown as a ratio to, when present and the
// path names no baselines of its own: no proxy at all, and a plain-TCP relay chain (the cost
// of two hops without crypto).
var defaultBaselines = []string{"direct", "relay"}

// baselinesOf returns the paths p's figures are compared with.
func (rep *Report) baselinesOf(p string) []string {
	if bs, ok := rep.Baselines[p]; ok {
		return bs
	}
	return defaultBaselines
}

// baselines returns every baseline some path is compared with, in the order of the table's
// ratio rows: the defaults, then the others in path order.
func (rep *Report) baselines() []string {
	bs := slices.Clone(defaultBaselines)
	for _, p := range rep.Paths {
		for _, b := range rep.Baselines[p] {
			if !slices.Contains(bs, b) {
				bs = append(bs, b)
			}
		}
	}
	return bs
}

// Table returns the medians of every metric over the repetitions.
func (rep *Report) Table() []Row {
	var rows []Row
	for _, m := range metrics {
		row := Row{Case: m.caseName, Metric: m.label, Higher: m.higher, Values: map[string]float64{}}
		for _, p := range rep.Paths {
			var vals []float64
			for _, r := range rep.Runs {
				if r.Case == m.caseName && r.Path == p && (!m.fresh || r.Rep <= 1) {
					if v, ok := m.get(r); ok {
						vals = append(vals, v)
					}
				}
			}
			if len(vals) == 0 {
				continue
			}
			med := median(vals)
			row.Values[p] = med
			if sp, ok := spread(vals, med); ok {
				if row.Spread == nil {
					row.Spread = map[string]float64{}
				}
				row.Spread[p] = sp
			}
		}
		if len(row.Values) == 0 {
			continue
		}
		for _, b := range rep.baselines() {
			base, ok := row.Values[b]
			if !ok || base == 0 {
				continue
			}
			ratios := map[string]float64{}
			for p, v := range row.Values {
				if p == b || slices.Contains(rep.baselinesOf(p), b) {
					ratios[p] = v / base
				}
			}
			if len(ratios) < 2 { // only the baseline itself
				continue
			}
			if row.Ratios == nil {
				row.Ratios = map[string]map[string]float64{}
			}
			row.Ratios[b] = ratios
		}
		for p, rs := range rep.Rust {
			v, ok := row.Values[p]
			base, rok := row.Values[rs]
			if !ok || !rok || base == 0 {
				continue
			}
			if row.RustRatios == nil {
				row.RustRatios = map[string]float64{}
			}
			row.RustRatios[p] = v / base
		}
		rows = append(rows, row)
	}
	return rows
}

// spread is half the range of v over its median med; false for fewer than two values or a
// zero median.
func spread(v []float64, med float64) (float64, bool) {
	if len(v) < 2 || med == 0 {
		return 0, false
	}
	return (slices.Max(v) - slices.Min(v)) / 2 / math.Abs(med), true
}

func median(v []float64) float64 {
	s := slices.Clone(v)
	slices.Sort(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// WriteTable prints the comparison table: one block per case, a row per figure with the
// median for each path, and below it the figure as a ratio to each baseline present.
func (rep *Report) WriteTable(w io.Writer) {
	fmt.Fprintf(w, "zbench suite: %d path(s), %d rep(s) of %v per run, %d CPUs, %v in all; medians.\n",
		len(rep.Paths), rep.Reps, rep.Duration, rep.CPUs, rep.Elapsed.Round(time.Second))
	if rep.Reps > 1 {
		fmt.Fprintln(w, "± is how far the repetitions strayed: half their range, relative to the median.")
	}
	fmt.Fprintln(w, "CPU and memory are the proxy processes' own (both hops); ↑ higher is better, ↓ lower is better.")
	fmt.Fprintln(w, "throughput is one-way bulk transfer from the server through the path to the client (like iperf -R).")
	if len(rep.Rust) > 0 {
		fmt.Fprintln(w, "× ztunnel-rs is the figure over the Rust ztunnel's on the path of the same shape (capture over capture-rs, the others over ztunnel-rs).")
	}
	const caseW = 13
	labelW := 0
	for _, m := range metrics {
		labelW = max(labelW, caseW+len([]rune(m.label))+3)
	}
	colW := 11
	for _, p := range rep.Paths {
		colW = max(colW, len(p)+2)
	}
	header := fmt.Sprintf("%-*s", labelW, "")
	for _, p := range rep.Paths {
		header += fmt.Sprintf("%*s", colW, p)
	}
	// writeLine writes one line of the table: a case and label, then a cell per path.
	writeLine := func(caseLabel, label string, cell func(path string) string) {
		line := fmt.Sprintf("%-*s%-*s", caseW, caseLabel, labelW-caseW, label)
		for _, p := range rep.Paths {
			line += fmt.Sprintf("%*s", colW, cell(p))
		}
		fmt.Fprintln(w, line)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, header)
	fmt.Fprintln(w, strings.Repeat("─", len([]rune(header))))
	lastCase := ""
	for _, row := range rep.Table() {
		m := metricByLabel(row.Case, row.Metric)
		caseLabel := ""
		if row.Case != lastCase {
			caseLabel = row.Case
			if lastCase != "" {
				fmt.Fprintln(w)
			}
			lastCase = row.Case
		}
		arrow := "↓"
		if row.Higher {
			arrow = "↑"
		}
		writeLine(caseLabel, row.Metric+" "+arrow, func(p string) string {
			if v, ok := row.Values[p]; ok {
				return fmt.Sprintf(m.format, v)
			}
			return "–"
		})
		if len(row.Spread) > 0 {
			writeLine("", "  ± over reps", func(p string) string {
				if v, ok := row.Spread[p]; ok {
					return fmt.Sprintf("±%.0f%%", v*100)
				}
				return ""
			})
		}
		for _, b := range rep.baselines() {
			ratios, ok := row.Ratios[b]
			if !ok {
				continue
			}
			writeLine("", "  × "+b, func(p string) string {
				if v, ok := ratios[p]; ok && p != b {
					return fmt.Sprintf("%.2f", v)
				}
				return ""
			})
		}
		if len(row.RustRatios) > 0 {
			writeLine("", "  × ztunnel-rs", func(p string) string {
				if v, ok := row.RustRatios[p]; ok {
					return fmt.Sprintf("%.2f", v)
				}
				return ""
			})
		}
	}
	for _, e := range rep.Errors {
		fmt.Fprintf(w, "\nfailed: %s via %s (rep %d): %s", e.Case, e.Path, e.Rep, e.Err)
	}
	if len(rep.Errors) > 0 {
		fmt.Fprintln(w)
	}
	for _, n := range rep.Notes {
		fmt.Fprintf(w, "note: %s\n", n)
	}
}

func metricByLabel(c, label string) metric {
	for _, m := range metrics {
		if m.caseName == c && m.label == label {
			return m
		}
	}
	return metric{format: "%g"}
}

// WriteJSON writes the report: every run with its figures, and the table of medians.
func (rep *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(struct {
		*Report
		Table []Row `json:"table"`
	}{rep, sanitize(rep.Table())})
}

// sanitize drops non-finite values, which JSON cannot carry.
func sanitize(rows []Row) []Row {
	for _, r := range rows {
		for _, m := range []map[string]float64{r.Values, r.Spread} {
			for p, v := range m {
				if math.IsNaN(v) || math.IsInf(v, 0) {
					delete(m, p)
				}
			}
		}
		for _, m := range append(slices.Collect(maps.Values(r.Ratios)), r.RustRatios) {
			for p, v := range m {
				if math.IsNaN(v) || math.IsInf(v, 0) {
					delete(m, p)
				}
			}
		}
	}
	return rows
}
