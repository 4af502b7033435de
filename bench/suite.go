package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"time"
)

// SuiteConfig configures RunSuite. The zero value runs the full suite (3 repetitions of 5 s
// runs) on the direct path and two ztunnel nodes built from the repository.
type SuiteConfig struct {
	Repo        string        // repository root; zero: found upward from the working directory
	Ztunnel     string        // a built ztunnel binary; zero: go build ./cmd/ztunnel
	NoZtunnel   bool          // leave the ztunnel path out
	Peers       bool          // also measure every chain peers.sh starts
	PeersScript string        // zero: <Repo>/../shared/bench/peers.sh
	EchoAddr    string        // the echo server, as the ztunnel topology names it; zero: 127.0.0.3:8080
	Short       bool          // preset for a quick look: 1 repetition of 1 s runs, 300 idle connections
	Reps        int           // repetitions of every run (the table shows medians); zero: 3, short 1
	Duration    time.Duration // per run; zero: 5s, short 1s
	IdleConns   int           // connections idle holds; zero: 1000, short 300
	WorkDir     string        // logs, binaries, CA; zero: a temporary directory removed afterwards
	Progress    io.Writer     // where the live progress line goes; nil: nowhere
	Log         io.Writer     // notes on paths started and skipped, tool output; nil: discarded
}

// A suiteCase is one column of work: a scenario with fixed options, run on every path.
type suiteCase struct {
	name     string
	scenario string
	opts     Options
	proxied  bool // only meaningful where there are proxy processes to measure
}

func (cfg *SuiteConfig) cases() []suiteCase {
	d := cfg.Duration
	return []suiteCase{
		{name: "throughput/1", scenario: "throughput", opts: Options{Duration: d, Conns: 1}},
		{name: "throughput/8", scenario: "throughput", opts: Options{Duration: d, Conns: 8}},
		{name: "pingpong", scenario: "pingpong", opts: Options{Duration: d, Conns: 1, Payload: 1024}},
		{name: "rr", scenario: "rr", opts: Options{Duration: d, Conns: 4, Payload: 1024, Rate: 1000}},
		{name: "connrate", scenario: "connrate", opts: Options{Duration: d, Conns: 4, Payload: 1024}},
		{name: "idle", scenario: "idle", opts: Options{Duration: min(d, time.Second), Conns: cfg.IdleConns, Payload: 64}, proxied: true},
	}
}

func (cfg *SuiteConfig) setDefaults() error {
	if cfg.Repo == "" {
		repo, err := findRepo()
		if err != nil {
			return err
		}
		cfg.Repo = repo
	}
	if cfg.PeersScript == "" {
		cfg.PeersScript = filepath.Join(cfg.Repo, "..", "shared", "bench", "peers.sh")
	}
	if cfg.EchoAddr == "" {
		cfg.EchoAddr = "127.0.0.3:8080"
	}
	short := func(full, short int) int {
		if cfg.Short {
			return short
		}
		return full
	}
	if cfg.Reps <= 0 {
		cfg.Reps = short(3, 1)
	}
	if cfg.Duration <= 0 {
		cfg.Duration = time.Duration(short(5, 1)) * time.Second
	}
	if cfg.IdleConns <= 0 {
		cfg.IdleConns = short(1000, 300)
	}
	if cfg.Log == nil {
		cfg.Log = io.Discard
	}
	return nil
}

// RunSuite starts the topology, runs every case on every path, alternating paths within each
// repetition so that drift on a shared machine hits them all alike, and stops everything it
// started before returning, also when ctx is cancelled. A path that cannot start is noted and
// left out; a run that fails is recorded and the suite goes on. The returned Report holds
// whatever was measured, even when the error is not nil.
func RunSuite(ctx context.Context, cfg SuiteConfig) (*Report, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	work := cfg.WorkDir
	if work == "" {
		dir, err := os.MkdirTemp("", "zbench-")
		if err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
		defer os.RemoveAll(dir)
		work = dir
	}
	rep := &Report{
		Started: time.Now(), CPUs: runtime.NumCPU(), Reps: cfg.Reps, Duration: cfg.Duration,
	}
	defer func() { rep.Elapsed = time.Since(rep.Started) }()
	note := func(format string, args ...any) {
		msg := fmt.Sprintf(format, args...)
		rep.Notes = append(rep.Notes, msg)
		fmt.Fprintln(cfg.Log, "zbench:", msg)
	}

	echo, err := Listen(cfg.EchoAddr, ServerConfig{Mode: ModeEcho})
	if err != nil {
		return nil, err
	}
	defer echo.Close()
	echoAddr := echo.Addr().String() // the port, when the configuration left it to the system
	paths := []*path{{name: "direct", target: Target{Addr: echoAddr}}}

	var children []*child
	defer func() { stopAll(children) }()
	if !cfg.NoZtunnel {
		p, err := startZtunnel(ctx, cfg.Repo, cfg.Ztunnel, work, echoAddr, func(c *child) { children = append(children, c) })
		if err == nil {
			err = probe(ctx, p)
		}
		if err != nil {
			note("ztunnel left out: %v", err)
			stopAll(children) // no need to keep a node that is not measured
			children = nil
		} else {
			paths = append(paths, p)
		}
	}
	if cfg.Peers {
		// The peers get their own echo listener named "localhost:PORT": ghostunnel refuses
		// any other backend address without --unsafe-target.
		pecho, err := Listen("127.0.0.1:0", ServerConfig{Mode: ModeEcho})
		if err != nil {
			return nil, err
		}
		defer pecho.Close()
		backend := "localhost:" + strconv.Itoa(pecho.Addr().(*net.TCPAddr).Port)
		pr := &peers{script: cfg.PeersScript, state: filepath.Join(work, "peers")}
		defer pr.down(cfg.Log)
		ps, err := pr.up(ctx, backend, cfg.Log)
		if err != nil {
			note("peers left out: %v", err)
		}
		for _, p := range ps {
			if err := probe(ctx, p); err != nil {
				note("%s left out: %v", p.name, err)
				continue
			}
			paths = append(paths, p)
		}
	}
	if ctx.Err() != nil {
		return rep, ctx.Err()
	}
	for _, p := range paths {
		rep.Paths = append(rep.Paths, p.name)
	}

	cases := cfg.cases()
	for _, c := range cases {
		rep.Cases = append(rep.Cases, c.name)
	}
	total := 0
	for _, c := range cases {
		for _, p := range paths {
			if !c.proxied || len(p.procs) > 0 {
				total += cfg.Reps
			}
		}
	}
	prog := startProgress(cfg.Progress, total)
	defer prog.stop()
	gone := make(map[string]bool) // paths whose processes died
	for r := 1; r <= cfg.Reps; r++ {
		for _, c := range cases {
			for _, p := range paths {
				if c.proxied && len(p.procs) == 0 {
					continue
				}
				if gone[p.name] {
					continue
				}
				if err := p.dead(); err != nil {
					note("%s left out from %s (rep %d) on: %v", p.name, c.name, r, err)
					gone[p.name] = true
					continue
				}
				prog.begin(fmt.Sprintf("%s via %s (rep %d/%d)", c.name, p.name, r, cfg.Reps))
				o := c.opts
				o.Procs = p.procs
				res, err := Run(ctx, c.scenario, p.target, o)
				if ctx.Err() != nil {
					note("interrupted during %s via %s: partial results", c.name, p.name)
					return rep, ctx.Err()
				}
				if err != nil {
					rep.Errors = append(rep.Errors, RunError{Case: c.name, Path: p.name, Rep: r, Err: err.Error()})
					fmt.Fprintf(cfg.Log, "zbench: %s via %s: %v\n", c.name, p.name, err)
					continue
				}
				res.Case, res.Path, res.Rep = c.name, p.name, r
				rep.Runs = append(rep.Runs, res)
			}
		}
	}
	prog.stop()
	if len(rep.Runs) == 0 {
		return rep, errors.New("bench: suite: no run succeeded")
	}
	return rep, nil
}

// probe checks that a path forwards at all, with a few checked round trips, so that a path
// that is up but broken is left out with one clear note instead of failing every run.
func probe(ctx context.Context, p *path) error {
	t := p.target
	t.DialTimeout = 3 * time.Second
	if _, err := Run(ctx, "pingpong", t, Options{Count: 3}); err != nil {
		return fmt.Errorf("does not forward: %w", err)
	}
	return nil
}
