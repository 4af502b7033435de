//go:build linux

package main

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/inpod/zdspb"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/testutil"
)

// startInPodNode runs an in-process node in in-pod mode whose pods' listeners are on their
// default ports, DNS included, connected to a fake agent it returns.
func startInPodNode(tb testing.TB) (*node, *inpodtest.AgentConn) {
	tb.Helper()
	agent := inpodtest.NewAgent(tb, inpodtest.SocketPath(tb))
	n, _ := startNode(tb, testConfig(tb, map[string]string{
		"PROXY_MODE": "shared", "INPOD_UDS": agent.Path,
		"OUTBOUND_ADDR": "[::]:15001", "INBOUND_PLAINTEXT_ADDR": "[::]:15006", "INBOUND_ADDR": "[::]:15008",
		"DNS_PROXY_ADDR": "localhost:15053",
	}))
	c := agent.Accept()
	if nack := c.Send(inpodtest.SnapshotReq()); nack != "" {
		tb.Fatalf("snapshot: NACK %q", nack)
	}
	return n, c
}

// openFDs counts this process's open file descriptors.
func openFDs(tb testing.TB) int {
	tb.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Fatal(err)
	}
	return len(ents) - 1 // ReadDir's own
}

// TestNetnsInPodChurn adds and deletes one pod 500 times through the real per-pod proxies
// (listeners in the pod's netns, DNS included): afterwards the process has as many fds and
// goroutines as before the first cycle.
func TestNetnsInPodChurn(t *testing.T) {
	netnstest.RequireRoot(t)
	leaktest.Check(t)
	pod := netnstest.NewAnonymous(t)
	n, c := startInPodNode(t)
	info := &zdspb.WorkloadInfo{Name: "churn", Namespace: "default", ServiceAccount: "default"}
	cycle := func(i int) {
		t.Helper()
		if nack := c.AddPod("uid-churn", info, pod); nack != "" {
			t.Fatalf("cycle %d: add: NACK %q", i, nack)
		}
		if nack := c.Send(inpodtest.DelReq("uid-churn")); nack != "" {
			t.Fatalf("cycle %d: del: NACK %q", i, nack)
		}
	}
	settle := func() (fds, goroutines int) {
		// The last pod's shutdown has finished once it has closed its netns fd; the test
		// keeps its own.
		testutil.Eventually(t, "the pod's netns released", func() bool { return idFDs(t, pod.ID()) == 1 })
		// Its goroutines exit just after: nothing to wait on for that, so let them go before
		// counting (pods.wait would be, but it races the next cycle's Start under -race, the
		// agent's socket being no happens-before edge). The loop below polls the final count.
		time.Sleep(50 * time.Millisecond)
		return openFDs(t), runtime.NumGoroutine()
	}
	cycle(0) // lazily made things (a thread per setns, the DNS upstream list) count as baseline
	fds0, g0 := settle()
	const cycles = 500
	start := time.Now()
	for i := 1; i <= cycles; i++ {
		cycle(i)
	}
	elapsed := time.Since(start)
	if st := n.inpod.Stats(); st.Active != 0 || st.Started != cycles+1 || st.Stopped != cycles+1 {
		t.Errorf("stats %+v; want none active, %d started and stopped", st, cycles+1)
	}
	var fds, g int
	_ = testutil.Poll(5*time.Second, func() error { // judged below
		if fds, g = settle(); fds > fds0 || g > g0 {
			return errors.New("not back to the baseline")
		}
		return nil
	})
	if fds > fds0 {
		t.Errorf("%d fds after %d cycles; want the %d of the baseline\n%s", fds, cycles, fds0, fdTargets(t))
	}
	if g > g0 {
		t.Errorf("%d goroutines after %d cycles; want the %d of the baseline", g, cycles, g0)
	}
	t.Logf("%d add/delete cycles in %v (%v each): %d fds, %d goroutines, as before", cycles, elapsed.Round(time.Millisecond), (elapsed / cycles).Round(time.Microsecond), fds, g)
}

// fdTargets lists what this process's fds refer to, for a failure message.
func fdTargets(tb testing.TB) string {
	ents, _ := os.ReadDir("/proc/self/fd")
	count := map[string]int{}
	for _, e := range ents {
		target, _ := os.Readlink("/proc/self/fd/" + e.Name())
		kind, _, _ := strings.Cut(target, "[")
		count[kind]++
	}
	var lines []string
	for k, v := range count {
		lines = append(lines, fmt.Sprintf("%5d %s", v, k))
	}
	slices.Sort(lines)
	return strings.Join(lines, "\n")
}

// BenchmarkEnroll enrolls 200 idle pods (each its own network namespace, without rules) on
// one node: each iteration adds them one by one, as the node agent does, and deletes them
// again. It reports the latency from sending Add to reading its ACK (the pod's listeners,
// DNS included, are bound in its netns by then), and what each enrolled pod costs: Go heap
// plus goroutine stacks (KiB/pod), the process's RSS, goroutines. Goals: ACK p99 under
// 50 ms, under 64 KiB per idle pod.
func BenchmarkEnroll(b *testing.B) {
	netnstest.RequireRoot(b)
	const pods = 200
	nss := make([]*netns.NetNS, pods)
	for i := range nss {
		nss[i] = netnstest.NewAnonymous(b)
	}
	n, c := startInPodNode(b)
	var acks []time.Duration
	// Per pod, the largest of any iteration: the first, on a fresh node, since later ones
	// reuse the memory and pages the earlier ones freed.
	var heap, rss, goroutines float64
	b.ResetTimer()
	for range b.N {
		heap0, rss0 := memory(b)
		fds0, g0 := openFDs(b), runtime.NumGoroutine()
		for i, ns := range nss {
			fd := inpodtest.NSFD(b, ns)
			start := time.Now()
			if nack := c.Send(inpodtest.AddReq(strconv.Itoa(i)), fd); nack != "" {
				b.Fatalf("add %d: NACK %q", i, nack)
			}
			acks = append(acks, time.Since(start))
		}
		heap1, rss1 := memory(b)
		heap = max(heap, (float64(heap1)-float64(heap0))/pods)
		rss = max(rss, (float64(rss1)-float64(rss0))/pods)
		goroutines = max(goroutines, float64(runtime.NumGoroutine()-g0)/pods)
		b.StopTimer()
		for i := range nss {
			if nack := c.Send(inpodtest.DelReq(strconv.Itoa(i))); nack != "" {
				b.Fatalf("del %d: NACK %q", i, nack)
			}
		}
		testutil.Eventually(b, "every pod's sockets and netns released", func() bool { return openFDs(b) <= fds0 })
		b.StartTimer()
	}
	b.StopTimer()
	if st := n.inpod.Stats(); st.Started != uint64(pods*b.N) {
		b.Errorf("%d pod proxies started; want %d", st.Started, pods*b.N)
	}
	slices.Sort(acks)
	pct := func(p float64) float64 { return float64(acks[int(p*float64(len(acks)-1))]) / float64(time.Millisecond) }
	b.ReportMetric(pct(0.50), "ack-p50-ms")
	b.ReportMetric(pct(0.99), "ack-p99-ms")
	b.ReportMetric(heap/1024, "KiB/pod")
	b.ReportMetric(rss/1024, "rss-KiB/pod")
	b.ReportMetric(goroutines, "goroutines/pod")
	b.ReportMetric(0, "ns/op") // one op is 200 pods; the metrics above say what matters
}

// memory returns, after a GC, the Go heap in use plus goroutine stacks, and the RSS.
func memory(tb testing.TB) (heap, rss uint64) {
	tb.Helper()
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	b, err := os.ReadFile("/proc/self/statm")
	if err != nil {
		tb.Fatal(err)
	}
	f := strings.Fields(string(b))
	pages, _ := strconv.ParseUint(f[1], 10, 64)
	return ms.HeapAlloc + ms.StackInuse, pages * uint64(os.Getpagesize())
}
