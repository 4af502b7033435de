package scaletest

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/child"
)

var (
	buildOnce sync.Once
	buildDir  string
	builtBin  string
	buildErr  error
)

// TestMain removes the binary gozt built (20 MB a run). Started as a probe's child (see
// probe), it probes instead of testing.
func TestMain(m *testing.M) {
	if job := os.Getenv(probeEnv); job != "" {
		if err := runProbeChild(job); err != nil {
			fmt.Fprintln(os.Stderr, "probe:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// gozt builds ./cmd/ztunnel as make build does (static, without gRPC's x/net/trace) once
// per test binary.
func gozt(t testing.TB) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "scaletest-")
		if err != nil {
			buildErr = err
			return
		}
		buildDir = dir
		builtBin = filepath.Join(dir, "ztunnel")
		buildErr = child.BuildZtunnel(context.Background(), "../..", builtBin, false)
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return builtBin
}

// node is one ztunnel process the test owns: killed at cleanup, its log shown on failure.
type node struct {
	name  string
	ip    string       // the node's listeners' address
	http  *http.Client // reaches ip (inside the node's namespace for the Rust ztunnel)
	start time.Time
	*child.Process
	// cpuSeen is the node's CPU time at each of waitReady's polls, for the CPU it spent
	// after a given moment (cpuSince): a server that takes 18 s to send its first byte
	// leaves the node idle that long, serving the probes.
	cpuSeen []cpuAt
}

type cpuAt struct {
	at  time.Time
	cpu time.Duration
}

// startNode starts bin as a dedicated-mode node of the mesh's first workload, fed by the
// ADS server at ads, every listener on a loopback address of its own (other tests and
// engineers use 127.0.0.1's ztunnel ports).
func startNode(t testing.TB, name, bin, ads string, extra ...string) *node {
	t.Helper()
	ip := fmt.Sprintf("127.%d.%d.%d", 100+rand.IntN(100), rand.IntN(250), 1+rand.IntN(250))
	env := []string{
		"PATH=" + os.Getenv("PATH"),
		"PROXY_MODE=dedicated",
		"PROXY_WORKLOAD_INFO=" + ns0Workload,
		"XDS_ADDRESS=http://" + ads,
		"CA_PROVIDER=builtin", "CA_DIR=" + filepath.Join(t.TempDir(), "ca"),
		"SOCKS5_ADDR=" + ip + ":15080", // the probe's way in
		"RUST_LOG=warn",
	}
	for _, p := range []struct{ env, port string }{
		{"ADMIN_ADDR", "15000"}, {"STATS_ADDR", "15020"}, {"READINESS_ADDR", "15021"},
		{"OUTBOUND_ADDR", "15001"}, {"INBOUND_PLAINTEXT_ADDR", "15006"}, {"INBOUND_ADDR", "15008"},
		{"DNS_PROXY_ADDR", "15053"},
	} {
		env = append(env, p.env+"="+ip+":"+p.port)
	}
	return launch(t, name, ip, &http.Client{Timeout: 10 * time.Minute}, "", []string{bin}, append(env, extra...))
}

// launch starts args in dir with exactly env as its environment.
func launch(t testing.TB, name, ip string, hc *http.Client, dir string, args, env []string) *node {
	t.Helper()
	n := &node{name: name, ip: ip, http: hc, start: time.Now()}
	var err error
	n.Process, err = child.Start(child.Spec{Name: name, Args: args, Env: env, Dir: dir, Log: filepath.Join(t.TempDir(), "node.log")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		n.stop()
		if t.Failed() {
			b := n.Output()
			if len(b) > 8<<10 {
				b = b[len(b)-8<<10:]
			}
			t.Logf("%s log (tail):\n%s", n.name, b)
		}
	})
	return n
}

// stop kills the node: what it would do on SIGTERM is not measured.
func (n *node) stop() { n.Stop(0) }

// waitReady polls /healthz/ready every 5 ms until it answers 200 and returns when it did;
// it gives up early when the node says it refused a message as too large.
func (n *node) waitReady(within time.Duration) (time.Time, error) {
	url := "http://" + n.ip + ":15021/healthz/ready"
	deadline := time.Now().Add(within)
	var last string
	for time.Now().Before(deadline) {
		select {
		case <-n.Done():
			return time.Time{}, fmt.Errorf("%s exited before ready", n.name)
		default:
		}
		if cpu, err := n.cpuTime(); err == nil {
			n.cpuSeen = append(n.cpuSeen, cpuAt{time.Now(), cpu})
		}
		if resp, err := n.get(url, time.Second); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == 200 {
				return time.Now(), nil
			}
			last = string(b)
			if strings.Contains(last, "larger than max") {
				return time.Time{}, fmt.Errorf("%s refused the push: %s", n.name, strings.TrimSpace(last))
			}
		} else {
			last = err.Error()
		}
		time.Sleep(5 * time.Millisecond)
	}
	return time.Time{}, fmt.Errorf("%s not ready within %v: %s", n.name, within, last)
}

// proc is what /proc says of a process.
type proc struct {
	cpu       time.Duration // user + system
	rss, peak uint64        // VmRSS, VmHWM in bytes
}

func (n *node) proc(t testing.TB) proc {
	t.Helper()
	var p proc
	var err error
	if p.cpu, err = n.cpuTime(); err != nil {
		t.Fatal(err)
	}
	status := n.status(t)
	p.rss, p.peak = status["VmRSS"], status["VmHWM"]
	return p
}

// cpuTime is the node's user and system CPU time so far.
func (n *node) cpuTime() (time.Duration, error) {
	stat, err := os.ReadFile("/proc/" + strconv.Itoa(n.Pid()) + "/stat")
	if err != nil {
		return 0, err
	}
	// Fields after the command's closing parenthesis: state is field 3, utime 14, stime 15.
	f := strings.Fields(string(stat[bytes.LastIndexByte(stat, ')')+2:]))
	ut, _ := strconv.ParseUint(f[11], 10, 64)
	st, _ := strconv.ParseUint(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond, nil // USER_HZ is 100 on Linux
}

// cpuSince is the CPU the node spent from the last of waitReady's polls before from (its
// start if none) to cpu.
func (n *node) cpuSince(from time.Time, cpu time.Duration) time.Duration {
	var before time.Duration
	for _, s := range n.cpuSeen {
		if s.at.After(from) {
			break
		}
		before = s.cpu
	}
	return cpu - before
}

// status is the node's /proc/PID/status sizes (the lines in kB), in bytes by name.
func (n *node) status(t testing.TB) map[string]uint64 {
	status, err := os.ReadFile("/proc/" + strconv.Itoa(n.Pid()) + "/status")
	if err != nil {
		t.Fatal(err)
	}
	sizes := make(map[string]uint64)
	for _, line := range strings.Split(string(status), "\n") {
		k, v, _ := strings.Cut(line, ":")
		if kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64); err == nil && strings.HasSuffix(v, " kB") {
			sizes[k] = kb << 10
		}
	}
	return sizes
}

// heapProfile saves the node's /debug/pprof/heap (taken after a GC) to path.
func (n *node) heapProfile(ctx context.Context, path string) error {
	req, err := http.NewRequestWithContext(ctx, "GET", "http://"+n.ip+":15000/debug/pprof/heap?gc=1", nil)
	if err != nil {
		return err
	}
	resp, err := n.http.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		return fmt.Errorf("heap profile: %s", resp.Status)
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	return os.WriteFile(path, b, 0o644)
}

// cpuProfile saves a CPU profile of the node from as soon as its admin server answers until
// it is ready (the profile ends then, or after 60 s) to path.
func (n *node) cpuProfile(path string, within time.Duration) {
	deadline := time.Now().Add(within)
	for time.Now().Before(deadline) {
		select {
		case <-n.Done():
			return
		default:
		}
		resp, err := n.get("http://"+n.ip+":15000/debug/pprof/profile?seconds=60", 90*time.Second)
		if err != nil {
			time.Sleep(2 * time.Millisecond)
			continue
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err == nil && resp.StatusCode == 200 {
			_ = os.WriteFile(path, b, 0o644)
		}
		return
	}
}

// perfRecord starts perf record of the whole machine (call graphs by frame pointer, which
// Go keeps), writing path; stop ends it and waits. Unlike the runtime's profile it sees the
// kernel's side: page faults, the memory the VM backs. It records every CPU rather than the
// node's pid: attached by pid, it caught as little as a third of the node's CPU time when
// the node waited long for its first push (read it with perf report --comm ztunnel).
func (n *node) perfRecord(path string) (stop func() error, err error) {
	cmd := exec.Command("perf", "record", "-q", "-F", "499", "-g", "-a", "-o", path)
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	return func() error {
		_ = cmd.Process.Signal(os.Interrupt)
		err := cmd.Wait()
		if ee, ok := err.(*exec.ExitError); ok && !ee.Exited() {
			err = nil // perf writes its file, then ends by the signal it was sent
		}
		return err
	}, nil
}

// saveProfile saves the node's /debug/pprof/<kind>?seconds=N (profile or trace) to path.
func (n *node) saveProfile(kind string, seconds int, path string) error {
	resp, err := n.get(fmt.Sprintf("http://%s:15000/debug/pprof/%s?seconds=%d", n.ip, kind, seconds), time.Duration(seconds)*time.Second+time.Minute)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return err
	}
	if resp.StatusCode != 200 {
		return fmt.Errorf("%s: %s", kind, resp.Status)
	}
	return os.WriteFile(path, b, 0o644)
}

// liveHeap is the node's heap after a forced GC (HeapAlloc from /debug/pprof/heap?debug=1):
// unlike RSS it does not depend on when the collector last ran or the scavenger released.
func (n *node) liveHeap() (uint64, error) {
	resp, err := n.get("http://"+n.ip+":15000/debug/pprof/heap?gc=1&debug=1", 5*time.Minute) // a forced GC of a 1M heap on a loaded machine took over one
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "# HeapAlloc = "); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, errors.New("no HeapAlloc in the heap profile")
}

func (n *node) get(url string, timeout time.Duration) (*http.Response, error) {
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	req, err := http.NewRequestWithContext(ctx, "GET", url, nil)
	if err != nil {
		cancel()
		return nil, err
	}
	resp, err := n.http.Do(req)
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = cancelOnClose{resp.Body, cancel}
	return resp, nil
}

type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c cancelOnClose) Close() error { err := c.ReadCloser.Close(); c.cancel(); return err }
