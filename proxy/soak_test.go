package proxy_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"regexp"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds"
	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// The soak test's knobs. `go test` runs the CI slice (one 60 s fault cycle); `make soak`
// runs the long one (cycles repeat until the duration or connection count is reached).
var (
	soakDuration = flag.Duration("soak.duration", 60*time.Second, "soak: how long traffic runs (fault cycles of 60s repeat)")
	soakConns    = flag.Int64("soak.conns", 0, "soak: stop after this many connections (0: no limit)")
	soakParallel = flag.Int("soak.parallel", 64, "soak: concurrent client connections")
	soakSample   = flag.Duration("soak.sample", time.Second, "soak: resource sampling interval")
	soakCSV      = flag.String("soak.csv", "", "soak: write the resource curve to this CSV file")
	// With -test.memprofilerate=8192 or so, go tool pprof -diff_base PATH.1 PATH.N shows
	// what grew between cycles.
	soakHeapProfile = flag.String("soak.heapprofile", "", "soak: write a heap profile to PATH.N after cycle N settles")
)

// The fault cycle, as offsets into each soakCycle of the run.
const (
	soakCycle = 60 * time.Second
	// The xDS server is stopped for 30 s, then restarted on its port. The nodes keep their
	// last state: no connection may fail for it.
	xdsDownAt, xdsUpAt = 16 * time.Second, 46 * time.Second
	// The CA is stopped for longer than a certificate lives (soakTTL): both nodes'
	// certificates expire while it is down. Certificates are only needed for new HBONE
	// connections, so node B is bounced (caBounceAt) once they have expired: node A must
	// dial it again with no valid certificate, and the new node B has none to serve.
	caDownAt, caUpAt = 2 * time.Second, 16 * time.Second
	caBounceAt       = 11 * time.Second
	soakTTL          = 8 * time.Second
	// caGrace is how long after the CA returns new connections may still fail for want of a
	// certificate: the certificate manager's retry backoff (1, 2, 4, 8 s ±20%) can put its
	// next try that far after the CA's return.
	caGrace = 14 * time.Second
	// Node B is killed mid-stream (listeners and every live connection closed at once) and
	// a new node B starts on the same addresses nodeBDown later; it needs the CA and xDS.
	nodeKillAt, nodeBDown = 48 * time.Second, 2 * time.Second
	nodeGrace             = 10 * time.Second
	// failFast bounds how long a connection may take to fail once its fault began: a SOCKS5
	// reply waits at most for the certificate manager's FetchTimeout (10 s).
	failFast = 15 * time.Second
	// bigSize is the size of the one-way 64 MiB transfers; every bigEvery-th connection is one.
	bigSize  = 64 << 20
	bigEvery = 20000
)

// soakKind is what one soak connection does; each has its own backend.
type soakKind int

const (
	soakEcho         soakKind = iota // client sends a bytes, half-closes, reads the echo to EOF
	soakServerFirst                  // backend sends a bytes and half-closes, then the client sends b
	soakLong                         // client sends a bytes in paced chunks over seconds, echoed
	soakBigDown                      // 64 MiB from the backend, then the client half-closes
	soakBigUp                        // the backend half-closes at once, then 64 MiB from the client
	soakClientAbort                  // client sends a bytes, then resets
	soakBackendReset                 // backend reads a bytes, then resets
	soakStall                        // backend reads the header and never answers; the client gives up
	soakHalfOpen                     // client asks for a download, reads nothing, later resets
	soakGone                         // to a port nothing listens on (a backend that vanished)
	soakIdle                         // client sends nothing and closes
	soakKinds
)

func (k soakKind) String() string {
	return [...]string{"echo", "server-first", "long", "big-down", "big-up", "client-abort", "backend-reset", "stall", "half-open", "gone", "idle"}[k]
}

// soakPlan draws connection i from seed alone, so SOAK_SEED replays every connection's
// shape (not its timing against the faults).
func soakPlan(seed uint64, i uint64) chaosPlan {
	rng := rand.New(rand.NewPCG(seed, i))
	p := chaosPlan{index: int(i)}
	var k soakKind
	switch r := rng.IntN(100); {
	case i%bigEvery == 1:
		k = soakBigDown
	case i%bigEvery == bigEvery/2:
		k = soakBigUp
	case r < 55:
		k = soakEcho
	case r < 63:
		k = soakEcho
		p.a = 4<<10 + rng.Int64N(256<<10) // medium; below, small
	case r < 80:
		k = soakServerFirst
	case r < 81:
		k = soakLong
	case r < 85:
		k = soakClientAbort
	case r < 89:
		k = soakBackendReset
	case r < 90:
		k = soakStall
	case r < 91:
		k = soakHalfOpen
	case r < 95:
		k = soakGone
	default:
		k = soakIdle
	}
	p.kind = behaviour(k)
	switch k {
	case soakEcho:
		if p.a == 0 {
			p.a = rng.Int64N(4<<10 + 1)
		}
	case soakServerFirst:
		p.a, p.b = rng.Int64N(64<<10+1), rng.Int64N(64<<10+1)
	case soakLong:
		p.a = 64<<10 + rng.Int64N(512<<10)
		p.pause = time.Duration(1+rng.IntN(3)) * time.Second // spread over this long
	case soakBigDown:
		p.a, p.b = bigSize, rng.Int64N(1<<10)
	case soakBigUp:
		p.a, p.b = 0, bigSize
	case soakClientAbort:
		p.a = rng.Int64N(256 << 10)
	case soakBackendReset:
		p.a = rng.Int64N(64 << 10)
	case soakStall:
		p.pause = 100*time.Millisecond + time.Duration(rng.Int64N(int64(200*time.Millisecond)))
	case soakHalfOpen:
		p.a = 8 << 20
		p.pause = 300*time.Millisecond + time.Duration(rng.Int64N(int64(700*time.Millisecond)))
	case soakIdle:
		p.pause = time.Duration(rng.Int64N(int64(50 * time.Millisecond)))
	}
	return p
}

// Outcomes. A connection either completes (every byte checked), ends as its kind means it
// to (abort, reset, stall, gone: "by design"), or fails; a failure is expected only as the
// kind a fault window allows.
const (
	outOK         = "ok"
	outDesigned   = "by-design"
	failRefused   = "socks-refused" // the SOCKS5 reply was not success
	failHandshake = "socks-broken"  // the SOCKS5 handshake itself failed (EOF, reset)
	failCut       = "cut"           // reset, or EOF before every byte, after the tunnel opened
	failTimeout   = "timeout"       // no end within the connection's deadline: never expected
	failWrong     = "wrong-bytes"   // never allowed
)

// soakResult is one connection's end.
type soakResult struct {
	plan       chaosPlan
	start, end time.Time
	outcome    string // outOK, outDesigned or a fail* kind
	err        error
	local      string // the client's address, as node A's access log names it
}

// faultLog records when each fault happened, for judging failures.
type faultLog struct {
	mu      sync.Mutex
	windows map[string][][2]time.Time // fault name -> [start, end of grace]
}

func (f *faultLog) add(name string, start, end time.Time) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.windows[name] = append(f.windows[name], [2]time.Time{start, end})
}

// during returns the first fault window of the given names that overlaps [start, end], and
// when it began.
func (f *faultLog) during(start, end time.Time, names ...string) (string, time.Time, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, n := range names {
		for _, w := range f.windows[n] {
			if !start.After(w[1]) && !end.Before(w[0]) {
				return n, w[0], true
			}
		}
	}
	return "", time.Time{}, false
}

// TestSoak runs connections of every kind through SOCKS5, node A, HBONE and node B while
// faults are injected on a 60 s schedule: the xDS server down for 30 s, the CA down for
// longer than a certificate lives, node B killed and restarted mid-stream, backends that
// reset, stall or vanish, clients that reset or go half-open. Both nodes get their
// workloads from a real ADS server (xds.Client) and their certificates from a real Istio CA
// (catest) with an 8 s SECRET_TTL. No connection may ever see a wrong byte; every failure
// must be one its fault window explains, come within failFast, and be flagged (an ERROR
// access-log record on node A); after each cycle, with traffic stopped, goroutines, fds and
// live heap return to baseline, less what the pooled HBONE connections still hold.
//
// It runs only when asked (SOAK=1): `make soak-slice` (part of make check) runs one cycle
// (60 s), `make soak` many (-soak.duration, -soak.conns). Both run without -race, which on
// two cores cuts the traffic to about a third.
func TestSoak(t *testing.T) {
	if os.Getenv("SOAK") == "" {
		t.Skip("soak: set SOAK=1 (make soak-slice, make soak) to run it")
	}
	leaktest.Check(t)
	checkFDs(t)
	seed := rand.Uint64()
	if s := os.Getenv("SOAK_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("SOAK_SEED=%q: %v", s, err)
		}
	}
	t.Logf("seed %d (replay the connections' shapes with SOAK_SEED=%d)", seed, seed)

	m := newSoakMesh(t)
	root := catest.NewRoot(t, "soak root")
	caSrv := catest.StartIstio(noCleanup{t}, root, nil)
	defer func() { caSrv.Stop() }()
	caAddr := caSrv.Addr
	ads := startSoakADS(noCleanup{t}, "127.0.0.1:0", soakResources(t, m))
	defer func() { ads.stop() }()
	adsAddr := ads.addr

	logA := newAccessLog()
	a := startSoakNode(t, "node-a", m.clientConfig(), adsAddr, caAddr, logA)
	defer a.kill()
	var bMu sync.Mutex
	b := startSoakNode(noCleanup{t}, "node-b", m.serverConfig(), adsAddr, caAddr, newAccessLog())
	defer func() { bMu.Lock(); b.kill(); bMu.Unlock() }()

	// Backends, one per kind; a backend error that is not a wrong byte is expected only
	// where the client's side explains it, so backends count their errors, and fail the
	// test only on wrong bytes or when no fault explains them.
	var backendWrong, backendErrs atomic.Int64
	var backendErrMu sync.Mutex
	var backendErrSample []string
	faults := &faultLog{windows: map[string][][2]time.Time{}}
	var backends [soakKinds]*backend
	for k := range soakKinds {
		if k == soakGone {
			continue
		}
		backends[k] = startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
			start := time.Now()
			_ = c.SetDeadline(start.Add(soakDeadline(k)))
			err := soakBackend(k, c)
			if err == nil {
				return
			}
			if errors.Is(err, errWrongBytes) {
				backendWrong.Add(1)
			} else if _, _, ok := faults.during(start, time.Now(), "node-b", "ca"); ok || k == soakClientAbort || k == soakHalfOpen || k == soakStall {
				return // node B was killed under it, or the client meant to leave
			}
			backendErrs.Add(1)
			backendErrMu.Lock()
			if len(backendErrSample) < 10 {
				backendErrSample = append(backendErrSample, fmt.Sprintf("%v backend: %v", k, err))
			}
			backendErrMu.Unlock()
		})
	}
	gonePort := closedPort(t, m.serverIP)

	testutil.Eventually(t, "both nodes to have certificates and workloads", func() bool {
		c, code, err := socksConnect(a.socks(t), m.serverIP, backends[soakEcho].port())
		if err != nil {
			t.Logf("warm-up: code %d: %v", code, err)
			time.Sleep(200 * time.Millisecond)
			return false
		}
		defer c.Close()
		sendAndCheck(t, c, 1000, 1)
		return true
	})

	// Baseline, with both nodes up and idle, measured as every settled sample is.
	base := settledResources(0)
	t.Logf("baseline: %v", base)

	// bounceB kills node B and starts a new one nodeBDown later.
	bounceB := func() {
		faults.add("node-b", time.Now(), time.Now().Add(nodeBDown+nodeGrace))
		bMu.Lock()
		b.kill()
		bMu.Unlock()
		time.Sleep(nodeBDown)
		nb := startSoakNode(noCleanup{t}, "node-b", m.serverConfig(), adsAddr, caAddr, newAccessLog())
		bMu.Lock()
		b = nb
		bMu.Unlock()
	}

	// runFaults plays one fault cycle from t0 until stop closes. A fault it began is undone
	// before it returns: after it, the CA, the xDS server and node B are all up.
	runFaults := func(t0 time.Time, stop <-chan struct{}) {
		at := func(d time.Duration) bool { // sleeps until t0+d; false once stopped
			select {
			case <-time.After(time.Until(t0.Add(d))):
				return true
			case <-stop:
				return false
			}
		}
		if !at(caDownAt) {
			return
		}
		// Each window is recorded when its fault begins, with its planned end: a
		// connection is judged as soon as it ends.
		faults.add("ca", time.Now(), t0.Add(caUpAt+caGrace))
		caSrv.Stop()
		ok := at(caBounceAt)
		if ok {
			bounceB()
			ok = at(caUpAt)
		}
		caSrv = catest.StartIstioAt(noCleanup{t}, caAddr, root, nil)
		if !ok || !at(xdsDownAt) {
			return
		}
		faults.add("xds", time.Now(), t0.Add(xdsUpAt))
		ads.stop()
		ok = at(xdsUpAt)
		ads = startSoakADS(noCleanup{t}, adsAddr, ads.resources)
		if !ok || !at(nodeKillAt) {
			return
		}
		bounceB()
	}

	// Resource sampling, for the whole run.
	var inflight, doneN, failedN atomic.Int64
	var curve []resources
	stopSampling := make(chan struct{})
	var samplingDone sync.WaitGroup
	runStart := time.Now()
	samplingDone.Add(1)
	go func() {
		defer samplingDone.Done()
		tick := time.NewTicker(*soakSample)
		defer tick.Stop()
		for {
			select {
			case <-stopSampling:
				return
			case <-tick.C:
				r := sampleResources(inflight.Load())
				r.at = time.Since(runStart)
				r.done, r.failed = doneN.Load(), failedN.Load()
				curve = append(curve, r)
			}
		}
	}()
	var settled []resources // after each cycle
	defer func() {          // also when a check below ends the test early
		close(stopSampling)
		samplingDone.Wait()
		t.Logf("resource curve (every %v):\n%s", *soakSample, formatCurve(curve, 40))
		t.Logf("peaks: %v", peaks(curve))
		for i, r := range settled {
			t.Logf("settled after cycle %d: %v", i+1, r)
		}
		if *soakCSV != "" {
			writeCurve(t, *soakCSV, curve)
		}
	}()

	// Traffic, one fault cycle at a time: after each, traffic stops, the failures are
	// checked against node A's access log, and the resources must settle to the baseline.
	var next atomic.Uint64
	var mu sync.Mutex
	counts := map[string]int64{}
	var wrong, unexpectedN int64
	var unexpected []soakResult // the first few
	var failures []soakResult   // this cycle's, to check against node A's access log
	maxFail := map[string]time.Duration{}
	socks := a.socks(t)
	connsLeft := func() bool { return *soakConns <= 0 || int64(next.Load()) < *soakConns }
	for cyc := 1; ; cyc++ {
		t0 := time.Now()
		deadline := t0.Add(min(soakCycle, *soakDuration-time.Since(runStart)))
		stop := make(chan struct{})
		faultsDone := make(chan struct{})
		go func() { defer close(faultsDone); runFaults(t0, stop) }()
		var wg sync.WaitGroup
		for range *soakParallel {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for time.Now().Before(deadline) {
					i := next.Add(1)
					if *soakConns > 0 && int64(i) > *soakConns {
						return
					}
					p := soakPlan(seed, i)
					port := gonePort
					if be := backends[p.kind]; be != nil {
						port = be.port()
					}
					inflight.Add(1)
					r := soakClient(socks, m.serverIP, port, p)
					inflight.Add(-1)
					doneN.Add(1)
					if r.outcome != outOK && r.outcome != outDesigned {
						failedN.Add(1)
					}

					mu.Lock()
					counts[soakKind(p.kind).String()+":"+r.outcome]++
					if r.outcome == failWrong {
						wrong++
					}
					if r.outcome != outOK && r.outcome != outDesigned {
						fault, began, ok := faults.during(r.start, r.end, allowedFaults(r)...)
						if ok {
							counts["by-fault:"+fault+":"+r.outcome]++
							d := r.end.Sub(later(r.start, began))
							if d > maxFail[fault+":"+r.outcome] {
								maxFail[fault+":"+r.outcome] = d
							}
							if d > failFast {
								r.err = fmt.Errorf("failed %v after %s began, want within %v: %w", d.Round(time.Millisecond), fault, failFast, r.err)
								unexpected, unexpectedN = appendFew(unexpected, r), unexpectedN+1
							}
							failures = append(failures, r)
						} else {
							unexpected, unexpectedN = appendFew(unexpected, r), unexpectedN+1
						}
					}
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		close(stop)
		<-faultsDone

		// Every failure node A saw must be an ERROR record in its access log. Records are
		// written just after a connection ends: wait until each has its record.
		testutil.EventuallyNil(t, func() error {
			var missing []string
			for _, r := range failures {
				if r.outcome != failRefused && r.outcome != failHandshake && r.outcome != failCut || logA.flagged(r.local, r.start) {
					continue
				}
				if len(missing) < 5 {
					missing = append(missing, fmt.Sprintf("conn %d (%v): %v (%v) from %s", r.plan.index, soakKind(r.plan.kind), r.outcome, r.err, r.local))
				}
			}
			if len(missing) > 0 {
				return fmt.Errorf("cycle %d: failures with no ERROR access-log record on node A, e.g.:\n%s", cyc, strings.Join(missing, "\n"))
			}
			return nil
		})
		// What the harness itself kept (a record per failed connection, the access log's
		// last time per client address) is let go, or the heap check would measure the test.
		failures = nil
		logA.forget()

		// Resources back to baseline, with both nodes still up.
		var end resources
		testutil.EventuallyNil(t, func() error {
			end = settledResources(inflight.Load())
			return end.within(base)
		})
		settled = append(settled, end)
		if *soakHeapProfile != "" {
			writeHeapProfile(t, fmt.Sprintf("%s.%d", *soakHeapProfile, cyc))
		}
		if !connsLeft() || time.Since(runStart) >= *soakDuration {
			break
		}
	}
	elapsed := time.Since(runStart)

	total := next.Load() - 1
	if *soakConns > 0 && int64(total) > *soakConns {
		total = uint64(*soakConns)
	}
	t.Logf("%d connections in %v (%d cycles): %.0f/s; projected time for 1,000,000: %v", total, elapsed.Round(time.Second), len(settled),
		float64(total)/elapsed.Seconds(), time.Duration(float64(elapsed)*1e6/float64(total)).Round(time.Second))
	t.Logf("outcomes (kind:outcome, and failures by:fault:kind):\n%s", formatCounts(counts))
	t.Logf("slowest failure after its fault began: %v", maxFail)
	for _, f := range []string{"xds", "ca", "node-b"} {
		t.Logf("fault %s: %d windows", f, len(faults.windows[f]))
	}
	t.Logf("node A access log, ERROR records by cause:\n%s", logA.summary())

	// Judgement.
	if w := wrong + backendWrong.Load(); w > 0 {
		t.Errorf("wrong bytes: %d clients, %d backends", wrong, backendWrong.Load())
	}
	for _, r := range unexpected {
		t.Errorf("unexpected %v after %v (started %v into the run): %v", r.outcome, r.end.Sub(r.start).Round(time.Millisecond),
			r.start.Sub(runStart).Round(time.Millisecond), r.err)
		if r.outcome == failWrong {
			t.Errorf("  %v: wrong bytes", r.plan)
		}
	}
	if unexpectedN > 0 {
		t.Errorf("%d unexpected outcomes of %d connections", unexpectedN, total)
	}
	if n := backendErrs.Load(); n > 0 {
		t.Errorf("%d backend errors no fault explains, e.g. %q", n, backendErrSample)
	}
	if counts["echo:"+outOK] == 0 {
		t.Errorf("no echo completed")
	}
	bMu.Lock()
	for _, n := range []*soakNode{a, b} {
		if got := counter(t, n.reg, "istio_tcp_sockets_open", nil); got != 0 {
			t.Errorf("%s: istio_tcp_sockets_open = %v after every connection closed", n.name, got)
		}
	}
	bMu.Unlock()
}

// appendFew keeps the first few unexpected results: enough to show, bounded over a long run.
func appendFew(rs []soakResult, r soakResult) []soakResult {
	if len(rs) < 20 {
		rs = append(rs, r)
	}
	return rs
}

// noCleanup is a TB for the servers and nodes the faults restart, which the test stops
// itself: t.Cleanup would keep every one it replaced reachable until the run ends, and the
// settled heap would grow by each restart (0.25 MiB a cycle).
type noCleanup struct{ testing.TB }

func (noCleanup) Cleanup(func()) {}

// newSoakMesh is newMesh on loopback subnets no other test uses: while node B is down
// another test process on the machine would otherwise find its 15008 free and take it.
func newSoakMesh(tb testing.TB) *mesh {
	tb.Helper()
	for _, sub := range []string{"127.0.50.", "127.0.51.", "127.0.52."} {
		if free(sub+"3", []string{"15008"}) {
			return &mesh{clientIP: sub + "2", serverIP: sub + "3", outsideIP: sub + "4"}
		}
	}
	tb.Skip("soak: no loopback subnet with 15008 free on .3")
	return nil
}

// allowedFaults are the fault windows that explain a failure of r's outcome.
func allowedFaults(r soakResult) []string {
	switch r.outcome {
	case failRefused, failHandshake:
		return []string{"ca", "node-b"}
	case failCut:
		return []string{"node-b"}
	}
	return nil // timeouts and wrong bytes are never expected
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func soakDeadline(k soakKind) time.Duration {
	if k == soakBigDown || k == soakBigUp {
		return 120 * time.Second
	}
	return 30 * time.Second
}

// soakClient runs one connection of plan p to host:port through the SOCKS5 proxy.
func soakClient(socks, host string, port uint16, p chaosPlan) soakResult {
	r := soakResult{plan: p, start: time.Now()}
	defer func() { r.end = time.Now() }()
	k := soakKind(p.kind)
	c, err := net.DialTimeout("tcp", socks, 5*time.Second)
	if err != nil {
		r.outcome, r.err = failHandshake, err
		return r
	}
	tc := c.(*net.TCPConn)
	defer tc.Close()
	r.local = tc.LocalAddr().String()
	code, err := socksHandshake(tc, host, port)
	if err != nil || code != repSucceeded {
		r.err = fmt.Errorf("socks5: reply %d: %v", code, err)
		switch {
		case err == nil && k == soakGone:
			r.outcome = outDesigned
		case err == nil:
			r.outcome = failRefused
		default:
			r.outcome = failHandshake
		}
		r.end = time.Now()
		return r
	}
	_ = c.SetDeadline(r.start.Add(soakDeadline(k)))
	if k == soakGone {
		r.outcome, r.err = failWrong, errors.New("connected to a port nothing listens on")
		return r
	}
	err = soakClientRun(tc, k, p)
	r.end = time.Now()
	switch {
	case err == nil:
		r.outcome = outOK
		if k == soakClientAbort || k == soakBackendReset || k == soakStall || k == soakHalfOpen || k == soakIdle {
			r.outcome = outDesigned
		}
	case errors.Is(err, errWrongBytes):
		r.outcome = failWrong
	case errors.Is(err, os.ErrDeadlineExceeded):
		r.outcome = failTimeout
	default:
		r.outcome = failCut
	}
	r.err = err
	return r
}

var errShort = errors.New("stream ended early")

// soakClientRun plays the client's side of kind k and returns the first problem.
func soakClientRun(c *net.TCPConn, k soakKind, p chaosPlan) error {
	i := uint64(p.index)
	switch k {
	case soakEcho:
		return echoCheck(c, payload(upSeed(i), p.a), upSeed(i), p.a)

	case soakLong:
		return echoCheck(c, paced{r: payload(upSeed(i), p.a), every: p.pause / time.Duration(p.a/(16<<10)+1)}, upSeed(i), p.a)

	case soakServerFirst, soakBigDown, soakBigUp:
		if _, err := c.Write(header(p)); err != nil {
			return err
		}
		if n, err := readPattern(c, downSeed(i), p.a); err != nil {
			return err
		} else if n != p.a {
			return fmt.Errorf("%w: %d of %d bytes before the backend's FIN", errShort, n, p.a)
		}
		if _, err := io.Copy(c, payload(upSeed(i), p.b)); err != nil {
			return err
		}
		if err := c.CloseWrite(); err != nil {
			return err
		}
		// The backend closes once it has checked every byte: a clean EOF says it did.
		var one [1]byte
		if n, err := c.Read(one[:]); err != io.EOF {
			return fmt.Errorf("%w: after our FIN: %d bytes, %v; want EOF", errShort, n, err)
		}
		return nil

	case soakClientAbort:
		if _, err := c.Write(header(p)); err != nil {
			return err
		}
		if _, err := io.Copy(c, payload(upSeed(i), p.a)); err != nil {
			return err
		}
		_ = c.SetLinger(0)
		return nil

	case soakBackendReset:
		// Send until the backend's reset ends the connection; it must end, and promptly.
		werr := make(chan error, 1)
		go func() {
			_, err := c.Write(header(p))
			if err == nil {
				_, err = io.Copy(c, payload(upSeed(i), chaosEndless))
			}
			werr <- err
		}()
		_, rerr := readPattern(c, downSeed(i), 0)
		if rerr != nil && !errors.Is(rerr, syscall.ECONNRESET) {
			c.Close()
		}
		err := <-werr
		switch {
		case errors.Is(rerr, os.ErrDeadlineExceeded), errors.Is(rerr, errWrongBytes):
			return rerr
		case errors.Is(err, os.ErrDeadlineExceeded):
			return err
		case err == nil:
			return fmt.Errorf("wrote %d bytes to a backend that resets after %d", chaosEndless, p.a)
		}
		return nil

	case soakStall:
		if _, err := c.Write(header(p)); err != nil {
			return err
		}
		_ = c.SetReadDeadline(time.Now().Add(p.pause))
		var one [1]byte
		n, err := c.Read(one[:])
		if err == io.EOF {
			return fmt.Errorf("%w: stalled backend: EOF; want nothing", errShort)
		}
		if !errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("stalled backend: read %d bytes, %v; want nothing", n, err)
		}
		_ = c.SetLinger(0)
		return nil

	case soakHalfOpen:
		if _, err := c.Write(header(p)); err != nil {
			return err
		}
		time.Sleep(p.pause) // read nothing: the backend's writes back up to it
		_ = c.SetLinger(0)
		return nil

	case soakIdle:
		time.Sleep(p.pause)
		return nil
	}
	return fmt.Errorf("kind %v", k)
}

// echoCheck sends src (size bytes of seed's pattern), half-closes, and reads the same
// bytes back to EOF.
func echoCheck(c *net.TCPConn, src io.Reader, seed uint64, size int64) error {
	werr := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, src)
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	n, rerr := readPattern(c, seed, size)
	if rerr != nil || n != size {
		c.Close() // unblock the writer
	}
	werr2 := <-werr
	switch {
	case rerr != nil:
		return rerr
	case n != size:
		return fmt.Errorf("%w: echo %d of %d bytes", errShort, n, size)
	case werr2 != nil:
		return werr2
	}
	return nil
}

// paced reads 16 KiB at a time with a pause before each read: a connection that lasts.
type paced struct {
	r     io.Reader
	every time.Duration
}

func (p paced) Read(b []byte) (int, error) {
	time.Sleep(p.every)
	return p.r.Read(b[:min(len(b), 16<<10)])
}

// soakBackend plays the backend's side of kind k.
func soakBackend(k soakKind, c *net.TCPConn) error {
	switch k {
	case soakEcho, soakLong:
		_, err := io.Copy(c, c)
		if err == nil {
			err = c.CloseWrite()
		}
		return err

	case soakServerFirst, soakBigDown, soakBigUp:
		return serveServerFirst(c)

	case soakClientAbort:
		h, err := readHeader(c)
		if err != nil {
			return nil // the reset overtook the header
		}
		_, err = readPattern(c, upSeed(uint64(h.index)), h.a)
		if errors.Is(err, errWrongBytes) || errors.Is(err, os.ErrDeadlineExceeded) {
			return err
		}
		return nil

	case soakBackendReset:
		h, err := readHeader(c)
		if err != nil {
			return fmt.Errorf("header: %w", err)
		}
		if n, err := readPattern(io.LimitReader(c, h.a), upSeed(uint64(h.index)), chaosEndless); err != nil || n != h.a {
			return fmt.Errorf("conn %d: read %d bytes before the reset: got %d, %w", h.index, h.a, n, err)
		}
		_ = c.SetLinger(0)
		return nil

	case soakStall:
		// Never answer; the client's reset (or FIN) must reach us.
		_, err := io.Copy(io.Discard, c)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("stalled: the client's end never arrived: %w", err)
		}
		return nil

	case soakHalfOpen:
		h, err := readHeader(c)
		if err != nil {
			return fmt.Errorf("header: %w", err)
		}
		// Write until the client's reset makes a write fail; it must.
		if _, err := io.Copy(c, payload(downSeed(uint64(h.index)), chaosEndless)); err == nil {
			return fmt.Errorf("conn %d: wrote %d bytes to a client that went away", h.index, chaosEndless)
		} else if errors.Is(err, os.ErrDeadlineExceeded) {
			return fmt.Errorf("conn %d: the client's reset never arrived: %w", h.index, err)
		}
		return nil

	case soakIdle:
		if n, err := io.Copy(io.Discard, c); n != 0 || err != nil {
			return fmt.Errorf("got %d bytes, %v; want EOF at once", n, err)
		}
	}
	return nil
}

// --- nodes fed by xDS and the Istio CA ---

// soakNode is one in-process ztunnel whose workloads come from an ADS server through
// xds.Client and whose certificates come from an Istio CA through ca.New and certs.Manager,
// as cmd/ztunnel wires them.
type soakNode struct {
	name  string
	proxy *proxy.Proxy
	reg   *prometheus.Registry
	certs *certs.Manager
	ca    ca.Client

	stopBG  context.CancelFunc
	bg      sync.WaitGroup
	once    sync.Once
	tb      testing.TB
	socksAt string
}

func startSoakNode(tb testing.TB, name string, cfg proxy.Config, adsAddr, caAddr string, log *accessLog) *soakNode {
	tb.Helper()
	n := &soakNode{name: name, reg: prometheus.NewRegistry(), tb: tb}
	store := state.NewStore()
	met := metrics.New(n.reg, "soak", metrics.WithAccessLog(slog.New(log)))
	xc, err := xds.NewClient(xds.Config{Config: istiogrpc.Config{Address: "http://" + adsAddr}, NodeID: "ztunnel~" + name, Logger: quiet}, store, met)
	if err != nil {
		tb.Fatalf("%s: xds: %v", name, err)
	}
	n.ca, err = ca.New(context.Background(), ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + caAddr}, SecretTTL: soakTTL})
	if err != nil {
		tb.Fatalf("%s: ca: %v", name, err)
	}
	n.certs = certs.New(certs.Config{Logger: quiet}, n.ca)
	cfg.Logger = quiet
	n.proxy = proxy.New(cfg, store, n.certs, met)
	var listenErr error
	for range 50 { // a restarted node binds its predecessor's 15008
		if listenErr = n.proxy.Listen(); !errors.Is(listenErr, syscall.EADDRINUSE) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if listenErr != nil {
		n.certs.Close()
		n.ca.Close()
		tb.Fatalf("%s: listen: %v", name, listenErr)
	}
	if a, ok := n.proxy.Addrs()[proxy.ListenerSocks5]; ok {
		n.socksAt = a.String()
	}
	ctx, cancel := context.WithCancel(context.Background())
	n.stopBG = cancel
	n.bg.Add(2)
	go func() { defer n.bg.Done(); _ = xc.Run(ctx) }()
	go func() { defer n.bg.Done(); n.proxy.Serve(ctx) }()
	tb.Cleanup(n.kill)
	return n
}

func (n *soakNode) socks(tb testing.TB) string {
	if n.socksAt == "" {
		tb.Fatalf("%s: no SOCKS5 listener", n.name)
	}
	return n.socksAt
}

// kill stops the node as a crash would look to its peers: listeners and every live
// connection close at once (a drain deadline already passed). Later calls do nothing.
func (n *soakNode) kill() {
	n.once.Do(func() {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_ = n.proxy.Shutdown(ctx)
		n.stopBG()
		n.bg.Wait()
		n.certs.Close()
		n.ca.Close()
	})
}

// soakADS is a minimal real delta ADS server: every subscription (a request without a
// response nonce) is answered with the full state of its type; ACKs are read and dropped.
type soakADS struct {
	discoverypb.UnimplementedAggregatedDiscoveryServiceServer
	addr      string
	resources []*discoverypb.Resource // Address resources
	srv       *grpc.Server
	done      chan struct{}
	once      sync.Once
	nonce     atomic.Int64
}

func startSoakADS(tb testing.TB, addr string, res []*discoverypb.Resource) *soakADS {
	tb.Helper()
	var ln net.Listener
	var err error
	for range 50 { // a restarted server binds its predecessor's port
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		tb.Fatalf("ads: %v", err)
	}
	// istiod lets clients ping as often as the xDS client does; grpc-go's default policy
	// would answer its keepalives with GOAWAY too_many_pings.
	srv := grpc.NewServer(grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: time.Second, PermitWithoutStream: true}))
	s := &soakADS{addr: ln.Addr().String(), resources: res, srv: srv, done: make(chan struct{})}
	discoverypb.RegisterAggregatedDiscoveryServiceServer(s.srv, s)
	go func() { defer close(s.done); _ = s.srv.Serve(ln) }()
	tb.Cleanup(s.stop)
	return s
}

// stop closes the listener and every stream at once: to the nodes the control plane is gone.
func (s *soakADS) stop() { s.once.Do(func() { s.srv.Stop(); <-s.done }) }

func (s *soakADS) DeltaAggregatedResources(st grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse]) error {
	for {
		req, err := st.Recv()
		if err != nil {
			return nil
		}
		if req.GetResponseNonce() != "" {
			continue
		}
		resp := &discoverypb.DeltaDiscoveryResponse{TypeUrl: req.GetTypeUrl(), Nonce: strconv.FormatInt(s.nonce.Add(1), 10)}
		if req.GetTypeUrl() == xdspb.AddressType {
			resp.Resources = s.resources
		}
		if err := st.Send(resp); err != nil {
			return nil
		}
	}
}

// soakResources are the mesh's two workloads as Address resources.
func soakResources(tb testing.TB, m *mesh) []*discoverypb.Resource {
	tb.Helper()
	var out []*discoverypb.Resource
	for _, w := range []struct{ name, ip, node string }{{"client", m.clientIP, "node-a"}, {"server", m.serverIP, "node-b"}} {
		uid := "Kubernetes//v1/Pod/default/" + w.name
		b, err := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: &workloadpb.Workload{
			Uid: uid, Name: w.name, Namespace: "default", ServiceAccount: w.name, Node: w.node,
			Addresses:      [][]byte{netip.MustParseAddr(w.ip).AsSlice()},
			TunnelProtocol: workloadpb.TunnelProtocol_HBONE,
		}}})
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, &discoverypb.Resource{Name: uid, Version: "1", Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: b}})
	}
	return out
}

// --- node A's access log ---

// accessLog is a slog.Handler that keeps, per source address, when its last ERROR
// "connection complete" record was written, and counts ERROR records by the start of their
// error text. INFO records are not even built (Enabled says no).
type accessLog struct {
	mu      sync.Mutex
	last    map[string]time.Time
	byCause map[string]int64
}

func newAccessLog() *accessLog {
	return &accessLog{last: map[string]time.Time{}, byCause: map[string]int64{}}
}

func (l *accessLog) Enabled(_ context.Context, lv slog.Level) bool { return lv >= slog.LevelError }
func (l *accessLog) WithAttrs([]slog.Attr) slog.Handler            { return l }
func (l *accessLog) WithGroup(string) slog.Handler                 { return l }

func (l *accessLog) Handle(_ context.Context, r slog.Record) error {
	var src, cause string
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "src.addr":
			src = a.Value.String()
		case "error":
			cause = errorClass(a.Value.String())
		}
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last[src] = r.Time
	l.byCause[cause]++
	return nil
}

// forget drops the per-address times (the counts by cause stay).
func (l *accessLog) forget() {
	l.mu.Lock()
	defer l.mu.Unlock()
	clear(l.last)
	l.last = map[string]time.Time{}
}

// errorClass shortens an error to its kind: a known cause, else the text without addresses.
func errorClass(s string) string {
	for _, c := range []string{"certs:", "connection refused", "connection reset", "broken pipe", "GOAWAY", "EOF", "503", "401", "tls:"} {
		if strings.Contains(s, c) {
			return c
		}
	}
	s = addrRE.ReplaceAllString(s, "ADDR")
	if len(s) > 80 {
		s = s[:80]
	}
	return s
}

var addrRE = regexp.MustCompile(`\d+\.\d+\.\d+\.\d+:\d+`)

// flagged reports whether src had an ERROR record written at or after start. Records are
// written just after a connection ends: call it once traffic has stopped and settled.
func (l *accessLog) flagged(src string, start time.Time) bool {
	if src == "" {
		return true // address unknown (a refused SOCKS5 handshake): not checkable
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	at, ok := l.last[src]
	return ok && !at.Before(start)
}

func (l *accessLog) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return formatCounts(l.byCause)
}

// --- resources ---

type resources struct {
	at         time.Duration
	goroutines int
	fds        int
	heap       uint64 // HeapInuse bytes
	live       uint64 // HeapAlloc bytes: in a settled sample, the live heap
	hboneEnds  int    // HBONE connection ends (both nodes' sides) alive; settled samples only
	inflight   int64  // client connections open
	done       int64  // connections ended so far
	failed     int64  // of which failed
}

func sampleResources(inflight int64) resources {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	fds := -1
	if ents, err := os.ReadDir("/proc/self/fd"); err == nil {
		fds = len(ents)
	}
	return resources{goroutines: runtime.NumGoroutine(), fds: fds, heap: ms.HeapInuse, live: ms.HeapAlloc, inflight: inflight}
}

// settledResources samples after two forced collections: the first moves every sync.Pool's
// contents (hbone's 16 KiB-1 MiB copy buffers and 64 KiB receive chunks, crypto/tls's
// buffers) to the pools' victim caches, the second frees them, so the heap left is what
// something still references.
func settledResources(inflight int64) resources {
	debug.FreeOSMemory()
	debug.FreeOSMemory()
	r := sampleResources(inflight)
	r.hboneEnds = hboneEnds()
	return r
}

// hboneEnds counts the HBONE connection ends alive in this process (each runs one frame
// reader), node A's pooled client side and node B's server side alike.
func hboneEnds() int {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			return strings.Count(string(buf[:n]), "gozt/hbone.(*conn).readLoop(")
		}
		buf = make([]byte, 2*len(buf))
	}
}

func (r resources) String() string {
	s := fmt.Sprintf("%d goroutines, %d fds, heap %.1f MiB in use, %.1f MiB allocated, %d connections", r.goroutines, r.fds,
		float64(r.heap)/(1<<20), float64(r.live)/(1<<20), r.inflight)
	if r.hboneEnds > 0 {
		s += fmt.Sprintf(", %d HBONE connection ends", r.hboneEnds)
	}
	return s
}

// What may legitimately differ between a settled sample and the baseline.
const (
	// Node A's pool keeps its connections to node B until IdleTimeout (5 min); congestion
	// (half-open clients holding stream windows) can add up to maxCongestionDials (4) to the
	// one the baseline had. Each has two ends here, node A's and node B's.
	maxHBONEEnds = 2 * (1 + 4)
	// Each end costs a frame reader and a writer goroutine (and node B's side its accept
	// handler) and one socket.
	goroutinesPerEnd, fdsPerEnd = 3, 1
	// An end that carried bulk data keeps, for its life, its Framer's read buffer grown to
	// the largest frame received (MaxFrameSize, 1 MiB), its write-coalescing buffer grown to
	// its flush threshold (256 KiB; append rounds the capacity up to 320 KiB) and
	// crypto/tls's input and output record buffers (up to 2×~17 KiB each, ~128 KiB).
	heapPerEnd = 1<<20 + 320<<10 + 128<<10
	// Everything else: gRPC channels that reconnected, certificates renewed, state re-read.
	goroutineSlack, fdSlack, heapSlack = 4, 4, 2 << 20
)

// within returns nil if r is back to the baseline: no client connection open, and
// goroutines, fds and live heap within what the HBONE connection ends alive explain.
func (r resources) within(base resources) error {
	extra := max(0, r.hboneEnds-base.hboneEnds)
	var over []string
	if r.inflight != 0 {
		over = append(over, fmt.Sprintf("%d client connections open", r.inflight))
	}
	if r.hboneEnds > maxHBONEEnds {
		over = append(over, fmt.Sprintf("%d HBONE connection ends, want at most %d", r.hboneEnds, maxHBONEEnds))
	}
	if lim := base.goroutines + extra*goroutinesPerEnd + goroutineSlack; r.goroutines > lim {
		over = append(over, fmt.Sprintf("%d goroutines, want at most %d", r.goroutines, lim))
	}
	if lim := base.fds + extra*fdsPerEnd + fdSlack; r.fds > lim {
		over = append(over, fmt.Sprintf("%d fds, want at most %d", r.fds, lim))
	}
	if lim := base.live + uint64(r.hboneEnds)*heapPerEnd + heapSlack; r.live > lim {
		over = append(over, fmt.Sprintf("live heap %.1f MiB, want at most %.1f", float64(r.live)/(1<<20), float64(lim)/(1<<20)))
	}
	if len(over) > 0 {
		return fmt.Errorf("resources not back to baseline (%v): %s; baseline %v", r, strings.Join(over, "; "), base)
	}
	return nil
}

func peaks(curve []resources) resources {
	var p resources
	for _, r := range curve {
		p.goroutines = max(p.goroutines, r.goroutines)
		p.fds = max(p.fds, r.fds)
		p.heap = max(p.heap, r.heap)
		p.live = max(p.live, r.live)
		p.inflight = max(p.inflight, r.inflight)
	}
	return p
}

// formatCurve prints at most rows samples, evenly spread.
func formatCurve(curve []resources, rows int) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%8s %10s %6s %9s %6s %8s %8s\n", "t", "goroutines", "fds", "heap MiB", "open", "ended/s", "failed/s")
	step := max(1, (len(curve)+rows-1)/rows)
	var prev resources
	for i := 0; i < len(curve); i += step {
		r := curve[i]
		secs := (r.at - prev.at).Seconds()
		fmt.Fprintf(&b, "%8v %10d %6d %9.1f %6d %8.0f %8.0f\n", r.at.Round(time.Second), r.goroutines, r.fds, float64(r.heap)/(1<<20), r.inflight,
			float64(r.done-prev.done)/secs, float64(r.failed-prev.failed)/secs)
		prev = r
	}
	return b.String()
}

func writeHeapProfile(tb testing.TB, path string) {
	f, err := os.Create(path)
	if err == nil {
		err = pprof.Lookup("heap").WriteTo(f, 0)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		tb.Errorf("heap profile: %v", err)
	}
}

func writeCurve(tb testing.TB, path string, curve []resources) {
	var b strings.Builder
	b.WriteString("seconds,goroutines,fds,heap_bytes,open,ended,failed\n")
	for _, r := range curve {
		fmt.Fprintf(&b, "%.0f,%d,%d,%d,%d,%d,%d\n", r.at.Seconds(), r.goroutines, r.fds, r.heap, r.inflight, r.done, r.failed)
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		tb.Errorf("write %s: %v", path, err)
	}
}

func formatCounts(m map[string]int64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	var b strings.Builder
	for _, k := range keys {
		fmt.Fprintf(&b, "  %-40s %d\n", k, m[k])
	}
	return b.String()
}
