package proxy_test

// The soak's resource accounting (soak_test.go samples it): goroutines, fds, heap and HBONE
// connection ends, what may differ from the baseline once settled, and the curve's output.

import (
	"fmt"
	"os"
	"runtime"
	"runtime/debug"
	"runtime/pprof"
	"sort"
	"strings"
	"testing"
	"time"
)

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
