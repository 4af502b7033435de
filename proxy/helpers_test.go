package proxy_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds"
	"github.com/gozt/gozt/xds/state"
)

// The two-node topology of examples/two-nodes.yaml: default/client on 127.0.0.2 (node A),
// default/server on 127.0.0.3 (node B), and the echo service VIP 127.10.0.1:80 -> 8080.
const (
	clientPrinc = "cluster.local/ns/default/sa/client"
	serverPrinc = "cluster.local/ns/default/sa/server"
	exampleFile = "../examples/two-nodes.yaml"
)

// subnets are the loopback /24s a mesh may use: .2 client, .3 server, .4 outside the mesh.
// The example's own 127.0.0.x comes first; the others keep the suite running when another
// process on a shared machine (a `make demo`, say) holds 127.0.0.3:15008.
var subnets = []string{"127.0.0.", "127.0.1.", "127.0.2.", "127.0.3."}

// exampleYAML is the shared topology; tests derive variants from it with string edits.
func exampleYAML(tb testing.TB) string {
	tb.Helper()
	b, err := os.ReadFile(exampleFile)
	if err != nil {
		tb.Fatalf("read %s: %v", exampleFile, err)
	}
	return string(b)
}

func parseBatch(tb testing.TB, yaml string) *state.Batch {
	tb.Helper()
	b, err := xds.ParseFile("test.yaml", []byte(yaml))
	if err != nil {
		tb.Fatalf("parse topology: %v", err)
	}
	return b
}

// node is one in-process ztunnel: its own store, certificate manager and metrics registry,
// sharing the CA directory with the other nodes so they trust each other.
type node struct {
	name  string
	proxy *proxy.Proxy
	store *state.Store
	reg   *prometheus.Registry
	certs *certs.Manager

	cancel context.CancelFunc
	served chan struct{}
	once   sync.Once
}

var quiet = slog.New(slog.DiscardHandler)

var _ proxy.CertSource = (*certs.Manager)(nil)

// perSocket, when set (TestPerSocket), makes nodePoller a goroutine per socket.
var perSocket bool

// nodePoller is a test node's poller, as cmd/ztunnel makes one per node: on Linux epoll,
// in which idle connections park; closed when the test ends.
func nodePoller(tb testing.TB) netpoll.Poller {
	tb.Helper()
	if perSocket {
		return netpoll.PerSocket{}
	}
	p, err := netpoll.New()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.Close() })
	return p
}

// startNode binds and serves a proxy; it is shut down at cleanup (or earlier by shutdown).
func startNode(tb testing.TB, name, caDir, yaml string, cfg proxy.Config) *node {
	tb.Helper()
	return startNodeLogged(tb, name, caDir, yaml, cfg, quiet)
}

// startNodeLogged is startNode writing the access log to accessLog.
func startNodeLogged(tb testing.TB, name, caDir, yaml string, cfg proxy.Config, accessLog *slog.Logger) *node {
	tb.Helper()
	return startNodeWith(tb, name, caDir, yaml, cfg, accessLog, nil)
}

// startNodeWith is startNodeLogged with the proxy's certificates coming through wrap, if
// set.
func startNodeWith(tb testing.TB, name, caDir, yaml string, cfg proxy.Config, accessLog *slog.Logger, wrap func(proxy.CertSource) proxy.CertSource) *node {
	tb.Helper()
	builtin, err := ca.NewBuiltin(caDir, time.Hour)
	if err != nil {
		tb.Fatalf("%s: builtin ca: %v", name, err)
	}
	n := &node{name: name, store: state.NewStore(), reg: prometheus.NewRegistry(), served: make(chan struct{})}
	n.store.Apply(parseBatch(tb, yaml))
	n.certs = certs.New(certs.Config{}, builtin)
	m := metrics.New(n.reg, "test", metrics.WithAccessLog(accessLog))
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	wireHBONE(&cfg, m, n.store)
	if cfg.Poller == nil {
		cfg.Poller = nodePoller(tb) // closed after the shutdown below: cleanups run last first
	}
	var source proxy.CertSource = n.certs
	if wrap != nil {
		source = wrap(source)
	}
	n.proxy = proxy.New(cfg, n.store, source, m)
	if err := n.proxy.Listen(); err != nil {
		n.certs.Close()
		if errors.Is(err, syscall.EADDRINUSE) {
			tb.Skipf("%s: %v (needs the address free)", name, err)
		}
		tb.Fatalf("%s: listen: %v", name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	n.cancel = cancel
	go func() {
		defer close(n.served)
		n.proxy.Serve(ctx)
	}()
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		if err := n.shutdown(ctx); err != nil {
			tb.Errorf("%s: shutdown: %v", name, err)
		}
	})
	return n
}

// wireHBONE completes cfg's HBONE configurations as cmd/ztunnel does, keeping what the
// test set itself: the hooks count into m (proxy.HBONEEvents), and the network gateways
// store names are the server's relaying sources.
func wireHBONE(cfg *proxy.Config, m *metrics.Metrics, store *state.Store) {
	if cfg.HBONEServer.Admission.SourceRelays == nil {
		network := cfg.Local.Network
		cfg.HBONEServer.Admission.SourceRelays = func(ip netip.Addr) bool { return store.IsNetworkGateway(network, ip) }
	}
	ev := proxy.NewHBONEEvents(m, cfg.Logger)
	for _, hc := range []*hbone.Config{&cfg.HBONEClient.Config, &cfg.HBONEServer.Config} {
		if hc.OnDrop == nil {
			hc.OnDrop = ev.OnDrop
		}
		if hc.OnTLS == nil {
			hc.OnTLS = ev.OnTLS
		}
		if hc.OnKernelTLSEnd == nil {
			hc.OnKernelTLSEnd = ev.OnKernelTLSEnd
		}
		if hc.OnKeyLimit == nil {
			hc.OnKeyLimit = ev.OnKeyLimit
		}
	}
}

// shutdown drains the proxy until ctx ends, stops Serve and the certificate manager.
// Later calls do nothing.
func (n *node) shutdown(ctx context.Context) error {
	var err error
	n.once.Do(func() {
		err = n.proxy.Shutdown(ctx)
		n.cancel()
		<-n.served
		n.certs.Close()
	})
	return err
}

func (n *node) addr(tb testing.TB, listener string) string {
	tb.Helper()
	a, ok := n.proxy.Addrs()[listener]
	if !ok {
		tb.Fatalf("%s: no %s listener", n.name, listener)
	}
	return a.String()
}

func (n *node) socks(tb testing.TB) string { return n.addr(tb, proxy.ListenerSocks5) }

// mesh is node A (dedicated default/client) and node B (dedicated default/server).
type mesh struct {
	caDir                         string
	yaml                          string // the topology both nodes loaded
	clientIP, serverIP, outsideIP string
	a, b                          *node
}

func (m *mesh) clientConfig() proxy.Config {
	return proxy.Config{
		Local:        state.Local{Mode: state.ModeDedicated, Workload: state.WorkloadRef{Namespace: "default", Name: "client", ServiceAccount: "client"}},
		Socks5Addr:   m.clientIP + ":0",
		InboundAddr:  m.clientIP + ":0",
		OutboundAddr: m.clientIP + ":0",
	}
}

func (m *mesh) serverConfig() proxy.Config {
	return proxy.Config{
		Local: state.Local{Mode: state.ModeDedicated, Workload: state.WorkloadRef{Namespace: "default", Name: "server", ServiceAccount: "server"}},
		// Routes dial podIP:15008, so node B must listen there.
		InboundAddr: m.serverIP + ":15008",
	}
}

// newMesh picks a subnet whose server address has 15008 (and extra ports, e.g. 8080) free
// and the topology moved onto it; it starts nothing.
func newMesh(tb testing.TB, extraServerPorts ...string) *mesh {
	tb.Helper()
	example := exampleYAML(tb)
	for _, sub := range subnets {
		if !free(sub+"3", append([]string{"15008"}, extraServerPorts...)) {
			continue
		}
		m := &mesh{
			caDir:    filepath.Join(tb.TempDir(), "ca"),
			clientIP: sub + "2", serverIP: sub + "3", outsideIP: sub + "4",
		}
		r := strings.NewReplacer("127.0.0.2", m.clientIP, "127.0.0.3", m.serverIP)
		m.yaml = r.Replace(example)
		return m
	}
	tb.Skipf("no loopback subnet of %v has ports 15008 %v free on .3", subnets, extraServerPorts)
	return nil
}

func free(ip string, ports []string) bool {
	for _, p := range ports {
		ln, err := net.Listen("tcp", net.JoinHostPort(ip, p))
		if err != nil {
			return false
		}
		ln.Close()
	}
	return true
}

// start runs node B, then node A.
func (m *mesh) start(tb testing.TB) *mesh {
	tb.Helper()
	m.b = startNode(tb, "node-b", m.caDir, m.yaml, m.serverConfig())
	m.a = startNode(tb, "node-a", m.caDir, m.yaml, m.clientConfig())
	return m
}

func startMesh(tb testing.TB) *mesh { return newMesh(tb).start(tb) }

// checkFDs fails the test if, after every later cleanup has run, the process holds more
// file descriptors than when it was called (with a little slack for the runtime's own).
// Pipes are counted apart: in kernel TLS hbone keeps up to 32 idle splice pipes (two fds
// each) for reuse, as many as were busy at once.
func checkFDs(tb testing.TB) {
	tb.Helper()
	before, pipesBefore := fdCounts(tb)
	tb.Cleanup(func() {
		const slack, pipeSlack = 4, 2 * 32
		err := testutil.Poll(3*time.Second, func() error {
			// Go's splice pipes sit in a sync.Pool and are closed by a finalizer: collect them.
			runtime.GC()
			if now, pipes := fdCounts(tb); now > before+slack || pipes > pipesBefore+pipeSlack+slack {
				return fmt.Errorf("fd leak: %d open file descriptors and %d of pipes before, %d and %d after", before, pipesBefore, now, pipes)
			}
			return nil
		})
		if err != nil {
			tb.Error(err)
			if os.Getenv("FDDEBUG") != "" {
				out, _ := exec.Command("sh", "-c", fmt.Sprintf("ls -l /proc/%d/fd | head -20; cat /proc/net/tcp | awk '{print $2, $3, $4, $10}' | sort | uniq -c | sort -rn | head; ss -tanp | grep -v LISTEN | awk '{print $1, $4, $5}' | sed 's/:[0-9]* / /' | sort | uniq -c | sort -rn | head -20", os.Getpid())).CombinedOutput()
				tb.Logf("%s", out)
			}
		}
	})
}

func fdCount(tb testing.TB) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Skipf("fd check needs /proc/self/fd: %v", err)
	}
	return len(ents)
}

// fdCounts is fdCount with pipes apart: the other file descriptors, and the pipes'.
func fdCounts(tb testing.TB) (others, pipes int) {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		tb.Skipf("fd check needs /proc/self/fd: %v", err)
	}
	for _, e := range ents {
		if l, _ := os.Readlink("/proc/self/fd/" + e.Name()); strings.HasPrefix(l, "pipe:") {
			pipes++
		} else {
			others++
		}
	}
	return others, pipes
}

// --- SOCKS5 client ---

const (
	repSucceeded   = 0
	repNotAllowed  = 2
	repUnreachable = 4
)

// socksConnect dials a SOCKS5 proxy and sends a no-auth CONNECT to host:port (an IP
// literal or a domain name). It returns the connection when the proxy answered success,
// else the reply code and an error.
func socksConnect(proxyAddr, host string, port uint16) (*net.TCPConn, byte, error) {
	return socksConnectFrom("", proxyAddr, host, port)
}

// socksConnectFrom is socksConnect from a given local IP ("" for any): a shared-mode node
// knows its client workload by source address.
func socksConnectFrom(localIP, proxyAddr, host string, port uint16) (*net.TCPConn, byte, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	if localIP != "" {
		d.LocalAddr = &net.TCPAddr{IP: net.ParseIP(localIP)}
	}
	c, err := d.Dial("tcp", proxyAddr)
	if err != nil {
		return nil, 0, err
	}
	tc := c.(*net.TCPConn)
	code, err := socksHandshake(tc, host, port)
	if err != nil || code != repSucceeded {
		tc.Close()
		if err == nil {
			err = fmt.Errorf("socks5: reply %d", code)
		}
		return nil, code, err
	}
	return tc, code, nil
}

func socksHandshake(c net.Conn, host string, port uint16) (byte, error) {
	_ = c.SetDeadline(time.Now().Add(20 * time.Second))
	defer c.SetDeadline(time.Time{})
	req := []byte{5, 1, 0, 5, 1, 0}
	if ip, err := netip.ParseAddr(host); err == nil && ip.Is4() {
		a := ip.As4()
		req = append(req, 1)
		req = append(req, a[:]...)
	} else if err == nil {
		a := ip.As16()
		req = append(req, 4)
		req = append(req, a[:]...)
	} else {
		req = append(req, 3, byte(len(host)))
		req = append(req, host...)
	}
	req = binary.BigEndian.AppendUint16(req, port)
	if _, err := c.Write(req); err != nil {
		return 0, err
	}
	var method [2]byte
	if _, err := io.ReadFull(c, method[:]); err != nil {
		return 0, fmt.Errorf("socks5: method reply: %w", err)
	}
	if method != [2]byte{5, 0} {
		return 0, fmt.Errorf("socks5: method reply %v", method)
	}
	var rep [10]byte
	if _, err := io.ReadFull(c, rep[:]); err != nil {
		return 0, fmt.Errorf("socks5: connect reply: %w", err)
	}
	if rep[0] != 5 || rep[3] != 1 {
		return 0, fmt.Errorf("socks5: malformed reply %v", rep)
	}
	return rep[1], nil
}

// --- backends ---

// backend is a TCP server running handle for every connection it accepts.
type backend struct {
	ln       *net.TCPListener
	accepted atomic.Int64
	wg       sync.WaitGroup
	mu       sync.Mutex
	conns    map[net.Conn]struct{}
	closed   bool
}

// startBackend listens on addr ("127.0.0.3:0") and serves handle; Close (also at cleanup)
// closes the listener and every live connection and waits for the handlers.
func startBackend(tb testing.TB, addr string, handle func(*net.TCPConn)) *backend {
	tb.Helper()
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		if errors.Is(err, syscall.EADDRINUSE) {
			tb.Skipf("backend: %v (needs the address free)", err)
		}
		tb.Fatalf("backend: %v", err)
	}
	b := &backend{ln: ln.(*net.TCPListener), conns: map[net.Conn]struct{}{}}
	b.wg.Add(1)
	go b.serve(handle)
	tb.Cleanup(b.Close)
	return b
}

func (b *backend) serve(handle func(*net.TCPConn)) {
	defer b.wg.Done()
	for {
		c, err := b.ln.AcceptTCP()
		if err != nil {
			return
		}
		b.accepted.Add(1)
		b.mu.Lock()
		if b.closed {
			b.mu.Unlock()
			c.Close()
			return
		}
		b.conns[c] = struct{}{}
		b.wg.Add(1)
		b.mu.Unlock()
		go func() {
			defer b.wg.Done()
			defer func() {
				b.mu.Lock()
				delete(b.conns, c)
				b.mu.Unlock()
				c.Close()
			}()
			handle(c)
		}()
	}
}

func (b *backend) port() uint16 { return uint16(b.ln.Addr().(*net.TCPAddr).Port) }

func (b *backend) Close() {
	b.mu.Lock()
	if b.closed {
		b.mu.Unlock()
		return
	}
	b.closed = true
	b.ln.Close()
	for c := range b.conns {
		c.Close()
	}
	b.mu.Unlock()
	b.wg.Wait()
}

// echo copies everything back, then half-closes once the client has.
func echo(c *net.TCPConn) {
	if _, err := io.Copy(c, c); err == nil {
		_ = c.CloseWrite()
	}
}

// --- metrics ---

// counter sums the samples of family name whose labels include want.
func counter(tb testing.TB, reg *prometheus.Registry, name string, want map[string]string) float64 {
	tb.Helper()
	sum, _ := testutil.Gather(tb, reg).Sum(name, want)
	return sum
}

// dumpCounters is for failure messages: every istio_tcp sample of a registry.
func dumpCounters(reg *prometheus.Registry) string {
	mfs, _ := reg.Gather()
	var b bytes.Buffer
	for _, mf := range mfs {
		if !strings.HasPrefix(mf.GetName(), "istio_tcp") {
			continue
		}
		for _, m := range mf.GetMetric() {
			fmt.Fprintf(&b, "%s{", mf.GetName())
			for _, lp := range m.GetLabel() {
				if lp.GetValue() != "unknown" && lp.GetValue() != "" {
					fmt.Fprintf(&b, "%s=%q,", lp.GetName(), lp.GetValue())
				}
			}
			fmt.Fprintf(&b, "} %v\n", m.GetCounter().GetValue()+m.GetGauge().GetValue())
		}
	}
	return b.String()
}

// hboneConns counts this process's established TCP connections to ip:15008 (IPv4): node A's
// pooled HBONE connections to node B. /proc/net/tcp is the whole network namespace's, where
// another test binary may run nodes of its own on the same address (the listeners share
// 15008 by SO_REUSEPORT), so only sockets among this process's file descriptors count.
func hboneConns(tb testing.TB, ip string) int {
	tb.Helper()
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		tb.Skipf("needs /proc/net/tcp: %v", err)
	}
	ours := map[string]bool{} // socket inodes
	fds, _ := os.ReadDir("/proc/self/fd")
	for _, fd := range fds {
		if l, err := os.Readlink("/proc/self/fd/" + fd.Name()); err == nil {
			if ino, ok := strings.CutPrefix(l, "socket:["); ok {
				ours[strings.TrimSuffix(ino, "]")] = true
			}
		}
	}
	a4 := netip.MustParseAddr(ip).As4()
	// The kernel prints the address as a little-endian hex word, then the port.
	want := fmt.Sprintf("%02X%02X%02X%02X:%04X", a4[3], a4[2], a4[1], a4[0], 15008)
	n := 0
	for _, line := range strings.Split(string(b), "\n")[1:] {
		f := strings.Fields(line)
		// rem_address, st == ESTABLISHED, inode
		if len(f) > 9 && f[2] == want && f[3] == "01" && ours[f[9]] {
			n++
		}
	}
	return n
}

// closedPort is a port on ip that was just free: nothing listens there.
func closedPort(t *testing.T, ip string) uint16 {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(ip, "0"))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return uint16(ln.Addr().(*net.TCPAddr).Port)
}

// testSeed is a randomized test's seed: $TEST_SEED if set (to replay a run), else a random
// one, logged either way.
func testSeed(t *testing.T) uint64 {
	t.Helper()
	seed := rand.Uint64()
	if s := os.Getenv("TEST_SEED"); s != "" {
		var err error
		if seed, err = strconv.ParseUint(s, 10, 64); err != nil {
			t.Fatalf("TEST_SEED=%q: %v", s, err)
		}
	}
	t.Logf("seed %d (replay with TEST_SEED=%d)", seed, seed)
	return seed
}
