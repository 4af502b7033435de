package main

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/child"
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
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("the go tool is not on PATH; cannot build the ztunnel binary")
	}
	bin := filepath.Join(t.TempDir(), "ztunnel")
	if err := child.BuildZtunnel(context.Background(), "../..", bin, raceBuild); err != nil {
		t.Fatal(err)
	}
	return bin
}

// proc is a child process the test owns: stopped with SIGTERM when the test ends (SIGKILL
// if it has not exited 10s later), its output shown if the test failed.
type proc struct{ *child.Process }

// startProc starts args[0] with exactly env (plus PATH) as its environment.
func startProc(t *testing.T, name string, env []string, args ...string) *proc {
	t.Helper()
	return startProcIn(t, "", name, env, args...)
}

// startProcIn is startProc with workdir as the working directory ("": the test's).
func startProcIn(t *testing.T, workdir, name string, env []string, args ...string) *proc {
	t.Helper()
	c, err := child.Start(child.Spec{Name: name, Args: args, Env: append([]string{"PATH=" + os.Getenv("PATH"), raceEnv}, env...), Dir: workdir})
	if err != nil {
		t.Fatal(err)
	}
	p := &proc{c}
	t.Cleanup(func() {
		err := p.stop()
		if t.Failed() {
			t.Logf("%s exited (%v); its output:\n%s", name, err, p.Output())
		}
	})
	return p
}

// stop sends SIGTERM once and returns the exit error (nil for exit status 0).
func (p *proc) stop() error { return p.Stop(10 * time.Second) }

// waitUntil polls ready until it returns nil, failing t with ready's last error and the
// process's output if the process exits first or within passes.
func (p *proc) waitUntil(t *testing.T, what string, within time.Duration, ready func() error) {
	t.Helper()
	err := testutil.Poll(within, func() error {
		err := ready()
		if err != nil && p.Exited() {
			t.Fatalf("%s: exited (%v), not %s: %v\n%s", p.Name, p.Err(), what, err, p.Output())
		}
		return err
	})
	if err != nil {
		t.Fatalf("%s: not %s within %v: %v\n%s", p.Name, what, within, err, p.Output())
	}
}

// waitOutput waits until the process has written s, as waitUntil does.
func (p *proc) waitOutput(t *testing.T, s string, within time.Duration) {
	t.Helper()
	p.waitUntil(t, "logged "+s, within, func() error {
		if !strings.Contains(p.Output(), s) {
			return errors.New("not in its output yet")
		}
		return nil
	})
}
