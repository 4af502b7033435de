package scaletest

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
)

// Idle connections through one node pair: a client opens n connections through node A's
// SOCKS5 listener, HBONE to node B, and node B's dial to a backend on its workload's
// address; each carries one round trip and is then held. What each node grows by per held
// connection (RSS, goroutines, the Go runtime's own accounting), and the time to open and
// to close them all, from the first open to the last node goroutine gone.
//
// TestIdleConns holds SCALE_CONNS connections (default 2000, bounded to catch a 2×
// regression); make bench-conns runs it with 100,000, raising RLIMIT_NOFILE (the test
// holds two fds per connection). With ZTUNNEL_BASE naming a binary, that one runs first,
// in the same run; SCALE_OUT, if set, names a directory for both nodes' heap profiles
// while the connections are held, and SCALE_NODE_ENV adds to both nodes' environment:
// GODEBUG=memprofilerate=1 makes those profiles exact (the default samples one
// allocation per 512 KiB, a handful of samples at 1,000 connections).

// connsTopology is the two workloads: the client on node A, the server on node B.
const connsTopology = `workloads:
  - uid: Kubernetes//v1/Pod/default/client
    name: client
    namespace: default
    serviceAccount: client
    workloadIps: ["%s"]
    protocol: HBONE
    node: node-a
    services: {}
  - uid: Kubernetes//v1/Pod/default/server
    name: server
    namespace: default
    serviceAccount: server
    workloadIps: ["%s"]
    protocol: HBONE
    node: node-b
    services: {}
`

// Per held connection, per node, at most (2000 connections; about twice the figures of
// docs/PERFORMANCE.md, "Idle connections").
const (
	maxGoroutinesPerConn = 2.0
	maxRuntimeKiBPerConn = 14.0 // heap in use + stacks + GC metadata
)

func TestIdleConns(t *testing.T) {
	n := 2000
	if v := os.Getenv("SCALE_CONNS"); v != "" {
		var err error
		if n, err = strconv.Atoi(v); err != nil || n <= 0 {
			t.Fatalf("SCALE_CONNS=%q: want a positive number of connections", v)
		}
	}
	// Each connection is two fds here (client, backend) and one or two in each node.
	need := uint64(2*n + 256)
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	if lim.Cur < need {
		lim.Cur = need
		lim.Max = max(lim.Max, need)
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			t.Skipf("%d connections need %d file descriptors; raising RLIMIT_NOFILE: %v (root with CAP_SYS_RESOURCE, or a higher hard limit)", n, need, err)
		}
	}
	type bin struct{ name, path string }
	bins := []bin{{"gozt", gozt(t)}}
	if base := os.Getenv("ZTUNNEL_BASE"); base != "" {
		bins = append([]bin{{"base", base}}, bins...)
	}
	for _, b := range bins {
		r := holdIdle(t, b.path, n)
		for i, node := range []string{"A (outbound)", "B (inbound)"} {
			d := r.held[i].minus(r.before[i])
			per := func(v int64) float64 { return float64(v) / float64(n) / 1024 }
			t.Logf("%s node %s, %d connections: per connection RSS %.2f KiB (anon %.2f), goroutines %.3f, stacks %.2f KiB, heap in use %.2f KiB, GC metadata %.2f KiB, other runtime %.2f KiB",
				b.name, node, n, per(d.rss), per(d.anon), float64(d.goroutines)/float64(n), per(d.stack), per(d.heapInuse), per(d.gcSys), per(d.otherSys))
			if b.name != "gozt" || n > 5000 {
				continue
			}
			if g := float64(d.goroutines) / float64(n); g > maxGoroutinesPerConn {
				t.Errorf("node %s: %.2f goroutines per idle connection, want at most %.1f", node, g, maxGoroutinesPerConn)
			}
			if kib := per(d.heapInuse + d.stack + d.gcSys); kib > maxRuntimeKiBPerConn {
				t.Errorf("node %s: %.1f KiB of heap, stacks and GC metadata per idle connection, want at most %.1f", node, kib, maxRuntimeKiBPerConn)
			}
		}
		t.Logf("%s: opened %d in %v (%.0f/s), closed in %v", b.name, n, r.open.Round(time.Millisecond),
			float64(n)/r.open.Seconds(), r.close.Round(time.Millisecond))
	}
}

// nodeStats is one node's memory as /proc and its runtime see it.
type nodeStats struct {
	rss, anon                         int64
	goroutines                        int64
	stack, heapInuse, gcSys, otherSys int64 // the runtime's (heap?debug=1 after a GC)
	sys, heapSys, stackSys            int64
}

func (a nodeStats) minus(b nodeStats) nodeStats {
	return nodeStats{
		rss: a.rss - b.rss, anon: a.anon - b.anon, goroutines: a.goroutines - b.goroutines,
		stack: a.stack - b.stack, heapInuse: a.heapInuse - b.heapInuse, gcSys: a.gcSys - b.gcSys,
		otherSys: (a.sys - a.heapSys - a.stackSys - a.gcSys) - (b.sys - b.heapSys - b.stackSys - b.gcSys),
	}
}

// stats reads the node's runtime figures (after a forced GC), then its RSS.
func (n *node) stats(t testing.TB) nodeStats {
	t.Helper()
	var s nodeStats
	s.goroutines = n.goroutines(t)
	resp, err := n.get("http://"+n.ip+":15000/debug/pprof/heap?gc=1&debug=1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	b, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(strings.TrimPrefix(line, "# "), " = ")
		if !ok {
			continue
		}
		first, second, _ := strings.Cut(v, " / ")
		x, _ := strconv.ParseInt(strings.TrimSpace(first), 10, 64)
		y, _ := strconv.ParseInt(strings.TrimSpace(second), 10, 64)
		switch k {
		case "HeapInuse":
			s.heapInuse = x
		case "HeapSys":
			s.heapSys = x
		case "Stack":
			s.stack, s.stackSys = x, y
		case "GCSys":
			s.gcSys = x
		case "Sys":
			s.sys = x
		}
	}
	status := n.status(t)
	s.rss, s.anon = int64(status["VmRSS"]), int64(status["RssAnon"])
	return s
}

// goroutines is the node's goroutine count (the first line of its goroutine profile).
func (n *node) goroutines(t testing.TB) int64 {
	t.Helper()
	resp, err := n.get("http://"+n.ip+":15000/debug/pprof/goroutine?debug=1", time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	line, _ := bufio.NewReader(resp.Body).ReadString('\n')
	v, ok := strings.CutPrefix(strings.TrimSpace(line), "goroutine profile: total ")
	g, err := strconv.ParseInt(v, 10, 64)
	if !ok || err != nil {
		t.Fatalf("%s: goroutine profile starts %q", n.name, line)
	}
	return g
}

type idleResult struct {
	before, held [2]nodeStats
	open, close  time.Duration
}

// holdIdle starts a node pair of bin, opens n connections through it, measures, closes
// them and waits for the nodes to let go.
func holdIdle(t *testing.T, bin string, n int) idleResult {
	// One /24 of loopback addresses of its own: .1 node A, .2 node B, .10 on the clients
	// (a source address per 20,000 connections, and as many backend ports: the
	// ephemeral port range is about 28,000 per address pair).
	net24 := fmt.Sprintf("127.%d.%d.", 100+rand.IntN(100), rand.IntN(250))
	ipA, ipB := net24+"1", net24+"2"
	spread := n/20000 + 1
	dir := t.TempDir()
	topo := filepath.Join(dir, "topology.yaml")
	if err := os.WriteFile(topo, fmt.Appendf(nil, connsTopology, ipA, ipB), 0o644); err != nil {
		t.Fatal(err)
	}
	start := func(name, ip, workload string, extra ...string) *node {
		env := []string{
			"PATH=" + os.Getenv("PATH"),
			"PROXY_MODE=dedicated",
			"PROXY_WORKLOAD_INFO=" + workload,
			"LOCAL_XDS_PATH=" + topo,
			"XDS_ADDRESS=",
			"CA_PROVIDER=builtin", "CA_DIR=" + filepath.Join(dir, "ca"),
			"KERNEL_TLS=false",
		}
		env = append(env, strings.Fields(os.Getenv("SCALE_NODE_ENV"))...)
		for _, p := range []struct{ env, port string }{
			{"ADMIN_ADDR", "15000"}, {"STATS_ADDR", "15020"}, {"READINESS_ADDR", "15021"},
			{"OUTBOUND_ADDR", "15001"}, {"INBOUND_PLAINTEXT_ADDR", "15006"}, {"INBOUND_ADDR", "15008"},
			{"DNS_PROXY_ADDR", "15053"},
		} {
			env = append(env, p.env+"="+ip+":"+p.port)
		}
		nd := launch(t, name, ip, &http.Client{Timeout: time.Minute}, "", []string{bin}, append(env, extra...))
		if _, err := nd.waitReady(time.Minute); err != nil {
			t.Fatal(err)
		}
		return nd
	}
	a := start("node-a", ipA, "default/client/client", "SOCKS5_ADDR="+ipA+":15080")
	b := start("node-b", ipB, "default/server/server", "HBONE_PEER_STREAMS="+strconv.Itoa(2*n+1000))
	defer a.stop()
	defer b.stop()

	be := startBackends(t, ipB, spread)
	defer be.close()
	var dialers []*net.Dialer
	for i := range spread {
		dialers = append(dialers, &net.Dialer{Timeout: 10 * time.Second,
			LocalAddr: &net.TCPAddr{IP: net.ParseIP(net24 + strconv.Itoa(10+i))}})
	}
	socks := ipA + ":15080"
	open := func(i int) (net.Conn, error) {
		c, err := dialers[i%spread].Dial("tcp", socks)
		if err != nil {
			return nil, err
		}
		if err := socksRoundTrip(c, be.addrs[i%spread], uint64(i)); err != nil {
			c.Close()
			return nil, fmt.Errorf("connection %d: %w", i, err)
		}
		return c, nil
	}
	// Warm up: certificates fetched, a pooled HBONE connection, code paged in.
	for i := range 20 {
		c, err := open(i)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
	var r idleResult
	waitSettled(t, []*node{a, b}, nil)
	r.before = [2]nodeStats{a.stats(t), b.stats(t)}

	conns := make([]net.Conn, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	t0 := time.Now()
	for range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= n {
					return
				}
				c, err := open(i)
				if err != nil {
					errs <- err
					next.Store(int64(n)) // stop the others
					return
				}
				conns[i] = c
			}
		}()
	}
	wg.Wait()
	r.open = time.Since(t0)
	close(errs)
	closeAll := func() {
		for _, c := range conns {
			if c != nil {
				c.Close()
			}
		}
		be.closeHeld()
	}
	if err := <-errs; err != nil {
		closeAll()
		t.Fatalf("after %d connections: %v", next.Load(), err)
	}

	// Idle: buffers given back, and each copy parked (a connection parks one to two
	// seconds after its last byte, proxy/idle.go).
	time.Sleep(idleHold())
	r.held = [2]nodeStats{a.stats(t), b.stats(t)}
	if dir := os.Getenv("SCALE_OUT"); dir != "" {
		for _, nd := range []*node{a, b} {
			path := filepath.Join(dir, fmt.Sprintf("conns-%s-%s.pb.gz", filepath.Base(bin), nd.name))
			if err := nd.heapProfile(t.Context(), path); err != nil {
				t.Error(err)
			}
		}
	}
	// Still working after the hold: a node that dropped them saved memory it should not
	// get credit for.
	for i := 0; i < n; i += max(1, n/100) {
		if err := echoOnce(conns[i], uint64(i)); err != nil {
			closeAll()
			t.Fatalf("connection %d after the hold: %v", i, err)
		}
	}

	t0 = time.Now()
	closeAll()
	// The pooled HBONE connections stay (2 goroutines each per end, about n/100 of
	// them) until they idle out.
	pooled := 2 * (2*n/100 + 4)
	waitSettled(t, []*node{a, b}, []int64{r.before[0].goroutines + int64(pooled), r.before[1].goroutines + int64(pooled)})
	r.close = time.Since(t0)
	return r
}

// waitSettled waits until each node's goroutines are back to at most want's figure for
// it (plus 4), or with want nil until two reads a second apart agree.
func waitSettled(t *testing.T, nodes []*node, want []int64) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Minute)
	for i, nd := range nodes {
		for {
			g := nd.goroutines(t)
			if want == nil {
				time.Sleep(time.Second)
				if nd.goroutines(t) == g {
					break
				}
				continue
			}
			if g <= want[i]+4 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d goroutines after 5 minutes, want at most %d", nd.name, g, want[i]+4)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
}

// backends are the server workload's listeners: echo servers whose connections are
// closed by closeHeld as well as by their peer.
type backends struct {
	lns   []net.Listener
	addrs []netip.AddrPort
	wg    sync.WaitGroup
	mu    sync.Mutex
	held  []net.Conn
}

func startBackends(t *testing.T, ip string, k int) *backends {
	be := &backends{}
	for range k {
		ln, err := net.Listen("tcp", ip+":0")
		if err != nil {
			t.Fatal(err)
		}
		be.lns = append(be.lns, ln)
		be.addrs = append(be.addrs, netip.MustParseAddrPort(ln.Addr().String()))
		be.wg.Add(1)
		go be.serve(ln)
	}
	return be
}

func (be *backends) serve(ln net.Listener) {
	defer be.wg.Done()
	var conns sync.WaitGroup
	defer conns.Wait()
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		conns.Add(1)
		be.mu.Lock()
		be.held = append(be.held, c)
		be.mu.Unlock()
		go func() {
			defer conns.Done()
			defer c.Close()
			var b [64]byte
			for {
				n, err := c.Read(b[:])
				if err != nil {
					return
				}
				if _, err := c.Write(b[:n]); err != nil {
					return
				}
			}
		}()
	}
}

// closeHeld closes every connection the backends hold.
func (be *backends) closeHeld() {
	be.mu.Lock()
	held := be.held
	be.held = nil
	be.mu.Unlock()
	for _, c := range held {
		c.Close()
	}
}

func (be *backends) close() {
	for _, ln := range be.lns {
		ln.Close()
	}
	be.wg.Wait()
	be.closeHeld()
}

// socksRoundTrip asks the SOCKS5 proxy on c for dst, then echoes one message.
func socksRoundTrip(c net.Conn, dst netip.AddrPort, v uint64) error {
	c.SetDeadline(time.Now().Add(30 * time.Second))
	defer c.SetDeadline(time.Time{})
	ip := dst.Addr().As4()
	req := append([]byte{5, 1, 0, 5, 1, 0, 1}, ip[:]...)
	req = append(req, byte(dst.Port()>>8), byte(dst.Port()))
	if _, err := c.Write(req); err != nil {
		return err
	}
	var resp [12]byte
	if _, err := io.ReadFull(c, resp[:]); err != nil {
		return fmt.Errorf("socks5 reply: %w", err)
	}
	if resp[3] != 0 {
		return fmt.Errorf("socks5 reply %d", resp[3])
	}
	return echoOnce(c, v)
}

// echoOnce writes 8 bytes and reads them back.
func echoOnce(c net.Conn, v uint64) error {
	var out, in [8]byte
	for i := range out {
		out[i] = byte(v >> (8 * i))
	}
	c.SetDeadline(time.Now().Add(30 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := c.Write(out[:]); err != nil {
		return err
	}
	if _, err := io.ReadFull(c, in[:]); err != nil {
		return err
	}
	if in != out {
		return errors.New("echo differs")
	}
	return nil
}

// idleHold is how long the connections stay idle before they are measured: 3 s, or
// SCALE_IDLE_HOLD (a Go duration), long enough for the runtime to give freed stacks back.
func idleHold() time.Duration {
	if d, err := time.ParseDuration(os.Getenv("SCALE_IDLE_HOLD")); err == nil {
		return d
	}
	return 3 * time.Second
}
