package bench

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

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

// A loop ends by itself once the process that started it is gone, even killed: zbench's
// loops must not spin on after a SIGKILL.
func TestSpinEndsWithParent(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "loop.pid")
	// The parent shell starts the loop in the background, says its PID, and waits.
	parent := exec.Command("/bin/sh", "-c", "/bin/sh -c '"+spinWhileParentLives+"' & echo $! >"+pidFile+"; sleep 60")
	if err := parent.Start(); err != nil {
		t.Fatal(err)
	}
	var loop int
	for deadline := time.Now().Add(5 * time.Second); loop == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			parent.Process.Kill()
			parent.Wait()
			t.Fatal("the loop's PID never appeared")
		}
		b, _ := os.ReadFile(pidFile)
		loop, _ = strconv.Atoi(strings.TrimSpace(string(b)))
	}
	time.Sleep(100 * time.Millisecond)
	if state := procState(loop); state != "R" && state != "S" {
		t.Fatalf("loop %d in state %q before its parent died, want running", loop, state)
	}
	parent.Process.Kill()
	parent.Wait()
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		state := procState(loop) // "" once reaped, "Z" once ended and not yet reaped by init
		if state == "" || state == "Z" {
			return
		}
		if time.Now().After(deadline) {
			syscall.Kill(loop, syscall.SIGKILL)
			t.Fatalf("loop %d still in state %q 5 s after its parent was killed", loop, state)
		}
	}
}

// procState is the state letter of process pid (R, S, Z, ...), or "" when there is none.
func procState(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "State:"); ok {
			if f := strings.Fields(v); len(f) > 0 {
				return f[0]
			}
		}
	}
	return ""
}
