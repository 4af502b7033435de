package proxy_test

import (
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
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

// soakPlan draws connection i from seed alone, so TEST_SEED replays every connection's
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
	seed := testSeed(t) // replays the connections' shapes, not their timing against the faults

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
	// settle waits for a cycle's end check; its failure is logged again last, after the
	// curve, where a CI log that keeps only the tail still shows it.
	var failed error
	settle := func(check func() error) {
		t.Helper()
		if failed = testutil.Poll(testutil.Timeout, check); failed != nil {
			t.Fatalf("timed out: %v", failed)
		}
	}
	defer func() { // also when a check below ends the test early
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
		if failed != nil {
			t.Logf("failed: %v", failed)
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
		settle(func() error {
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
		settle(func() error {
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
