package clustertest

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// TestClusterBench is make cluster-bench (issue 57): zbench's rows between a client pod on
// node1 and a server pod on node2, as users compare data planes, with gozt in the ztunnel
// DaemonSet, with the Rust ztunnel (RS_HUB/RS_TAG, make cluster-bench ZTUNNEL_RS=...) and with
// no mesh (a namespace not enrolled) as the floor, in one sitting, the programs alternating
// within each repetition (BENCH_REPS, 3); BENCH_ONLY=name,... picks rows. The CPU and memory are each node's ztunnel
// container's, from its cgroup. One table, each figure with × Rust and × no mesh.
func TestClusterBench(t *testing.T) {
	setupFor(t, "CLUSTER_BENCH", "make cluster-bench")
	charts := os.Getenv("ISTIO_CHARTS")
	if charts == "" {
		t.Skip("clustertest: SKIPPED: no ISTIO_CHARTS (make cluster-bench sets it)")
	}
	reps := 3
	if n, err := strconv.Atoi(os.Getenv("BENCH_REPS")); err == nil && n > 0 {
		reps = n
	}
	dur := 5 * time.Second
	if d, err := time.ParseDuration(os.Getenv("BENCH_DURATION")); err == nil && d > 0 {
		dur = d
	}
	programs := []ztunnelImage{{"gozt", "localhost/gozt", "v1", "v2"}}
	if hub, tag := os.Getenv("RS_HUB"), os.Getenv("RS_TAG"); hub != "" && tag != "" {
		programs = append(programs, ztunnelImage{"rust", hub, tag, tag + "-b"})
	}
	d := &drills{t: t, charts: charts}
	t.Cleanup(func() {
		if os.Getenv("CLUSTER_KEEP_APPS") == "" {
			kubectl("delete", "namespace", benchNS, benchNS+"-plain", "--wait=false")
		}
		if len(programs) > 1 {
			d.switchTo(programs[0], programs[0].tag)
		}
	})
	must(t, "kubectl", "delete", "namespace", benchNS, benchNS+"-plain", "--ignore-not-found", "--wait=true", "--timeout=3m")
	apply(t, benchApps(benchNS, true)+benchApps(benchNS+"-plain", false))
	for _, ns := range []string{benchNS, benchNS + "-plain"} {
		must(t, "kubectl", "-n", ns, "wait", "--for=condition=Ready", "pod/client", "pod/server", "--timeout=3m")
	}
	cases := benchCases(dur)
	if only := os.Getenv("BENCH_ONLY"); only != "" { // names, comma-separated
		cases = slices.DeleteFunc(cases, func(c benchCase) bool { return !slices.Contains(strings.Split(only, ","), c.name) })
	}
	results := map[string]map[string][]benchRow{} // case -> program -> reps
	for rep := range reps {
		for _, prog := range append(programs, ztunnelImage{name: "no mesh"}) {
			ns := benchNS
			if prog.name == "no mesh" {
				ns = benchNS + "-plain"
			} else {
				d.switchTo(prog, prog.tag)
				eventually(t, "the client reaches the server through "+prog.name, 2*time.Minute, func() error {
					_, err := zbench(ns, "pingpong", "--count", "10")
					return err
				})
			}
			for _, c := range cases {
				if c.idle > 0 && prog.name != "no mesh" {
					// A Go heap that bulk runs grew keeps its pages and takes the idle
					// connections' memory from them, which would show as none: each
					// idle row starts from ztunnels that have carried nothing yet.
					d.dsRestart()
					eventually(t, "the client reaches the server through "+prog.name+" after a restart", 2*time.Minute, func() error {
						_, err := zbench(ns, "pingpong", "--count", "10")
						return err
					})
				}
				row, err := benchRun(t, ns, prog.name != "no mesh", c)
				if err != nil {
					t.Errorf("%s on %s, rep %d: %v", c.name, prog.name, rep+1, err)
					continue
				}
				t.Logf("rep %d %s %s: %s", rep+1, prog.name, c.name, row)
				if results[c.name] == nil {
					results[c.name] = map[string][]benchRow{}
				}
				results[c.name][prog.name] = append(results[c.name][prog.name], row)
			}
		}
	}
	benchReport(t, cases, programs, results, reps)
}

const benchNS = "zt-bench"

// benchApps is a namespace (enrolled in ambient, or not) with zbench's echo and source
// servers in one pod on node2 behind a Service, and a client pod on node1 to exec zbench in.
func benchApps(ns string, ambient bool) string {
	label := ""
	if ambient {
		label = ", labels: {istio.io/dataplane-mode: ambient}"
	}
	return fmt.Sprintf(`apiVersion: v1
kind: Namespace
metadata: {name: %[1]s%[2]s}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: %[1]s, labels: {app: bench-server}}
spec:
  nodeSelector: {kubernetes.io/hostname: node2}
  terminationGracePeriodSeconds: 1
  containers:
  - {name: echo, image: localhost/gozt/zbench:v1, imagePullPolicy: Never, args: [serve, --listen, ":8080", --mode, echo]}
  - {name: source, image: localhost/gozt/zbench:v1, imagePullPolicy: Never, args: [serve, --listen, ":8081", --mode, source]}
---
apiVersion: v1
kind: Service
metadata: {name: server, namespace: %[1]s}
spec:
  selector: {app: bench-server}
  ports: [{name: tcp-echo, port: 8080}, {name: tcp-source, port: 8081}]
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: %[1]s}
spec:
  nodeSelector: {kubernetes.io/hostname: node1}
  terminationGracePeriodSeconds: 1
  containers: [{name: client, image: localhost/gozt/zbench:v1, imagePullPolicy: Never, command: [/app], args: [pause]}]
---
`, ns, label)
}

// benchCase is one row: a zbench scenario and its flags (zbench suite's cases), the port it
// targets, and for idle the connections held.
type benchCase struct {
	name, scenario string
	port           int
	args           []string
	idle           int
}

func benchCases(d time.Duration) []benchCase {
	ds := d.String()
	return []benchCase{
		{name: "throughput/1", scenario: "throughput", port: 8081, args: []string{"--conns", "1", "--direction", "down", "--duration", ds}},
		{name: "throughput/8", scenario: "throughput", port: 8081, args: []string{"--conns", "8", "--direction", "down", "--duration", ds}},
		{name: "rr", scenario: "rr", port: 8080, args: []string{"--conns", "4", "--payload", "1024", "--rate", "1000", "--duration", ds}},
		{name: "pingpong", scenario: "pingpong", port: 8080, args: []string{"--conns", "1", "--payload", "1024", "--duration", ds}},
		{name: "connrate", scenario: "connrate", port: 8080, args: []string{"--conns", "4", "--payload", "1024", "--duration", ds}},
		{name: "idle/1000", scenario: "idle", port: 8080, idle: 1000, args: []string{"--conns", "1000", "--payload", "64", "--duration", "10s"}},
		{name: "idle/10000", scenario: "idle", port: 8080, idle: 10000, args: []string{"--conns", "10000", "--payload", "64", "--duration", "20s"}},
	}
}

// benchRow is one run's figures.
type benchRow struct {
	gbps, opsPerSec  float64
	p50, p99, p999   time.Duration
	cpu              float64 // both nodes' ztunnels, CPU seconds over the run
	bytes, ops       int64
	idleBytesPerConn float64 // both nodes' ztunnels' anonymous memory growth per held connection, at the hold's end
	idlePeakPerConn  float64 // the same at its highest, the setup burst included
	elapsed          time.Duration
	missed           int64
}

func (r benchRow) String() string {
	return fmt.Sprintf("%.2f Gbit/s, %.0f ops/s, p50 %v p99 %v p99.9 %v, ztunnels' CPU %.2fs, idle %.0f B/conn (peak %.0f)",
		r.gbps, r.opsPerSec, r.p50, r.p99, r.p999, r.cpu, r.idleBytesPerConn, r.idlePeakPerConn)
}

// zbench runs zbench scenario in ns's client pod against its server and returns its JSON.
func zbench(ns, scenario string, args ...string) (string, error) {
	port := "8080"
	if scenario == "throughput" {
		port = "8081"
	}
	a := append([]string{"-n", ns, "exec", "client", "--", "/zbench", scenario, "--target", "server." + ns + ".svc.cluster.local:" + port, "--json"}, args...)
	// idle opens its connections one at a time: 10,000 take minutes, past run's bound.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, tool("kubectl"), a...)
	cmd.Env = append(os.Environ(), "KUBECONFIG="+kubeconfig)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("zbench %s in %s: %w: %s", scenario, ns, err, out)
	}
	return string(out), nil
}

// benchRun runs c once in ns; with the mesh, it charges both nodes' ztunnel containers' CPU
// (cpuacct) and, for idle, their anonymous memory's growth: the last sample while the
// connections are held, less the one before (what zbench suite's idle row measures: memory
// the held connections keep), and the highest sample (the setup burst's too: what a memory
// limit must allow).
func benchRun(t *testing.T, ns string, mesh bool, c benchCase) (benchRow, error) {
	var zt map[string]pod
	var cgs []string
	if mesh {
		zt = ztunnelPods(t)
		for _, n := range []string{"node1", "node2"} {
			cgs = append(cgs, containerCgroup(t, zt[n], n))
		}
	}
	cpu0 := cgroupCPU(cgs)
	mem0 := cgroupAnon(cgs)
	type sample struct {
		at   time.Time
		anon int64
	}
	var samples []sample // written by the sampler, read after wg.Wait
	stop := make(chan struct{})
	var wg sync.WaitGroup
	if c.idle > 0 && mesh {
		wg.Go(func() {
			for {
				samples = append(samples, sample{time.Now(), cgroupAnon(cgs)})
				select {
				case <-stop:
					return
				case <-time.After(500 * time.Millisecond):
				}
			}
		})
	}
	out, err := zbench(ns, c.scenario, c.args...)
	end := time.Now()
	close(stop)
	wg.Wait()
	cpu := cgroupCPU(cgs) - cpu0
	if err != nil {
		return benchRow{}, err
	}
	var res struct {
		Bytes   int64 `json:"bytes"`
		Ops     int64 `json:"ops"`
		Missed  int64 `json:"missed"`
		Elapsed int64 `json:"elapsed_ns"`
		Latency *struct {
			P50  int64 `json:"p50_ns"`
			P99  int64 `json:"p99_ns"`
			P999 int64 `json:"p999_ns"`
		} `json:"latency"`
	}
	if i := strings.IndexByte(out, '{'); i >= 0 {
		out = out[i:]
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		return benchRow{}, fmt.Errorf("zbench's JSON: %v: %q", err, out)
	}
	el := time.Duration(res.Elapsed)
	r := benchRow{bytes: res.Bytes, ops: res.Ops, cpu: cpu, elapsed: el, missed: res.Missed}
	if el > 0 {
		r.gbps = float64(res.Bytes) * 8 / el.Seconds() / 1e9
		r.opsPerSec = float64(res.Ops) / el.Seconds()
	}
	if res.Latency != nil {
		r.p50, r.p99, r.p999 = time.Duration(res.Latency.P50), time.Duration(res.Latency.P99), time.Duration(res.Latency.P999)
	}
	if c.idle > 0 && mesh {
		// held: the last sample 2 s or more before zbench returned, so still in the hold
		// (after it, zbench's round trip on each connection and its exit take well under
		// a second; a sample after the close would credit memory freed by it).
		var held, peak int64
		for _, s := range samples {
			peak = max(peak, s.anon)
			if s.at.Before(end.Add(-2 * time.Second)) {
				held = s.anon
			}
		}
		r.idleBytesPerConn = float64(held-mem0) / float64(c.idle)
		r.idlePeakPerConn = float64(peak-mem0) / float64(c.idle)
	}
	return r, nil
}

// containerCgroup is the cgroup path, below a v1 hierarchy's root, of p's first container
// (the kubelet's cgroupfs layout under the node's cgroupRoot).
func containerCgroup(t *testing.T, p pod, node string) string {
	id := containerID(t, p)
	m, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup/cpuacct", "gozt-"+node, "kubepods", "*", "pod"+p.Metadata.UID, id))
	if len(m) != 1 {
		t.Fatalf("the cgroup of %s's container %s: %v", p.Metadata.Name, id, m)
	}
	rel, _ := filepath.Rel("/sys/fs/cgroup/cpuacct", m[0])
	return rel
}

// cgroupCPU is the CPU seconds the cgroups have used.
func cgroupCPU(cgs []string) float64 {
	var ns int64
	for _, cg := range cgs {
		b, _ := os.ReadFile(filepath.Join("/sys/fs/cgroup/cpuacct", cg, "cpuacct.usage"))
		v, _ := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64)
		ns += v
	}
	return float64(ns) / 1e9
}

// cgroupAnon is the anonymous memory (memory.stat rss: the Go heap, stacks and the
// runtime's) of the cgroups, in bytes.
func cgroupAnon(cgs []string) int64 {
	var n int64
	for _, cg := range cgs {
		b, _ := os.ReadFile(filepath.Join("/sys/fs/cgroup/memory", cg, "memory.stat"))
		for _, l := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(l, "rss "); ok {
				x, _ := strconv.ParseInt(v, 10, 64)
				n += x
			}
		}
	}
	return n
}

// benchReport prints the table: medians of the repetitions, and under each mesh figure its
// ratio to the Rust ztunnel's and to no mesh's.
func benchReport(t *testing.T, cases []benchCase, programs []ztunnelImage, results map[string]map[string][]benchRow, reps int) {
	cols := []string{}
	for _, p := range programs {
		cols = append(cols, p.name)
	}
	cols = append(cols, "no mesh")
	type metric struct {
		name string
		of   func(benchRow) float64
		when func(benchCase) bool
		mesh bool // only a figure with the mesh (the ztunnels' CPU and memory)
	}
	tp := func(c benchCase) bool { return c.scenario == "throughput" }
	metrics := []metric{
		{"Gbit/s", func(r benchRow) float64 { return r.gbps }, tp, false},
		{"ztunnels' CPU s per GB", func(r benchRow) float64 { return r.cpu / (float64(r.bytes) / 1e9) }, tp, true},
		{"p50 µs", func(r benchRow) float64 { return float64(r.p50.Microseconds()) }, func(c benchCase) bool { return c.name == "rr" || c.name == "pingpong" }, false},
		{"p99 µs", func(r benchRow) float64 { return float64(r.p99.Microseconds()) }, func(c benchCase) bool { return c.name == "rr" || c.name == "connrate" }, false},
		{"p99.9 µs", func(r benchRow) float64 { return float64(r.p999.Microseconds()) }, func(c benchCase) bool { return c.name == "rr" }, false},
		{"ztunnels' vCPU per 1000 rps", func(r benchRow) float64 { return r.cpu / r.elapsed.Seconds() / (r.opsPerSec / 1000) }, func(c benchCase) bool { return c.name == "rr" }, true},
		{"connections/s", func(r benchRow) float64 { return r.opsPerSec }, func(c benchCase) bool { return c.name == "connrate" }, false},
		{"ztunnels' KiB per idle connection, held", func(r benchRow) float64 { return r.idleBytesPerConn / 1024 }, func(c benchCase) bool { return c.idle > 0 }, true},
		{"ztunnels' KiB per idle connection, peak", func(r benchRow) float64 { return r.idlePeakPerConn / 1024 }, func(c benchCase) bool { return c.idle > 0 }, true},
	}
	var b strings.Builder
	fmt.Fprintf(&b, "| row | figure | %s |\n| --- | --- |%s\n", strings.Join(cols, " | "), strings.Repeat(" --- |", len(cols)))
	for _, c := range cases {
		for _, m := range metrics {
			if !m.when(c) {
				continue
			}
			med := map[string]float64{}
			for _, col := range cols {
				var v []float64
				for _, r := range results[c.name][col] {
					v = append(v, m.of(r))
				}
				if len(v) > 0 {
					sort.Float64s(v)
					med[col] = v[len(v)/2]
				}
			}
			fmt.Fprintf(&b, "| %s | %s |", c.name, m.name)
			for _, col := range cols {
				v, ok := med[col]
				switch {
				case !ok || (m.mesh && col == "no mesh"):
					b.WriteString(" – |")
				default:
					fmt.Fprintf(&b, " %s", num(v))
					var ratios []string
					if rs, ok := med["rust"]; ok && col != "rust" && col != "no mesh" && rs != 0 {
						ratios = append(ratios, fmt.Sprintf("%.2f× Rust", v/rs))
					}
					if nm, ok := med["no mesh"]; ok && col != "no mesh" && nm != 0 && !m.mesh {
						ratios = append(ratios, fmt.Sprintf("%.2f× no mesh", v/nm))
					}
					if len(ratios) > 0 {
						fmt.Fprintf(&b, " (%s)", strings.Join(ratios, ", "))
					}
					b.WriteString(" |")
				}
			}
			b.WriteString("\n")
		}
	}
	t.Logf("cluster bench, medians of %d repetitions:\n%s", reps, b.String())
	dir := filepath.Join(root, ".tmp/bench")
	if os.MkdirAll(dir, 0o755) == nil {
		name := filepath.Join(dir, "cluster-"+time.Now().UTC().Format("20060102-150405")+".md")
		if os.WriteFile(name, []byte(b.String()), 0o644) == nil {
			t.Logf("cluster bench: table written to %s", name)
		}
	}
}

func num(v float64) string {
	switch {
	case v >= 100:
		return fmt.Sprintf("%.0f", v)
	case v >= 10:
		return fmt.Sprintf("%.1f", v)
	}
	return fmt.Sprintf("%.2f", v)
}
