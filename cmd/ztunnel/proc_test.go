package main

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/testutil"
)

// raceBuild is set when the tests run with -race (race_on_test.go).
var raceBuild bool

// raceEnv is given to child processes: a race-enabled binary otherwise sleeps 1s at exit.
const raceEnv = "GORACE=atexit_sleep_ms=0"

// buildZtunnel compiles this command into the test's temporary directory, for tests that
// run it as a separate process (its own network namespace, its own threads). go test puts
// $GOROOT/bin first on PATH, so the go tool is found there.
func buildZtunnel(t *testing.T) string {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("the go tool is not on PATH; cannot build the ztunnel binary")
	}
	bin := filepath.Join(t.TempDir(), "ztunnel")
	args := []string{"build", "-tags", buildTags, "-o", bin}
	if raceBuild {
		args = append(args, "-race")
	}
	out, err := exec.Command(goTool, append(args, ".")...).CombinedOutput()
	if err != nil {
		t.Fatalf("go build ./cmd/ztunnel: %v\n%s", err, out)
	}
	return bin
}

// proc is a child process the test owns: stopped with SIGTERM when the test ends (SIGKILL
// if it has not exited 10s later), its output shown if the test failed.
type proc struct {
	name string
	cmd  *exec.Cmd
	out  testutil.SyncBuffer
	done chan struct{} // closed when the process has exited; err is set then
	err  error
	once sync.Once
}

// startProc starts args[0] with exactly env (plus PATH) as its environment.
func startProc(t *testing.T, name string, env []string, args ...string) *proc {
	t.Helper()
	return startProcIn(t, "", name, env, args...)
}

// startProcIn is startProc with workdir as the working directory ("": the test's).
func startProcIn(t *testing.T, workdir, name string, env []string, args ...string) *proc {
	t.Helper()
	p := &proc{name: name, done: make(chan struct{})}
	p.cmd = exec.Command(args[0], args[1:]...)
	p.cmd.Dir = workdir
	p.cmd.Env = append([]string{"PATH=" + os.Getenv("PATH"), raceEnv}, env...)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		close(p.done)
	}()
	t.Cleanup(func() {
		err := p.stop()
		if t.Failed() {
			t.Logf("%s exited (%v); its output:\n%s", name, err, p.out.String())
		}
	})
	return p
}

// stop sends SIGTERM once and returns the exit error (nil for exit status 0).
func (p *proc) stop() error {
	p.once.Do(func() { _ = p.cmd.Process.Signal(syscall.SIGTERM) })
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
		return errors.New("did not exit within 10s of SIGTERM; killed")
	}
	return p.err
}

// waitUntil polls ready until it returns nil, failing t with ready's last error and the
// process's output if the process exits first or within passes.
func (p *proc) waitUntil(t *testing.T, what string, within time.Duration, ready func() error) {
	t.Helper()
	err := testutil.Poll(within, func() error {
		err := ready()
		if err != nil && p.exited() {
			t.Fatalf("%s: exited (%v), not %s: %v\n%s", p.name, p.err, what, err, p.out.String())
		}
		return err
	})
	if err != nil {
		t.Fatalf("%s: not %s within %v: %v\n%s", p.name, what, within, err, p.out.String())
	}
}

// waitOutput waits until the process has written s, as waitUntil does.
func (p *proc) waitOutput(t *testing.T, s string, within time.Duration) {
	t.Helper()
	p.waitUntil(t, "logged "+s, within, func() error {
		if !strings.Contains(p.out.String(), s) {
			return errors.New("not in its output yet")
		}
		return nil
	})
}

// exited reports whether the process has ended on its own.
func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}
