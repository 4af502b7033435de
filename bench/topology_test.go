package bench

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/child"
	"github.com/gozt/gozt/internal/testutil"
)

func TestChildStopKillsItsProcessGroup(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh")
	}
	dir := t.TempDir()
	// A shell that starts a grandchild and waits: stopping the child must stop both, and
	// must not wait for the grandchild's 30 s.
	c, err := startChild("tree", filepath.Join(dir, "tree.log"), nil, dir, "sh", "-c", "sleep 30 & wait")
	if err != nil {
		t.Fatal(err)
	}
	var tree []int
	if err := testutil.Poll(5*time.Second, func() error { // for the shell to fork: nothing to wait on
		if tree = processTree(c.Pid()); len(tree) < 2 {
			return fmt.Errorf("process tree %v; want the shell and its sleep", tree)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	p := &path{name: "tree", children: []*child.Process{c}}
	if err := p.dead(); err != nil {
		t.Fatalf("running path reported dead: %v", err)
	}
	start := time.Now()
	c.Stop(childGrace)
	c.Stop(childGrace) // idempotent
	if d := time.Since(start); d > 10*time.Second {
		t.Errorf("stop took %v", d)
	}
	// Gone, or a zombie waiting for init to reap it; never still running.
	for _, pid := range tree {
		if err := testutil.Poll(5*time.Second, func() error {
			b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
			if err != nil || strings.Contains(string(b), ") Z ") {
				return nil
			}
			return fmt.Errorf("pid %d of the tree still running after stop: %s", pid, b)
		}); err != nil {
			t.Error(err)
		}
	}
}

func TestDeadPathReportsExitAndLog(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh")
	}
	dir := t.TempDir()
	c, err := startChild("crash", filepath.Join(dir, "crash.log"), []string{"ZB_MSG=boom"}, dir, "sh", "-c", "echo panic: $ZB_MSG; exit 3")
	if err != nil {
		t.Fatal(err)
	}
	<-c.Done()
	err = (&path{children: []*child.Process{c}}).dead()
	if err == nil || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "panic: boom") {
		t.Fatalf("dead() = %v; want the exit status and the log's last lines", err)
	}
}

func TestFindRepo(t *testing.T) {
	repo, err := findRepo()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(repo, "bench", "topology.go")); err != nil {
		t.Errorf("repo %s does not hold this package: %v", repo, err)
	}
}

func TestWaitPortsFree(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	time.AfterFunc(300*time.Millisecond, func() { ln.Close() })
	if err := waitPortsFree(context.Background(), []string{addr}); err != nil {
		t.Fatalf("port freed after 300ms: %v", err)
	}
	ln2, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("port taken by someone else meanwhile: %v", err)
	}
	defer ln2.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	if err := waitPortsFree(ctx, []string{addr}); err == nil {
		t.Fatal("a held port was reported free")
	}
}
