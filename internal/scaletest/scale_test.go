package scaletest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
)

// result is one node's figures for one mesh.
type result struct {
	impl              string
	server            string // the control plane: gozt (ours), istiod (ours, shaped as istiod sends) or gcp (go-control-plane)
	workloads         int
	pushBytes         int
	ready             time.Duration // process start to /healthz/ready 200
	applied           time.Duration // the server's first byte of the Address answer to its ACK
	readyFirst        time.Duration // the server's first byte of the Address answer to ready
	cpuReady          time.Duration
	cpuFirst          time.Duration // of cpuReady, what the node spent after the server's first byte
	peakReady         uint64        // VmHWM when ready
	settled           uint64        // VmRSS settle after ready
	pushP50, pushP99  time.Duration
	reconnect         time.Duration // stream dropped to the new answer's ACK
	reconnectVersions int           // resource versions the client listed on reconnect
	reconnectResent   int           // resources the server resent then
	peak              uint64        // VmHWM at the end
	cpu               time.Duration
	heap              uint64        // live heap after a forced GC, settle after ready
	heapDeleted       uint64        // the same after a push removing every workload, if asked
	rssDeleted        uint64        // for the Rust ztunnel: RSS settle after that push
	err               error         // not ready
	fullPush          time.Duration // every workload pushed again, changed, send to ACK
	resync            time.Duration // every workload pushed again, the same bytes at a new version
	resyncUnsent      bool          // the server sent nothing for the resync (its versions hash the content)
	fullPushes        int           // how many full pushes that took
	// The slowest probe connection through the node and DNS lookup from it (see probe).
	conn, dns stalls
}

// stalls are a probe kind's windows: while the node was idle after ready, the same with
// every core kept busy by the test for a second (the floor a push's windows stand on, since
// the ADS server and the node share the cores), during the 100-workload pushes, the full
// pushes, the resync and the reconnect. (Not during the first push: a dedicated node holds a
// connection from its own workload until the workload arrives, WorkloadWait, so a probe
// then measures that wait.)
type stalls struct {
	idle, busy, pushes, full, resync, reconnect window
}

func (s stalls) String() string {
	return fmt.Sprintf("idle %v, idle with cores busy %v, pushes %v, full push %v, resync %v, reconnect %v", s.idle, s.busy, s.pushes, s.full, s.resync, s.reconnect)
}

func (r result) String() string {
	mb := func(b uint64) string { return strconv.FormatFloat(float64(b)/(1<<20), 'f', 1, 64) }
	name := r.impl + "/" + r.server
	if r.err != nil {
		return fmt.Sprintf("%-12s %8d workloads  NOT READY: %v  peak %s MB  cpu %v", name, r.workloads, r.err, mb(r.peak), r.cpu.Round(10*time.Millisecond))
	}
	resync := r.resync.Round(time.Millisecond).String()
	if r.resyncUnsent {
		resync = "not sent"
	}
	return fmt.Sprintf("%-12s %8d workloads  push %6.1f MB  ready %6v  from first byte: ready %6v, applied %6v, cpu %6v  cpu %6v  peak@ready %6s MB  settled %6s MB (%5.0f B/workload)  heap %s MB  push100 p50 %v p99 %v  reconnect %v (%d versions, %d resent)  peak %s MB  cpu %v",
		name, r.workloads, float64(r.pushBytes)/(1<<20), r.ready.Round(time.Millisecond), r.readyFirst.Round(time.Millisecond), r.applied.Round(time.Millisecond), r.cpuFirst.Round(10*time.Millisecond),
		r.cpuReady.Round(10*time.Millisecond), mb(r.peakReady), mb(r.settled), float64(r.settled)/float64(max(1, r.workloads)), mb(r.heap),
		r.pushP50.Round(100*time.Microsecond), r.pushP99.Round(100*time.Microsecond), r.reconnect.Round(time.Millisecond), r.reconnectVersions, r.reconnectResent,
		mb(r.peak), r.cpu.Round(10*time.Millisecond)) + fmt.Sprintf("  heap after deleting all %s MB  RSS then %s MB  full push %v (slowest of %d)  resync %v  probe p100: %v  dns p100: %v",
		mb(r.heapDeleted), mb(r.rssDeleted), r.fullPush.Round(time.Millisecond), r.fullPushes, resync, r.conn, r.dns)
}

type runOpts struct {
	settle    time.Duration // wait after ready before reading the settled RSS
	pushes    int           // incremental pushes of 100 workloads
	ready     time.Duration // how long to wait for ready
	profile   string        // if set, the heap profile after the pushes is saved here
	deleteAll bool          // at the end, push the removal of every workload
	probe     time.Duration // if set, a probe connection through the node and a DNS lookup this often
	fullPush  bool          // after the 100-workload pushes, push every workload again
	// fullPushes is how many times (1 if 0), one starting every fullPushEvery or when the
	// one before is ACKed, whichever is later.
	fullPushes    int
	fullPushEvery time.Duration
	// cpuProfile, if set, is where a CPU profile of the node from its start (at most 60 s)
	// is saved.
	cpuProfile string
	// perf, if set, is where perf record's profile of the node from its start to ready is
	// saved.
	perf string
	// pushProfile, if set, is the path prefix of a CPU profile and an execution trace of
	// the node during the full push (pushProfile+".cpu", +".trace").
	pushProfile string
	env         []string // more of the node's environment
	log         string   // if set, where the node's log is copied when it has stopped
	// server is the control plane: "gozt" (ours, the default), "istiod" (ours, shaped as
	// istiod sends) or "gcp" (go-control-plane's, tools/xdscontrol).
	server string
}

// starter starts an ADS server serving m and a node fed by it.
type starter func(t *testing.T, m *mesh, o runOpts) (controlPlane, *node)

// goztNode runs a gozt binary in the test's namespace, on a loopback address of its own.
func goztNode(impl, bin string) starter {
	return func(t *testing.T, m *mesh, o runOpts) (controlPlane, *node) {
		if o.server == "gcp" {
			xbin, err := xdsControlBinary()
			if err != nil {
				t.Fatal(err)
			}
			x := startXDSControl(t, xbin, m)
			return x, startNode(t, impl, bin, x.addr, o.env...)
		}
		sh := shapeOwn
		if o.server == "istiod" {
			sh = shapeIstiod
		}
		ads, err := startADS(m, sh)
		if err != nil {
			t.Fatal(err)
		}
		return ads, startNode(t, impl, bin, ads.addr, o.env...)
	}
}

// run measures one node of binary bin against a fresh ADS server serving m.
func run(t *testing.T, impl, bin string, m *mesh, o runOpts) result {
	t.Helper()
	return runWith(t, impl, m, o, goztNode(impl, bin))
}

func runWith(t *testing.T, impl string, m *mesh, o runOpts, startNodes starter) result {
	t.Helper()
	warmMemory(m.workloads)
	ads, n := startNodes(t, m, o)
	defer ads.stop()
	r := result{impl: impl, server: cmp.Or(o.server, "gozt"), workloads: m.workloads}
	var err error
	if o.log != "" {
		defer func() { _ = os.WriteFile(o.log, []byte(n.Output()), 0o644) }()
	}
	defer n.stop()
	var pr *probe
	if o.probe > 0 && impl != "rust" { // the Rust node is in a namespace of its own
		if pr, err = startProbe(n.ip+":15080", n.ip+":15053", serviceHost(0), o.probe); err != nil {
			t.Fatal(err)
		}
		defer pr.close()
	}
	if o.cpuProfile != "" {
		done := make(chan struct{})
		go func() { defer close(done); n.cpuProfile(o.cpuProfile, o.ready) }()
		defer func() { <-done }()
	}
	var stopPerf func() error
	if o.perf != "" {
		if stopPerf, err = n.perfRecord(o.perf); err != nil {
			t.Fatalf("perf: %v", err)
		}
	}
	readyAt, err := n.waitReady(o.ready)
	if stopPerf != nil {
		if err := stopPerf(); err != nil {
			t.Logf("perf: %v", err)
		}
	}
	if err != nil {
		r.err = err
		p := n.proc(t)
		r.peak, r.cpu = p.peak, p.cpu
		return r
	}
	r.ready = readyAt.Sub(n.start)
	p := n.proc(t)
	r.cpuReady, r.peakReady = p.cpu, p.peak
	a, acked := ads.answeredAcked(xdspb.AddressType)
	for wait := time.Now().Add(o.ready); acked.IsZero() && time.Now().Before(wait); { // the Rust ztunnel may ACK after it reports ready
		time.Sleep(time.Millisecond)
		a, acked = ads.answeredAcked(xdspb.AddressType)
	}
	r.pushBytes = a.bytes
	if !acked.IsZero() {
		r.applied = acked.Sub(a.start)
	}
	if !a.start.IsZero() {
		r.readyFirst, r.cpuFirst = readyAt.Sub(a.start), n.cpuSince(a.start, r.cpuReady)
	}

	time.Sleep(o.settle)
	r.settled = n.proc(t).rss
	if impl != "rust" { // the Rust ztunnel has no Go heap
		if r.heap, err = n.liveHeap(); err != nil {
			t.Fatal(err)
		}
	}

	// probed records both probes' windows [from, to).
	probed := func(from, to time.Time, set func(*stalls, window)) {
		if pr != nil {
			set(&r.conn, pr.window("conn", from, to))
			set(&r.dns, pr.window("dns", from, to))
		}
	}
	now := time.Now()
	probed(now.Add(-o.settle), now, func(s *stalls, w window) { s.idle = w })
	if pr != nil {
		from, to := busyCores(time.Second)
		probed(from, to, func(s *stalls, w window) { s.busy = w })
	}
	var lat []time.Duration
	pushesFrom := time.Now()
	for g := range o.pushes {
		var upd []*discoverypb.Resource
		for i := range 100 {
			upd = append(upd, workloadResource((g*100+i*97)%m.workloads, g+2))
		}
		d, err := ads.push(xdspb.AddressType, upd, nil)
		if err != nil {
			t.Fatalf("push %d: %v", g, err)
		}
		lat = append(lat, d)
	}
	probed(pushesFrom, time.Now(), func(s *stalls, w window) { s.pushes = w })
	if o.fullPush {
		// Every workload again at a new version, into a store that holds them all: the
		// push after which the Rust ztunnel's lookups stalled (istio/ztunnel#1966).
		var upd []*discoverypb.Resource
		gen := func(g int) {
			upd = make([]*discoverypb.Resource, m.workloads)
			for i := range upd {
				upd[i] = workloadResource(i, g)
			}
		}
		gen(1000)
		var profiled sync.WaitGroup
		if o.pushProfile != "" {
			// Long enough for the push at the speeds seen (1M: 50 s before the resync fix).
			secs := 2 + m.workloads/50_000
			for kind, ext := range map[string]string{"profile": ".cpu", "trace": ".trace"} {
				profiled.Go(func() {
					if err := n.saveProfile(kind, secs, o.pushProfile+ext); err != nil {
						t.Logf("%s during the full push: %v", kind, err)
					}
				})
			}
			time.Sleep(100 * time.Millisecond) // both started
		}
		from := time.Now()
		r.fullPushes = max(1, o.fullPushes)
		for k := range r.fullPushes {
			if k > 0 {
				gen(1000 + k)
				if wait := time.Until(from.Add(time.Duration(k) * o.fullPushEvery)); wait > 0 {
					time.Sleep(wait) // the pace a control plane pushes at, not synchronisation
				}
			}
			d, err := ads.push(xdspb.AddressType, upd, nil)
			if err != nil {
				t.Fatalf("full push %d: %v", k, err)
			}
			r.fullPush = max(r.fullPush, d)
		}
		probed(from, time.Now(), func(s *stalls, w window) { s.full = w })
		profiled.Wait()
		// The same bytes again at a new version: what a control plane that resends
		// everything on a reconnect sends a node that holds it all.
		for _, res := range upd {
			res.Version = "resync"
		}
		from = time.Now()
		r.resync, err = ads.push(xdspb.AddressType, upd, nil)
		if r.resyncUnsent = errors.Is(err, errUnchanged); err != nil && !r.resyncUnsent {
			t.Fatalf("resync: %v", err)
		}
		probed(from, time.Now(), func(s *stalls, w window) { s.resync = w })
	}
	if len(lat) > 0 {
		slices.Sort(lat)
		r.pushP50, r.pushP99 = lat[len(lat)/2], lat[(len(lat)*99)/100]
	}

	// A reconnect: the client lists every version it holds and the server resends none.
	start := time.Now()
	ads.drop()
	deadline := time.Now().Add(o.ready)
	for {
		a, acked = ads.answeredAcked(xdspb.AddressType)
		if a.start.After(start) && !acked.IsZero() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no reconnect within %v", o.ready)
		}
		time.Sleep(time.Millisecond)
	}
	r.reconnect = acked.Sub(start)
	probed(start, acked.Add(o.probe), func(s *stalls, w window) { s.reconnect = w })
	r.reconnectVersions = ads.reconnectVersions()
	r.reconnectResent = a.resources
	if o.profile != "" {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
		if err := n.heapProfile(ctx, o.profile); err != nil {
			t.Logf("%s: %v", impl, err)
		}
		cancel()
	}
	p = n.proc(t)
	r.peak, r.cpu = p.peak, p.cpu
	if o.deleteAll {
		names := make([]string, 0, m.workloads)
		for i := range m.workloads {
			names = append(names, workloadUID(i))
		}
		if _, err := ads.push(xdspb.AddressType, nil, names); err != nil {
			t.Fatalf("delete all: %v", err)
		}
		if impl != "rust" {
			if r.heapDeleted, err = n.liveHeap(); err != nil {
				t.Fatal(err)
			}
			r.rssDeleted = n.proc(t).rss
		} else {
			time.Sleep(o.settle)
			r.rssDeleted = n.proc(t).rss
		}
	}
	return r
}

// busyCores keeps every core busy for d with a spinning goroutine each and returns when
// that began and ended.
func busyCores(d time.Duration) (from, to time.Time) {
	from = time.Now()
	var wg sync.WaitGroup
	for range runtime.NumCPU() {
		wg.Go(func() {
			for time.Since(from) < d {
			}
		})
	}
	wg.Wait()
	return from, time.Now()
}

// count is the positive count in the environment variable name, 1 if it is unset.
func count(t *testing.T, name string) int {
	v := os.Getenv(name)
	if v == "" {
		return 1
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < 1 {
		t.Fatalf("%s=%q: want a count", name, v)
	}
	return n
}

// warmMemory touches and frees about twice what a node of n workloads peaks at, so the
// node's pages come from memory the machine has backed recently: on this VM a page the
// guest has not touched for a while is several times as slow to fault in, which made
// whichever node ran first in a sitting the slower (docs/PERFORMANCE.md, "How to reproduce").
func warmMemory(n int) {
	b := make([]byte, (64<<20)+n*2048)
	for i := 0; i < len(b); i += 4096 {
		b[i] = 1
	}
	runtime.KeepAlive(b)
	debug.FreeOSMemory()
}

// The 10k mesh, in make test: bounds that catch twice the memory per workload (the live
// heap after a GC, which is steady from run to run, and the RSS, which is not: the bound
// leaves it room), a reconnect that resends nothing, and a push deleting every workload
// that gives the heap back. The baseline is a node of a 15-workload mesh.
func TestScale10k(t *testing.T) {
	leaktest.Check(t)
	bin := gozt(t)
	o := runOpts{settle: 500 * time.Millisecond, pushes: 10, ready: time.Minute}
	base := run(t, "gozt", bin, genMesh(15), o)
	o.deleteAll = true
	big := run(t, "gozt", bin, genMesh(10000), o)
	if base.err != nil || big.err != nil {
		t.Fatalf("not ready: %v, %v", base.err, big.err)
	}
	t.Logf("%v\n%v", base, big)
	per := func(a, b uint64) float64 { return (float64(a) - float64(b)) / 10000 }
	heap, settled, peak := per(big.heap, base.heap), per(big.settled, base.settled), per(big.peak, base.peak)
	t.Logf("per workload above a 15-workload node: live heap %.0f B, settled RSS %.0f B, peak RSS %.0f B; after deleting all, heap %.1f MB (%.1f MB with none), RSS %.1f MB (%.1f)",
		heap, settled, peak, float64(big.heapDeleted)/(1<<20), float64(base.heap)/(1<<20), float64(big.rssDeleted)/(1<<20), float64(base.settled)/(1<<20))
	if heap > maxHeapPerWorkload {
		t.Errorf("live heap %.0f B per workload; want <= %d", heap, maxHeapPerWorkload)
	}
	if settled > maxRSSPerWorkload || peak > maxRSSPerWorkload {
		t.Errorf("RSS per workload settled %.0f B, peak %.0f B; want <= %d", settled, peak, maxRSSPerWorkload)
	}
	if big.reconnectVersions != 10000+10000/workloadsPerService || big.reconnectResent != 0 {
		t.Errorf("reconnect listed %d versions, server resent %d; want %d and 0", big.reconnectVersions, big.reconnectResent, 10000+10000/workloadsPerService)
	}
	// Services and policies stay; the workloads' share must go, from the heap and, as the
	// client hands it back after a push removing most of the store, from the RSS (less
	// rssKeptAnyway, which is not per workload).
	if left := per(big.heapDeleted, base.heap); left > heap/4 {
		t.Errorf("after deleting every workload the heap keeps %.0f B per workload of %.0f", left, heap)
	}
	if left := per(big.rssDeleted, base.settled); left > settled/2+per(rssKeptAnyway, 0) {
		t.Errorf("after deleting every workload the RSS keeps %.0f B per workload of %.0f (%.1f MB)", left, settled, float64(big.rssDeleted)/(1<<20))
	}
}

// The 10k mesh from the other control planes, in make test: istiod's shape (map order,
// content-hash versions) and go-control-plane's server (if make xdscontrol has built it; its
// versions hash the content too, so a resync sends nothing). Each node is ready, a
// reconnect lists every version and is resent nothing, and its live heap is within a quarter of
// the node's fed by ours.
func TestScale10kServers(t *testing.T) {
	leaktest.Check(t)
	bin := gozt(t)
	m := genMesh(10000)
	o := runOpts{settle: 500 * time.Millisecond, pushes: 10, ready: time.Minute, fullPush: true}
	own := run(t, "gozt", bin, m, o)
	for _, server := range []string{"istiod", "gcp"} {
		if server == "gcp" {
			if _, err := xdsControlBinary(); err != nil {
				t.Logf("skipping go-control-plane's server: %v", err)
				continue
			}
		}
		o.server = server
		r := run(t, "gozt", bin, m, o)
		t.Log(r)
		if r.err != nil {
			t.Errorf("%s: %v", server, r.err)
			continue
		}
		if want := 10000 + 10000/workloadsPerService; r.reconnectVersions != want || r.reconnectResent != 0 {
			t.Errorf("%s: reconnect listed %d versions, server resent %d; want %d and 0", server, r.reconnectVersions, r.reconnectResent, want)
		}
		if r.resyncUnsent != (server == "gcp") {
			t.Errorf("%s: resync unsent %v", server, r.resyncUnsent)
		}
		if float64(r.heap) > 1.25*float64(own.heap) {
			t.Errorf("%s: live heap %d B, ours %d B", server, r.heap, own.heap)
		}
	}
}

// TestScaleBench is make bench-scale: SCALE_SIZES (default 100000,1000000) meshes against
// gozt, fed by each control plane of SCALE_SERVERS (default gozt,istiod,gcp: ours, ours
// shaped as istiod sends, go-control-plane's) in turn, SCALE_ROUNDS times (default 1), so
// the servers alternate within a sitting; SCALE_FULLPUSHES full pushes (default 1), one
// every 4 s or on the last one's ACK. With SCALE_CPUPROFILE set, a CPU profile of each
// node's first minute; with SCALE_PERF, perf record of the machine from each node's start
// to ready; with SCALE_NODE_ENV (say GODEBUG=gctrace=1), more of each node's environment,
// its log kept; with SCALE_PUSHPROFILE, a CPU profile and an execution trace of each node's
// full push; a baseline gozt binary first if ZTUNNEL_BASE names one (a same-run
// before/after), and the Rust ztunnel (fed by ours) if ZTUNNEL_RS names its binary; a table
// on stdout and heap profiles in SCALE_OUT (default .tmp/scale at the repository root).
func TestScaleBench(t *testing.T) {
	sizes := os.Getenv("SCALE_SIZES")
	if sizes == "" {
		t.Skip("SCALE_SIZES not set (make bench-scale sets it)")
	}
	out := os.Getenv("SCALE_OUT")
	if out == "" {
		out = "../../.tmp/scale"
	}
	if err := os.MkdirAll(out, 0o755); err != nil {
		t.Fatal(err)
	}
	servers := strings.Split(cmp.Or(os.Getenv("SCALE_SERVERS"), "gozt,istiod,gcp"), ",")
	for _, s := range servers {
		if s != "gozt" && s != "istiod" && s != "gcp" {
			t.Fatalf("SCALE_SERVERS: %q is not gozt, istiod or gcp", s)
		}
	}
	rounds, fullPushes := count(t, "SCALE_ROUNDS"), count(t, "SCALE_FULLPUSHES")
	bin := gozt(t)
	var rows []string
	for _, s := range strings.Split(sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil {
			t.Fatal(err)
		}
		m := genMesh(n)
		var own result // the first run's, for the Rust ztunnel's push limit
		for round := range rounds {
			for _, server := range servers {
				name := fmt.Sprintf("%s-%s-%d", s, server, round)
				o := runOpts{settle: 3 * time.Second, pushes: 50, ready: 10 * time.Minute, profile: filepath.Join(out, "gozt-"+name+".heap"), deleteAll: true, probe: 5 * time.Millisecond, fullPush: true, fullPushes: fullPushes, fullPushEvery: 4 * time.Second, server: server}
				if os.Getenv("SCALE_CPUPROFILE") != "" {
					o.cpuProfile = filepath.Join(out, "gozt-"+name+".cpu")
				}
				if os.Getenv("SCALE_PERF") != "" {
					o.perf = filepath.Join(out, "gozt-"+name+".perf")
				}
				if os.Getenv("SCALE_PUSHPROFILE") != "" {
					o.pushProfile = filepath.Join(out, "gozt-"+name+".full")
				}
				if env := os.Getenv("SCALE_NODE_ENV"); env != "" {
					o.env, o.log = strings.Fields(env), filepath.Join(out, "gozt-"+name+".log")
				}
				if base := os.Getenv("ZTUNNEL_BASE"); base != "" {
					bo := o
					bo.profile, bo.cpuProfile, bo.pushProfile = filepath.Join(out, "base-"+name+".heap"), "", ""
					if o.log != "" {
						bo.log = filepath.Join(out, "base-"+name+".log")
					}
					if o.perf != "" {
						bo.perf = filepath.Join(out, "base-"+name+".perf")
					}
					if o.pushProfile != "" {
						bo.pushProfile = filepath.Join(out, "base-"+name+".full")
					}
					r := run(t, "base", base, m, bo)
					t.Log(r)
					rows = append(rows, r.String())
				}
				r := run(t, "gozt", bin, m, o)
				t.Log(r)
				rows = append(rows, r.String())
				if own.workloads == 0 {
					own = r
				}
			}
		}
		if rs := os.Getenv("ZTUNNEL_RS"); rs != "" {
			if own.pushBytes > rustMaxPush {
				rows = append(rows, fmt.Sprintf("rust  %8d workloads  SKIPPED: the push is %.1f MB, past its %d MiB limit (max_decoding_message_size, src/xds/client.rs)", n, float64(own.pushBytes)/(1<<20), rustMaxPush>>20))
				continue
			}
			o := runOpts{settle: 3 * time.Second, pushes: 50, ready: 10 * time.Minute, deleteAll: true, probe: 5 * time.Millisecond, fullPush: true}
			r := runWith(t, "rust", m, o, rustNode(rs))
			t.Log(r)
			rows = append(rows, r.String())
		}
	}
	fmt.Println(strings.Join(rows, "\n"))
}
