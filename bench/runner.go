package bench

import (
	"context"
	"fmt"
	"sync"
	"time"
)

// Options shape one scenario run. The zero value of each field means the default named in
// its comment, which is chosen per scenario.
type Options struct {
	Duration  time.Duration // how long to drive load (idle: how long to hold); zero: 5s (idle: 1s)
	Count     int           // pingpong, connrate: stop after this many operations; zero: Duration decides
	Conns     int           // parallel connections; zero: 1 (idle: 1000, connrate: 4)
	Payload   int           // bytes per request or per bulk write; zero: 1 KiB (throughput: 256 KiB)
	Rate      float64       // rr: requests per second over all connections; zero: 1000
	Direction string        // throughput: "echo" (default), "up" to a sink, "down" from a source
	Procs     []Proc        // processes whose CPU and memory are charged to the path
}

// Scenarios lists the scenario names Run accepts, in the order the suite runs them.
var Scenarios = []string{"throughput", "rr", "pingpong", "connrate", "idle"}

var scenarioFuncs = map[string]func(context.Context, *run) error{
	"throughput": runThroughput,
	"rr":         runRR,
	"pingpong":   runPingPong,
	"connrate":   runConnRate,
	"idle":       runIdle,
}

// Result is what one scenario run measured. Derived figures are methods so the JSON and the
// table cannot disagree.
type Result struct {
	Scenario string          `json:"scenario"`
	Case     string          `json:"case,omitempty"` // set by the suite: "throughput/1", "rr", ...
	Path     string          `json:"path,omitempty"` // set by the suite: "direct", "ztunnel", a peer chain
	Rep      int             `json:"rep,omitempty"`  // set by the suite: repetition, from 1
	Target   string          `json:"target"`
	Conns    int             `json:"conns"`
	Payload  int             `json:"payload"`
	Rate     float64         `json:"rate,omitempty"` // rr: offered requests per second
	Elapsed  time.Duration   `json:"elapsed_ns"`     // from first send to last byte checked
	Bytes    int64           `json:"bytes"`          // payload bytes read back and checked (throughput up: acknowledged by the sink)
	Ops      int64           `json:"ops"`            // requests answered, round trips, or connections made
	Missed   int64           `json:"missed,omitempty"`
	Latency  *Histogram      `json:"-"`
	Summary  *LatencySummary `json:"latency,omitempty"`
	// IdleConns and IdleRSSDelta are idle's memory measurement: the proxies' resident set
	// growth while IdleConns connections were held open.
	IdleConns    int         `json:"idle_conns,omitempty"`
	IdleRSSDelta int64       `json:"idle_rss_delta_bytes,omitempty"`
	Procs        []ProcUsage `json:"procs,omitempty"`
}

// Gbps returns checked payload bits per second.
func (r *Result) Gbps() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Bytes) * 8 / r.Elapsed.Seconds() / 1e9
}

// OpsPerSec returns operations completed per second.
func (r *Result) OpsPerSec() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Ops) / r.Elapsed.Seconds()
}

// CPUSeconds returns the CPU time of all measured processes together; 0 without any.
func (r *Result) CPUSeconds() float64 {
	var s float64
	for _, p := range r.Procs {
		s += p.CPUSeconds
	}
	return s
}

// CPUPerGB returns proxy CPU seconds per GB (1e9 bytes) of checked payload.
func (r *Result) CPUPerGB() float64 {
	if r.Bytes == 0 {
		return 0
	}
	return r.CPUSeconds() / (float64(r.Bytes) / 1e9)
}

// VCPUPer1000RPS returns the proxies' CPU use in vCPUs, scaled to 1000 operations per second.
func (r *Result) VCPUPer1000RPS() float64 {
	ops := r.OpsPerSec()
	if ops == 0 || r.Elapsed <= 0 {
		return 0
	}
	return r.CPUSeconds() / r.Elapsed.Seconds() / (ops / 1000)
}

// CPUPerOp returns proxy CPU time per operation.
func (r *Result) CPUPerOp() time.Duration {
	if r.Ops == 0 {
		return 0
	}
	return time.Duration(r.CPUSeconds() / float64(r.Ops) * 1e9)
}

// PeakRSSPerProc returns the largest peak resident set of any one measured process tree.
func (r *Result) PeakRSSPerProc() int64 {
	var m int64
	for _, p := range r.Procs {
		m = max(m, p.PeakRSS)
	}
	return m
}

// PeakAnonPerProc returns the largest peak anonymous resident set (heap, stacks; not the
// binary's mapped pages) of any one measured process tree.
func (r *Result) PeakAnonPerProc() int64 {
	var m int64
	for _, p := range r.Procs {
		m = max(m, p.PeakAnon)
	}
	return m
}

// BytesPerIdleConn returns idle's resident memory growth per held connection.
func (r *Result) BytesPerIdleConn() float64 {
	if r.IdleConns == 0 {
		return 0
	}
	return float64(r.IdleRSSDelta) / float64(r.IdleConns)
}

// run is the state one scenario function works with.
type run struct {
	target Target
	opts   Options
	res    *Result
	meter  *meter
}

// Run drives one scenario against t and charges the named processes' CPU and memory to it.
func Run(ctx context.Context, scenario string, t Target, o Options) (*Result, error) {
	f, ok := scenarioFuncs[scenario]
	if !ok {
		return nil, fmt.Errorf("bench: unknown scenario %q", scenario)
	}
	o = withDefaults(scenario, o)
	res := &Result{Scenario: scenario, Target: t.String(), Conns: o.Conns, Payload: o.Payload}
	m, err := startMeter(o.Procs)
	if err != nil {
		return nil, err
	}
	err = f(ctx, &run{target: t, opts: o, res: res, meter: m})
	res.Procs = m.stop()
	if res.Latency != nil {
		s := res.Latency.Summary()
		res.Summary = &s
	}
	if err != nil {
		return res, fmt.Errorf("bench: %s: %w", scenario, err)
	}
	return res, nil
}

func withDefaults(scenario string, o Options) Options {
	if o.Duration <= 0 {
		o.Duration = 5 * time.Second
		if scenario == "idle" {
			o.Duration = time.Second
		}
	}
	if o.Conns <= 0 {
		switch scenario {
		case "idle":
			o.Conns = 1000
		case "connrate":
			o.Conns = 4
		default:
			o.Conns = 1
		}
	}
	if o.Payload <= 0 {
		o.Payload = 1024
		if scenario == "throughput" {
			o.Payload = maxChunk
		}
	}
	o.Payload = min(o.Payload, maxChunk)
	if o.Rate <= 0 {
		o.Rate = 1000
	}
	if o.Direction == "" {
		o.Direction = "echo"
	}
	return o
}

// meter samples the measured process trees' memory every 50 ms while a scenario runs and
// takes their CPU time at both ends.
type meter struct {
	procs []Proc
	trees [][]int
	start []ProcStat
	stopc chan struct{}
	done  chan struct{}

	mu       sync.Mutex
	peak     []int64 // RSS
	peakAnon []int64 // RssAnon
}

func startMeter(procs []Proc) (*meter, error) {
	m := &meter{procs: procs, stopc: make(chan struct{}), done: make(chan struct{})}
	for _, p := range procs {
		if _, err := ReadProc(p.PID); err != nil {
			return nil, fmt.Errorf("bench: process %s: %w", p.Name, err)
		}
		tree := processTree(p.PID)
		m.trees = append(m.trees, tree)
		st := treeStat(tree)
		m.start = append(m.start, st)
		m.peak = append(m.peak, st.RSS)
		m.peakAnon = append(m.peakAnon, st.Anon)
	}
	go m.sampleLoop()
	return m, nil
}

func (m *meter) sampleLoop() {
	defer close(m.done)
	if len(m.procs) == 0 {
		<-m.stopc
		return
	}
	t := time.NewTicker(50 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-m.stopc:
			return
		case <-t.C:
			m.sample()
		}
	}
}

// sample records the current resident sets and returns their sum.
func (m *meter) sample() int64 {
	var total int64
	for i, tree := range m.trees {
		st := treeStat(tree)
		total += st.RSS
		m.mu.Lock()
		m.peak[i] = max(m.peak[i], st.RSS)
		m.peakAnon[i] = max(m.peakAnon[i], st.Anon)
		m.mu.Unlock()
	}
	return total
}

func (m *meter) stop() []ProcUsage {
	close(m.stopc)
	<-m.done
	m.sample()
	out := make([]ProcUsage, len(m.procs))
	for i, p := range m.procs {
		// Re-read the tree: workers started during the run count, and CPU of those that
		// exited is lost (a limit of /proc, stated here rather than hidden).
		end := treeStat(processTree(p.PID))
		out[i] = ProcUsage{
			Proc:       p,
			CPUSeconds: max(0, (end.CPU - m.start[i].CPU).Seconds()),
			PeakRSS:    m.peak[i],
			PeakAnon:   m.peakAnon[i],
			HWM:        end.HWM,
		}
	}
	return out
}
