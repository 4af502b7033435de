package bench

import (
	"runtime"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/gozt/gozt/internal/leaktest"
)

// keepAwake starts one loop per CPU, each under SCHED_IDLE (so it never takes a CPU from
// the paths), and stopping them leaves no process behind.
func TestKeepAwake(t *testing.T) {
	leaktest.Check(t)
	loops, err := keepAwake(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer stopAll(loops)
	if len(loops) != runtime.NumCPU() {
		t.Fatalf("%d loops for %d CPUs", len(loops), runtime.NumCPU())
	}
	for _, c := range loops {
		attr, err := unix.SchedGetAttr(c.pid(), 0)
		if err != nil {
			t.Fatal(err)
		}
		if attr.Policy != unix.SCHED_IDLE {
			t.Errorf("loop %d runs under policy %d, want SCHED_IDLE (%d)", c.pid(), attr.Policy, unix.SCHED_IDLE)
		}
	}
	stopAll(loops)
	for _, c := range loops {
		if err := syscall.Kill(c.pid(), 0); err != syscall.ESRCH {
			t.Errorf("loop %d still exists after stop (kill 0: %v)", c.pid(), err)
		}
	}
}
