//go:build linux

package main

import (
	"fmt"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/inpod/inpodtest"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
)

// startInPodNode runs an in-process node in in-pod mode whose pods' listeners are on their
// default ports, DNS included, connected to a fake agent it returns.
func startInPodNode(tb testing.TB) (*ztunnel, *inpodtest.AgentConn) {
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
// goroutines as before the first cycle, and its live heap has not grown by more than a few
// idle pods' worth. make bench-pods runs 10,000 cycles beside 250 enrolled pods.
func TestNetnsInPodChurn(t *testing.T) {
	netnstest.RequireRoot(t)
	leaktest.Check(t)
	pod := netnstest.NewAnonymous(t)
	n, c := startInPodNode(t)
	const cycles = 500
	r := churn(t, c, pod, "uid-churn", cycles)
	if st := n.inpod.Stats(); st.Active != 0 || st.Started != cycles+1 || st.Stopped != cycles+1 {
		t.Errorf("stats %+v; want none active, %d started and stopped", st, cycles+1)
	}
	if r.leakedFDs > 0 {
		t.Errorf("%d fds after %d cycles; want the %d of the baseline\n%s", r.fds[1], cycles, r.fds[0], fdTargets(t))
	}
	if r.leakedG > 0 {
		t.Errorf("%d goroutines after %d cycles; want the %d of the baseline", r.goroutines[1], cycles, r.goroutines[0])
	}
	// A stopped pod's every allocation is garbage. Four idle pods' worth catches a leak of
	// 160 bytes per cycle.
	if grown := r.heapKiB[1] - r.heapKiB[0]; grown > 4*idlePodKiB {
		t.Errorf("live heap grew %.0f KiB over %d cycles; want under %d", grown, cycles, 4*idlePodKiB)
	}
	t.Log(r)
}

// Today's cost of an idle in-pod pod (heap plus stacks, without the race detector, which
// grows both) and its goroutines: TestInPodIdlePodCost fails at twice either.
const (
	idlePodKiB        = 19
	idlePodGoroutines = 2
)

// TestInPodIdlePodCost enrolls 50 idle pods and bounds what each costs: it fails when KiB
// (heap plus goroutine stacks) or goroutines per pod reach twice today's figures. The
// memory bound holds only without the race detector (make test-norace runs it).
func TestInPodIdlePodCost(t *testing.T) {
	netnstest.RequireRoot(t)
	leaktest.Check(t)
	const pods = 50
	nss := make([]*netns.NetNS, pods)
	for i := range nss {
		nss[i] = netnstest.NewAnonymous(t)
	}
	_, c := startInPodNode(t)
	churn(t, c, netnstest.NewAnonymous(t), "warm", 1) // lazily made things count as before
	fds0 := openFDs(t)
	cost := enrollIdle(t, c, nss, "idle-")
	t.Logf("%d idle pods: %v", pods, cost)
	if cost.goroutines >= 2*idlePodGoroutines {
		t.Errorf("%.2f goroutines per idle pod; want under %d (today %d)", cost.goroutines, 2*idlePodGoroutines, idlePodGoroutines)
	}
	if raceBuild {
		t.Log("memory per pod not checked under the race detector")
	} else if cost.kib >= 2*idlePodKiB {
		t.Errorf("%.1f KiB per idle pod; want under %d (today %d)", cost.kib, 2*idlePodKiB, idlePodKiB)
	}
	deleteAll(t, c, pods, "idle-", fds0)
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
// 50 ms, at most 32 KiB and 4 goroutines per idle pod.
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
	var worst idleCost
	b.ResetTimer()
	for range b.N {
		fds0 := openFDs(b)
		cost := enrollIdle(b, c, nss, "")
		acks = append(acks, cost.acks...)
		worst.kib, worst.rssKiB = max(worst.kib, cost.kib), max(worst.rssKiB, cost.rssKiB)
		worst.goroutines = max(worst.goroutines, cost.goroutines)
		b.StopTimer()
		deleteAll(b, c, pods, "", fds0)
		b.StartTimer()
	}
	b.StopTimer()
	if st := n.inpod.Stats(); st.Started != uint64(pods*b.N) {
		b.Errorf("%d pod proxies started; want %d", st.Started, pods*b.N)
	}
	slices.Sort(acks)
	worst.acks = acks
	b.ReportMetric(float64(worst.ack(0.50))/float64(time.Millisecond), "ack-p50-ms")
	b.ReportMetric(float64(worst.ack(0.99))/float64(time.Millisecond), "ack-p99-ms")
	b.ReportMetric(worst.kib, "KiB/pod")
	b.ReportMetric(worst.rssKiB, "rss-KiB/pod")
	b.ReportMetric(worst.goroutines, "goroutines/pod")
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
