//go:build linux

package main

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/testutil"
)

// This file is the in-pod scale harness (make bench-pods) and the helpers the in-pod cost
// tests share. It uses only what the node had before the pods' poller, so that the same
// file dropped into an older tree measures that tree's code for a same-run baseline.

// idleCost is what enrolled idle pods cost each, and how long their Adds took.
type idleCost struct {
	acks       []time.Duration // Add sent to ACK read, sorted
	kib        float64         // Go heap in use plus goroutine stacks, after a GC
	rssKiB     float64
	goroutines float64
}

func (c idleCost) ack(p float64) time.Duration { return c.acks[int(p*float64(len(c.acks)-1))] }

func (c idleCost) String() string {
	return fmt.Sprintf("%.1f KiB/pod (heap+stacks), RSS %.1f KiB/pod, %.2f goroutines/pod, ACK p50 %v p99 %v max %v",
		c.kib, c.rssKiB, c.goroutines, c.ack(0.5).Round(time.Microsecond), c.ack(0.99).Round(time.Microsecond), c.acks[len(c.acks)-1].Round(time.Microsecond))
}

// enrollIdle adds one pod per namespace in nss (uids prefix0, prefix1, ...), as the node
// agent does, one after another, and measures what they cost once all are up. The pods stay
// enrolled; deleteAll removes them.
func enrollIdle(tb testing.TB, c *inpodtest.AgentConn, nss []*netns.NetNS, prefix string) idleCost {
	tb.Helper()
	g0 := settledGoroutines()
	heap0, rss0 := memory(tb)
	var cost idleCost
	for i, ns := range nss {
		fd := inpodtest.NSFD(tb, ns)
		start := time.Now()
		if nack := c.Send(inpodtest.AddReq(prefix+strconv.Itoa(i)), fd); nack != "" {
			tb.Fatalf("add %d: NACK %q", i, nack)
		}
		cost.acks = append(cost.acks, time.Since(start))
	}
	g1 := settledGoroutines()
	heap1, rss1 := memory(tb)
	pods := float64(len(nss))
	cost.kib = (float64(heap1) - float64(heap0)) / pods / 1024
	cost.rssKiB = (float64(rss1) - float64(rss0)) / pods / 1024
	cost.goroutines = float64(g1-g0) / pods
	slices.Sort(cost.acks)
	return cost
}

// deleteAll deletes the pods enrollIdle added and waits until the process holds no more
// fds than fds.
func deleteAll(tb testing.TB, c *inpodtest.AgentConn, pods int, prefix string, fds int) {
	tb.Helper()
	for i := range pods {
		if nack := c.Send(inpodtest.DelReq(prefix + strconv.Itoa(i))); nack != "" {
			tb.Fatalf("del %d: NACK %q", i, nack)
		}
	}
	testutil.Eventually(tb, "every pod's sockets and netns released", func() bool { return openFDs(tb) <= fds })
}

// settledGoroutines counts goroutines once the count has stopped moving (a pod's last
// goroutines start just after its ACK, a stopped pod's end just after its shutdown).
func settledGoroutines() int {
	n := runtime.NumGoroutine()
	for range 50 {
		time.Sleep(20 * time.Millisecond)
		m := runtime.NumGoroutine()
		if m == n {
			return n
		}
		n = m
	}
	return n
}

// churnResult is what cycles of adding and deleting one pod left behind.
type churnResult struct {
	cycles             int
	perCycle, p99      time.Duration // the mean; the slowest 1% of cycles
	fds, goroutines    [2]int        // before, after
	heapKiB, rssKiB    [2]float64    // before, after (heap: live, after a GC)
	leakedFDs, leakedG int
}

func (r churnResult) String() string {
	return fmt.Sprintf("%d add/delete cycles: %v per cycle (p99 %v); fds %d -> %d, goroutines %d -> %d, live heap %.0f -> %.0f KiB, RSS %.1f -> %.1f MiB",
		r.cycles, r.perCycle.Round(time.Microsecond), r.p99.Round(time.Microsecond), r.fds[0], r.fds[1], r.goroutines[0], r.goroutines[1],
		r.heapKiB[0], r.heapKiB[1], r.rssKiB[0]/1024, r.rssKiB[1]/1024)
}

// churn adds and deletes the pod uid in ns cycles times, each Del waiting for its ACK, then
// waits for the last pod's shutdown and compares fds, goroutines and memory with before.
func churn(tb testing.TB, c *inpodtest.AgentConn, ns *netns.NetNS, uid string, cycles int) churnResult {
	tb.Helper()
	settle := func() (fds, g int, heap, rss uint64) {
		// The last pod has shut down once it has closed its netns fd; the caller holds one.
		testutil.Eventually(tb, "the pod's netns released", func() bool { return idFDs(tb, ns.ID()) == 1 })
		g = settledGoroutines()
		_, rss = memory(tb) // after a GC
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		return openFDs(tb), g, ms.HeapAlloc, rss
	}
	cycle := func(i int) {
		if nack := c.Send(inpodtest.AddReq(uid), inpodtest.NSFD(tb, ns)); nack != "" {
			tb.Fatalf("cycle %d: add: NACK %q", i, nack)
		}
		if nack := c.Send(inpodtest.DelReq(uid)); nack != "" {
			tb.Fatalf("cycle %d: del: NACK %q", i, nack)
		}
	}
	cycle(0) // lazily made things (a thread per setns, the DNS upstream list) count as before
	var r churnResult
	r.cycles = cycles
	fds0, g0, heap0, rss0 := settle()
	times := make([]time.Duration, 0, cycles)
	start := time.Now()
	for i := 1; i <= cycles; i++ {
		t0 := time.Now()
		cycle(i)
		times = append(times, time.Since(t0))
	}
	r.perCycle = time.Since(start) / time.Duration(cycles)
	slices.Sort(times)
	r.p99 = times[int(0.99*float64(len(times)-1))]
	var fds1, g1 int
	var heap1, rss1 uint64
	// Shutdowns run in the background: poll until the counts are back, or give up and report.
	_ = testutil.Poll(5*time.Second, func() error {
		if fds1, g1, heap1, rss1 = settle(); fds1 > fds0 || g1 > g0 {
			return fmt.Errorf("%d fds, %d goroutines", fds1, g1)
		}
		return nil
	})
	r.fds, r.goroutines = [2]int{fds0, fds1}, [2]int{g0, g1}
	r.heapKiB = [2]float64{float64(heap0) / 1024, float64(heap1) / 1024}
	r.rssKiB = [2]float64{float64(rss0) / 1024, float64(rss1) / 1024}
	r.leakedFDs, r.leakedG = max(fds1-fds0, 0), max(g1-g0, 0)
	return r
}

// TestInPodScaleBench is make bench-pods: INPOD_SCALE_PODS idle pods (default 250, more than
// kubelet's default limit of 110) enrolled on one node, each in its own network namespace
// with its listeners and DNS proxy bound there, then INPOD_SCALE_CYCLES (default 10,000)
// add/delete cycles of one more pod while they stay enrolled. It reports what an idle pod
// costs, the Add-to-ACK latency, and the churn's time per cycle and what it left behind,
// and fails on a leaked fd or goroutine. It runs only with INPOD_SCALE=1 (and root).
func TestInPodScaleBench(t *testing.T) {
	if os.Getenv("INPOD_SCALE") == "" {
		t.Skip("set INPOD_SCALE=1 (make bench-pods) to run the in-pod scale harness")
	}
	netnstest.RequireRoot(t)
	pods := envInt(t, "INPOD_SCALE_PODS", 250)
	cycles := envInt(t, "INPOD_SCALE_CYCLES", 10000)
	nss := make([]*netns.NetNS, pods)
	for i := range nss {
		nss[i] = netnstest.NewAnonymous(t)
	}
	churnNS := netnstest.NewAnonymous(t)
	_, c := startInPodNode(t)
	churn(t, c, churnNS, "warm", 1) // lazily made things count as before

	fds0 := openFDs(t)
	cost := enrollIdle(t, c, nss, "idle-")
	t.Logf("%d idle pods: %v", pods, cost)
	r := churn(t, c, churnNS, "churn", cycles)
	t.Logf("with %d pods enrolled, %v", pods, r)
	if r.leakedFDs > 0 || r.leakedG > 0 {
		t.Errorf("churn leaked %d fds and %d goroutines", r.leakedFDs, r.leakedG)
	}
	deleteAll(t, c, pods, "idle-", fds0)
}

func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}
