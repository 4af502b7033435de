package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/gozt/gozt/internal/child"
)

// SuiteConfig configures RunSuite. The zero value runs the full suite (3 repetitions of 5 s
// runs) on the direct path and two ztunnel nodes built from the repository, and, as root on
// Linux with ip and iptables, on the capture path between network namespaces and its veth
// baseline.
type SuiteConfig struct {
	Repo      string // repository root; zero: found upward from the working directory
	Ztunnel   string // a built ztunnel binary, checked before anything starts; zero: go build ./cmd/ztunnel
	NoZtunnel bool   // leave the ztunnel path (two nodes on loopback, SOCKS5) out
	NoCapture bool   // leave the network-namespace paths (capture, veth and the Rust comparison's) out
	// ZtunnelRS is a Rust ztunnel (istio/ztunnel) binary, which the suite never builds. With
	// it, as root with ip and iptables, the suite also runs the namespace pairs (ztunnel-ns,
	// ztunnel-rs, gozt→rs, rs→gozt; nspair.go) and capture-rs, the in-pod path with Rust
	// nodes; zero: they are left out with one note.
	ZtunnelRS   string
	NoKernelTLS bool          // leave the kernel TLS ztunnel path out (it runs only where the kernel has kernel TLS)
	Only        []string      // cases to run (rr, idle, pingpong, connrate, throughput/1, throughput/8; throughput is both); zero: all
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

// cases lists the suite's work in the order it runs. rr and idle come first so that, in the
// first repetition, the proxies' memory at 1000 requests/s and per idle connection is that
// of fresh processes rather than what bulk transfers left behind (Go returns heap to the
// system slowly).
func (cfg *SuiteConfig) cases() []suiteCase {
	if len(cfg.Only) == 0 {
		return cfg.allCases()
	}
	var cs []suiteCase
	for _, c := range cfg.allCases() {
		if slices.ContainsFunc(cfg.Only, c.named) {
			cs = append(cs, c)
		}
	}
	return cs
}

// named reports whether name selects c: its own name, or its scenario's (throughput names
// both throughput cases).
func (c suiteCase) named(name string) bool { return name == c.name || name == c.scenario }

func (cfg *SuiteConfig) allCases() []suiteCase {
	d := cfg.Duration
	return []suiteCase{
		{name: "rr", scenario: "rr", opts: Options{Duration: d, Conns: 4, Payload: 1024, Rate: 1000}},
		{name: "idle", scenario: "idle", opts: Options{Duration: min(d, time.Second), Conns: cfg.IdleConns, Payload: 64}, proxied: true},
		{name: "pingpong", scenario: "pingpong", opts: Options{Duration: d, Conns: 1, Payload: 1024}},
		{name: "connrate", scenario: "connrate", opts: Options{Duration: d, Conns: 4, Payload: 1024}},
		{name: "throughput/1", scenario: "throughput", opts: Options{Duration: d, Conns: 1, Direction: "down"}},
		{name: "throughput/8", scenario: "throughput", opts: Options{Duration: d, Conns: 8, Direction: "down"}},
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
	// Absolute paths: the nodes run in other directories (the repository, the capture work
	// directory, through ip netns exec) and are handed paths under Repo and WorkDir.
	for _, p := range []*string{&cfg.Repo, &cfg.WorkDir, &cfg.Ztunnel, &cfg.ZtunnelRS} {
		if *p == "" {
			continue
		}
		abs, err := filepath.Abs(*p)
		if err != nil {
			return fmt.Errorf("bench: suite: %w", err)
		}
		*p = abs
	}
	if cfg.Ztunnel != "" {
		if _, err := exec.LookPath(cfg.Ztunnel); err != nil {
			return fmt.Errorf("bench: suite: ztunnel binary: %w", err)
		}
	}
	if cfg.ZtunnelRS != "" {
		if _, err := exec.LookPath(cfg.ZtunnelRS); err != nil {
			return fmt.Errorf("bench: suite: Rust ztunnel binary: %w", err)
		}
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
	return cfg.checkOnly()
}

// checkOnly refuses case names the suite does not have.
func (cfg *SuiteConfig) checkOnly() error {
	all := cfg.allCases()
	var known []string
	for _, c := range all {
		known = append(known, c.name)
	}
	for _, name := range cfg.Only {
		if !slices.ContainsFunc(all, func(c suiteCase) bool { return c.named(name) }) {
			return fmt.Errorf("bench: suite: unknown case %q; the cases are %s (throughput is both)", name, strings.Join(known, ", "))
		}
	}
	return nil
}

// RunSuite starts the topology, runs every case on every path, alternating paths within each
// repetition so that drift on a shared machine hits them all alike, and stops everything it
// started before returning, also when ctx is cancelled. A path that cannot start is noted and
// left out, except one that was asked for (the ztunnel path unless NoZtunnel, the Rust
// ztunnel's paths when ZtunnelRS names a binary), which fails the suite; a run that fails is
// recorded and the suite goes on. The returned Report holds
// whatever was measured, even when the error is not nil.
func RunSuite(ctx context.Context, cfg SuiteConfig) (*Report, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	s := &suite{cfg: cfg, rep: &Report{
		Started: time.Now(), CPUs: runtime.NumCPU(), Reps: cfg.Reps, Duration: cfg.Duration,
	}}
	defer s.cleanup()
	if n := haltNote("/sys"); n != "" {
		s.note("%s", n)
	}
	if s.work = cfg.WorkDir; s.work == "" {
		dir, err := os.MkdirTemp("", "zbench-")
		if err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
		s.onEnd(func() { os.RemoveAll(dir) })
		s.work = dir
	} else if err := os.MkdirAll(s.work, 0o755); err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	paths, err := s.startPaths(ctx)
	if err != nil {
		return s.rep, err // with its notes, which say why
	}
	if ctx.Err() != nil {
		return s.rep, ctx.Err()
	}
	err = s.runAll(ctx, paths)
	for _, p := range paths {
		if p.name == kernelTLSPair.name {
			s.note("%s", kernelTLSCount(ctx, p.target.SOCKS5))
		}
	}
	if err != nil {
		return s.rep, err
	}
	if len(s.rep.Runs) == 0 {
		return s.rep, errors.New("bench: suite: no run succeeded")
	}
	return s.rep, nil
}

// suite is one RunSuite call: its configuration, what it started, what it measured.
type suite struct {
	cfg      SuiteConfig
	work     string
	rep      *Report
	cleanups []func() // run in reverse order when the suite ends
	buildErr error    // why the ztunnel binary could not be built
	missing  []string // paths asked for (ztunnel; the Rust ones with a binary) that did not start
	ca       *meshCA  // the namespace paths' CA, once one has asked for it
}

// onEnd registers f to run when the suite ends, after everything registered later.
func (s *suite) onEnd(f func()) { s.cleanups = append(s.cleanups, f) }

func (s *suite) cleanup() {
	for i := len(s.cleanups) - 1; i >= 0; i-- {
		s.cleanups[i]()
	}
	s.rep.Elapsed = time.Since(s.rep.Started)
}

func (s *suite) note(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	s.rep.Notes = append(s.rep.Notes, msg)
	fmt.Fprintln(s.cfg.Log, "zbench:", msg)
}

// startPaths starts the echo server and every path in front of it. Only a failure to start
// the echo server itself is an error; a path that does not come up is noted and left out.
func (s *suite) startPaths(ctx context.Context) ([]*path, error) {
	echo, err := Listen(s.cfg.EchoAddr, ServerConfig{Mode: ModeEcho})
	if err != nil {
		return nil, err
	}
	s.onEnd(func() { echo.Close() })
	echoAddr := echo.Addr().String() // the port, when the configuration left it to the system
	paths := []*path{{name: "direct", target: Target{Addr: echoAddr}}}

	if !s.cfg.NoZtunnel {
		if p := s.startZtunnelPath(ctx, userTLSPair, echoAddr); p != nil {
			paths = append(paths, p)
		} else {
			s.missing = append(s.missing, userTLSPair.name)
		}
	}
	if !s.cfg.NoZtunnel && !s.cfg.NoKernelTLS {
		if err := kernelTLSHere(); err != nil {
			s.note("ztunnel-ktls left out: no kernel TLS here (%v)", err)
		} else if kecho, err := Listen(kernelTLSPair.echoAddr(echoAddr), ServerConfig{Mode: ModeEcho}); err != nil {
			s.note("ztunnel-ktls left out: %v", err)
		} else {
			s.onEnd(func() { kecho.Close() })
			if p := s.startZtunnelPath(ctx, kernelTLSPair, kecho.Addr().String()); p != nil {
				p.baselines = []string{"direct", "ztunnel"}
				paths = append(paths, p)
			}
		}
	}

	if s.cfg.Peers {
		// The peers get their own echo server, named "localhost:PORT": ghostunnel refuses
		// any other backend address without --unsafe-target.
		pecho, err := Listen("127.0.0.1:0", ServerConfig{Mode: ModeEcho})
		if err != nil {
			return nil, err
		}
		s.onEnd(func() { pecho.Close() })
		backend := "localhost:" + strconv.Itoa(pecho.Addr().(*net.TCPAddr).Port)
		pr := &peers{script: s.cfg.PeersScript, state: filepath.Join(s.work, "peers")}
		s.onEnd(func() { pr.down(s.cfg.Log) })
		chains, err := pr.up(ctx, backend, s.cfg.Log)
		if err != nil {
			s.note("peers left out: %v", err)
		}
		for _, p := range chains {
			if err := probe(ctx, p); err != nil {
				s.note("%s left out: %v", p.name, err)
				continue
			}
			paths = append(paths, p)
		}
	}
	if !s.cfg.NoCapture {
		paths = append(paths, s.startCapturePaths(ctx)...)
	}
	if s.cfg.ZtunnelRS != "" {
		// Asked for by naming the binary: each Rust path must run, or the suite fails.
		rs := program{rust: true, bin: s.cfg.ZtunnelRS}
		want := []string{captureName(rs)}
		for _, pr := range nsPairs(program{}, rs) {
			if pr.a.rust || pr.b.rust {
				want = append(want, pr.name)
			}
		}
		for _, name := range want {
			if !slices.ContainsFunc(paths, func(p *path) bool { return p.name == name }) {
				s.missing = append(s.missing, name)
			}
		}
	}
	if len(s.missing) > 0 {
		return paths, fmt.Errorf("bench: suite: %s asked for but did not start (the notes above say why)", strings.Join(s.missing, ", "))
	}
	for _, p := range paths {
		s.rep.Paths = append(s.rep.Paths, p.name)
		if p.rust != "" {
			if s.rep.Rust == nil {
				s.rep.Rust = map[string]string{}
			}
			s.rep.Rust[p.name] = p.rust
		}
		if p.baselines != nil {
			if s.rep.Baselines == nil {
				s.rep.Baselines = map[string][]string{}
			}
			s.rep.Baselines[p.name] = p.baselines
		}
	}
	return paths, nil
}

// startZtunnelPath starts a pair of ztunnel nodes in front of echo and probes it, or notes
// why it is left out and returns nil.
func (s *suite) startZtunnelPath(ctx context.Context, zp ztunnelPair, echo string) *path {
	var nodes []*child.Process
	s.onEnd(func() { stopAll(nodes) })
	bin, err := s.ztunnelBinary(ctx)
	var p *path
	if err == nil {
		p, err = startZtunnel(ctx, zp, s.cfg.Repo, bin, s.work, echo, func(c *child.Process) { nodes = append(nodes, c) })
	}
	if err == nil {
		err = probe(ctx, p)
	}
	if err != nil {
		s.note("%s left out: %v", zp.name, err)
		stopAll(nodes) // no need to keep a node that is not measured
		return nil
	}
	return p
}

// ztunnelBinary returns the configured ztunnel binary, or builds one the first time it is
// asked for (a failed build is not tried again).
func (s *suite) ztunnelBinary(ctx context.Context) (string, error) {
	if s.cfg.Ztunnel == "" && s.buildErr == nil {
		s.cfg.Ztunnel, s.buildErr = buildZtunnel(ctx, s.cfg.Repo, s.work)
	}
	return s.cfg.Ztunnel, s.buildErr
}

// startCapturePaths starts the capture topology and returns those of its paths (veth,
// capture) that forward, and with the Rust ztunnel's binary capture-rs and the namespace
// pairs; anything missing or broken is one note.
func (s *suite) startCapturePaths(ctx context.Context) []*path {
	if why := captureMissing(); why != "" {
		s.note("capture and veth left out: %s", why)
		return nil
	}
	bin, err := s.ztunnelBinary(ctx)
	if err != nil {
		s.note("capture and veth left out: %v", err)
		return nil
	}
	gozt, rs := program{bin: bin}, program{rust: true, bin: s.cfg.ZtunnelRS}
	var veth, capture *path
	veth, capture, err = s.startCapture(ctx, gozt)
	if err != nil {
		s.note("capture and veth left out: %v", err)
	}
	var paths []*path
	for _, p := range []*path{veth, capture} {
		if p = s.checkPath(ctx, p); p != nil {
			paths = append(paths, p)
		}
	}
	if rs.bin == "" {
		s.note("ztunnel-ns, ztunnel-rs, gozt→rs, rs→gozt and capture-rs left out: the Rust ztunnel's binary is needed (ZTUNNEL_RS=/path/to/ztunnel or --ztunnel-rs)")
		return paths
	}
	if _, capRS, err := s.startCapture(ctx, rs); err != nil {
		s.note("capture-rs left out: %v", err)
	} else if p := s.checkPath(ctx, capRS); p != nil {
		paths = append(paths, p)
	}
	for _, pr := range nsPairs(gozt, rs) {
		p, err := s.startNsPair(ctx, pr)
		if err != nil {
			s.note("%s left out: %v", pr.name, err)
			continue
		}
		if p = s.checkPath(ctx, p); p != nil {
			paths = append(paths, p)
		}
	}
	return paths
}

// checkPath probes p (and on a capture path, that iptables handed the probe to node A) and
// returns it, or notes why it is left out and returns nil. A nil p stays nil.
func (s *suite) checkPath(ctx context.Context, p *path) *path {
	if p == nil {
		return nil
	}
	err := probe(ctx, p)
	if err == nil && strings.HasPrefix(p.name, "capture") {
		err = checkCaptured(ctx, p.adminDial)
	}
	if err != nil {
		s.note("%s left out: %v", p.name, err)
		return nil
	}
	return p
}

// runAll runs the repetitions: every case, and within it every path in turn.
func (s *suite) runAll(ctx context.Context, paths []*path) error {
	cases := s.cfg.cases()
	total := 0
	for _, c := range cases {
		s.rep.Cases = append(s.rep.Cases, c.name)
		for _, p := range paths {
			if !c.proxied || len(p.procs) > 0 {
				total += s.cfg.Reps
			}
		}
	}
	prog := startProgress(s.cfg.Progress, total)
	defer prog.stop()
	gone := make(map[string]bool) // paths whose processes died
	for r := 1; r <= s.cfg.Reps; r++ {
		for _, c := range cases {
			for _, p := range paths {
				if c.proxied && len(p.procs) == 0 || gone[p.name] {
					continue
				}
				if err := p.dead(); err != nil {
					s.note("%s left out from %s (rep %d) on: %v", p.name, c.name, r, err)
					gone[p.name] = true
					continue
				}
				prog.begin(fmt.Sprintf("%s via %s (rep %d/%d)", c.name, p.name, r, s.cfg.Reps))
				o := c.opts
				o.Procs = p.procs
				res, err := Run(ctx, c.scenario, p.target, o)
				if ctx.Err() != nil {
					s.note("interrupted during %s via %s: partial results", c.name, p.name)
					return ctx.Err()
				}
				if err != nil {
					s.rep.Errors = append(s.rep.Errors, RunError{Case: c.name, Path: p.name, Rep: r, Err: err.Error()})
					fmt.Fprintf(s.cfg.Log, "zbench: %s via %s: %v\n", c.name, p.name, err)
					continue
				}
				res.Case, res.Path, res.Rep = c.name, p.name, r
				s.rep.Runs = append(s.rep.Runs, res)
			}
		}
	}
	return nil
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
