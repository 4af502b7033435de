package bench

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

func TestReadProcSelf(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc on this system")
	}
	before, err := ReadProc(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// Burn CPU until the stat clock (10 ms ticks) shows 50 ms more; on a loaded machine
	// that takes longer than 50 ms of wall time, but it must happen.
	var after ProcStat
	x := 0
	if err := testutil.Poll(10*time.Second, func() (err error) {
		for end := time.Now().Add(10 * time.Millisecond); time.Now().Before(end); {
			x++
		}
		if after, err = ReadProc(os.Getpid()); err != nil {
			t.Fatal(err)
		}
		if after.CPU-before.CPU < 50*time.Millisecond {
			return fmt.Errorf("cpu grew %v over 10s of busy loops; want >= 50ms", after.CPU-before.CPU)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if after.RSS < 1<<20 || after.HWM < after.RSS {
		t.Errorf("rss %d hwm %d; want rss >= 1 MiB and hwm >= rss", after.RSS, after.HWM)
	}
	// 8 MiB touched on the heap must show in the anonymous part, which never exceeds the whole.
	ballast := make([]byte, 8<<20)
	for i := range ballast {
		ballast[i] = byte(i)
	}
	withBallast, err := ReadProc(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if withBallast.Anon < 8<<20 || withBallast.Anon > withBallast.RSS {
		t.Errorf("anon %d of rss %d with 8 MiB of heap touched; want 8 MiB <= anon <= rss", withBallast.Anon, withBallast.RSS)
	}
	runtime.KeepAlive(ballast)
	if after.PPID != os.Getppid() {
		t.Errorf("ppid %d; want %d", after.PPID, os.Getppid())
	}
	if _, err := ReadProc(1 << 30); err == nil {
		t.Error("reading a pid that cannot exist succeeded")
	}
}

func TestProcessTreeFindsChildren(t *testing.T) {
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc on this system")
	}
	sleep, err := exec.LookPath("sleep")
	if err != nil {
		t.Skip("no sleep binary")
	}
	cmd := exec.Command(sleep, "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	tree := processTree(os.Getpid())
	if tree[0] != os.Getpid() || !slices.Contains(tree, cmd.Process.Pid) {
		t.Errorf("tree %v; want self first and child %d in it", tree, cmd.Process.Pid)
	}
}

func TestRunChargesNamedProcess(t *testing.T) {
	leaktest.Check(t)
	if _, err := os.Stat("/proc/self/stat"); err != nil {
		t.Skip("no /proc on this system")
	}
	srv := startServer(t, ModeEcho)
	// This test process is both client and server, so it is the "proxy" whose use is charged.
	res, err := Run(context.Background(), "throughput", Target{Addr: srv.Addr().String()},
		Options{Duration: 300 * time.Millisecond, Procs: []Proc{{Name: "self", PID: os.Getpid()}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Procs) != 1 || res.Procs[0].Name != "self" {
		t.Fatalf("procs %+v; want one named self", res.Procs)
	}
	p := res.Procs[0]
	// At least one 10 ms tick: a loaded machine may give this process little more.
	if p.CPUSeconds < 0.01 || p.PeakRSS < 1<<20 || p.HWM < 1<<20 {
		t.Errorf("usage %+v; want cpu >= 10ms and rss, hwm >= 1 MiB", p)
	}
	if res.CPUPerGB() <= 0 || res.VCPUPer1000RPS() <= 0 {
		t.Errorf("cpu/GB %v vcpu/1000rps %v; want > 0", res.CPUPerGB(), res.VCPUPer1000RPS())
	}
	if _, err := Run(context.Background(), "pingpong", Target{Addr: srv.Addr().String()},
		Options{Count: 1, Procs: []Proc{{Name: "gone", PID: 1 << 30}}}); err == nil {
		t.Error("a missing process was accepted")
	}
}
