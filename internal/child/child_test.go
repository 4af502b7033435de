package child

import (
	"context"
	"errors"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func requireSh(t *testing.T) {
	if _, err := exec.LookPath("sh"); err != nil {
		t.Skip("no sh")
	}
}

// A process that ignores SIGTERM is killed once grace has passed, and Stop says so.
func TestStopKillsAfterGrace(t *testing.T) {
	requireSh(t)
	p, err := Start(Spec{Name: "stubborn", Args: []string{"sh", "-c", `trap "" TERM; echo trapped; while :; do sleep 1; done`}})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.WaitReady(ctx, 10*time.Millisecond, func(context.Context) error {
		if !strings.Contains(p.Output(), "trapped") {
			return errors.New("no trap yet")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	err = p.Stop(200 * time.Millisecond)
	if err == nil || !strings.Contains(err.Error(), "killed") {
		t.Errorf("Stop = %v; want that it was killed", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Stop took %v", d)
	}
	if !p.Exited() {
		t.Error("Stop returned before the process exited")
	}
}

// WaitReady gives up when the process exits, saying how and with its output's end.
func TestWaitReadyReportsExit(t *testing.T) {
	requireSh(t)
	p, err := Start(Spec{Name: "crash", Args: []string{"sh", "-c", "echo panic: boom; exit 3"}, Log: filepath.Join(t.TempDir(), "crash.log")})
	if err != nil {
		t.Fatal(err)
	}
	err = p.WaitReady(context.Background(), 10*time.Millisecond, func(context.Context) error { return errors.New("not yet") })
	if err == nil || !strings.Contains(err.Error(), "exit status 3") || !strings.Contains(err.Error(), "panic: boom") {
		t.Fatalf("WaitReady = %v; want the exit status and the output's last lines", err)
	}
	if err := p.Stop(time.Second); err == nil || !strings.Contains(err.Error(), "exit status 3") {
		t.Errorf("Stop of an exited process = %v; want how it ended", err)
	}
}
