// Package child starts and stops the processes that tests and benchmarks run beside
// themselves: a ztunnel built from this tree, the Rust ztunnel, a peer. It builds the
// ztunnel binary as make build does, starts a process with its output kept (a log file or
// memory), waits for it to become ready, and stops it with SIGTERM and a deadline. The
// callers decide the environment, the namespace (ip netns exec) and what ready means.
// Nothing in the node links it.
package child

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

// BuildZtunnel builds ./cmd/ztunnel of the module at repo into out as make build does:
// static (CGO_ENABLED=0) and without gRPC's x/net/trace (see the Makefile); with -race
// if race, which needs cgo. env adds to the go tool's environment (GOFIPS140=v1.0.0, say).
func BuildZtunnel(ctx context.Context, repo, out string, race bool, env ...string) error {
	args := []string{"build", "-tags", "grpcnotrace", "-o", out}
	if race {
		args = append(args, "-race")
	}
	build := exec.CommandContext(ctx, "go", append(args, "./cmd/ztunnel")...)
	build.Dir = repo
	build.Env = os.Environ()
	if !race { // -race needs cgo
		build.Env = append(build.Env, "CGO_ENABLED=0")
	}
	build.Env = append(build.Env, env...)
	if b, err := build.CombinedOutput(); err != nil {
		return fmt.Errorf("go build ./cmd/ztunnel: %w\n%s", err, b)
	}
	return nil
}

// Spec is a process to start.
type Spec struct {
	Name string   // what logs and errors call it
	Args []string // its command line, the program first
	Env  []string // its whole environment
	Dir  string   // its working directory ("": this process's)
	Log  string   // the file its output goes to; "": kept in memory (Output)
	// Group starts it in a process group of its own, which Stop signals: a process that
	// starts others (a shell, nginx) is stopped whole.
	Group bool
}

// Process is a started process. Its fields are set once by Start; done and err by the
// goroutine that waits for it.
type Process struct {
	Name string
	cmd  *exec.Cmd
	log  string
	mem  syncBuffer
	done chan struct{} // closed once the process has exited and err is set
	err  error
	term sync.Once // SIGTERM is sent once
}

// Start starts the process s describes.
func Start(s Spec) (*Process, error) {
	p := &Process{Name: s.Name, log: s.Log, done: make(chan struct{})}
	p.cmd = exec.Command(s.Args[0], s.Args[1:]...)
	p.cmd.Dir, p.cmd.Env = s.Dir, s.Env
	var logf *os.File
	if s.Log != "" {
		f, err := os.Create(s.Log)
		if err != nil {
			return nil, fmt.Errorf("%s log: %w", s.Name, err)
		}
		logf = f
		p.cmd.Stdout, p.cmd.Stderr = f, f
	} else {
		p.cmd.Stdout, p.cmd.Stderr = &p.mem, &p.mem
	}
	if s.Group {
		p.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	}
	if err := p.cmd.Start(); err != nil {
		if logf != nil {
			logf.Close()
		}
		return nil, fmt.Errorf("start %s: %w", s.Name, err)
	}
	go func() {
		p.err = p.cmd.Wait()
		if logf != nil {
			logf.Close()
		}
		close(p.done)
	}()
	return p, nil
}

// Pid is the process's id.
func (p *Process) Pid() int { return p.cmd.Process.Pid }

// Signal sends sig to the process (not its group).
func (p *Process) Signal(sig os.Signal) error { return p.cmd.Process.Signal(sig) }

// Done is closed once the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Err is how the process ended (exec.Cmd.Wait's error), once Done is closed.
func (p *Process) Err() error { return p.err }

// Exited reports whether the process has ended.
func (p *Process) Exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Output is everything the process has written so far.
func (p *Process) Output() string {
	if p.log == "" {
		return p.mem.String()
	}
	b, _ := os.ReadFile(p.log)
	return string(b)
}

// Tail is the last n lines of the output, indented.
func (p *Process) Tail(n int) string {
	lines := strings.Split(strings.TrimRight(p.Output(), "\n"), "\n")
	return "    " + strings.Join(lines[max(0, len(lines)-n):], "\n    ")
}

// Stop sends SIGTERM (to the group, if it has one) and waits for the process to exit; past
// grace it sends SIGKILL, and with grace 0 it sends only SIGKILL. It returns how the
// process ended, or that it was killed after grace; calling it again waits again.
func (p *Process) Stop(grace time.Duration) error {
	if p.Exited() {
		return p.err
	}
	if grace > 0 {
		p.term.Do(func() { p.kill(syscall.SIGTERM) })
		select {
		case <-p.done:
			return p.err
		case <-time.After(grace):
		}
	}
	p.kill(syscall.SIGKILL)
	<-p.done
	if grace > 0 {
		return fmt.Errorf("%s did not exit within %v of SIGTERM; killed", p.Name, grace)
	}
	return p.err
}

func (p *Process) kill(sig syscall.Signal) {
	if p.cmd.SysProcAttr != nil && p.cmd.SysProcAttr.Setpgid {
		syscall.Kill(-p.Pid(), sig)
	} else {
		p.cmd.Process.Signal(sig)
	}
}

// WaitReady calls ready every period until it returns nil, the process exits, or ctx ends.
// The error says which, with ready's last error and the output's last lines.
func (p *Process) WaitReady(ctx context.Context, period time.Duration, ready func(context.Context) error) error {
	tick := time.NewTicker(period)
	defer tick.Stop()
	for {
		err := ready(ctx)
		if err == nil {
			return nil
		}
		select {
		case <-p.done:
			return fmt.Errorf("%s exited before it was ready (%v; last: %v); its output ends:\n%s", p.Name, p.err, err, p.Tail(30))
		case <-ctx.Done():
			return fmt.Errorf("%s not ready (%w; last: %v); its output ends:\n%s", p.Name, ctx.Err(), err, p.Tail(30))
		case <-tick.C:
		}
	}
}

// HTTPReady is a readiness check for WaitReady: a GET of url through client answers 200.
// A ztunnel's is http://ADDR:15021/healthz/ready.
func HTTPReady(client *http.Client, url string) func(context.Context) error {
	return func(ctx context.Context) error {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
		if err != nil {
			return err
		}
		resp, err := client.Do(req)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4<<10))
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s: %d %s", url, resp.StatusCode, bytes.TrimSpace(b))
		}
		return nil
	}
}

// syncBuffer is a bytes.Buffer the process's output copier writes while a test reads it.
type syncBuffer struct {
	mu sync.Mutex // guards b
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
