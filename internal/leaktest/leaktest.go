// Package leaktest fails a test that leaves goroutines running after it ends.
//
// Tests that start servers call Check(t) first; at cleanup it waits briefly for goroutines
// started during the test to exit and reports the stacks of those that did not.
package leaktest

import (
	"runtime"
	"sort"
	"strings"
	"testing"
	"time"
)

// Check records the goroutines running now and, when t ends, fails t if others are still
// running after a grace period of up to 5 seconds.
func Check(t testing.TB) {
	t.Helper()
	before := snapshot()
	t.Cleanup(func() {
		deadline := time.Now().Add(5 * time.Second)
		var leaked []string
		for {
			leaked = leaked[:0]
			for id, stack := range snapshot() {
				if _, ok := before[id]; !ok && !ignorable(stack) {
					leaked = append(leaked, stack)
				}
			}
			if len(leaked) == 0 || time.Now().After(deadline) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if len(leaked) > 0 {
			sort.Strings(leaked)
			t.Errorf("leaktest: %d goroutine(s) still running after the test:\n\n%s", len(leaked), strings.Join(leaked, "\n\n"))
		}
	})
}

// snapshot maps goroutine id ("goroutine 12") to its stack.
func snapshot() map[string]string {
	buf := make([]byte, 1<<20)
	for {
		n := runtime.Stack(buf, true)
		if n < len(buf) {
			buf = buf[:n]
			break
		}
		buf = make([]byte, 2*len(buf))
	}
	out := make(map[string]string)
	for _, g := range strings.Split(string(buf), "\n\n") {
		id, _, _ := strings.Cut(g, " [")
		out[id] = g
	}
	return out
}

// ignorable reports goroutines owned by the runtime or the test framework, not by the code
// under test.
func ignorable(stack string) bool {
	for _, s := range []string{
		"testing.(*T).Run",
		"testing.(*M).",
		"testing.tRunner.func1",
		"signal.signal_recv",
		"created by os/signal.Notify",
		"runtime.ensureSigM",
		"testing.runFuzzing",
		"testing.(*F).Fuzz",
		"net/http.(*persistConn).", // idle keep-alive conns of http.DefaultTransport in tests
		"internal/poll.runtime_pollWait\nnet/http.(*persistConn)",
	} {
		if strings.Contains(stack, s) && !strings.Contains(stack, "gozt/") {
			return true
		}
	}
	return strings.Contains(stack, "created by testing.(*T).Run") && strings.Contains(stack, "testing.tRunner")
}
