package proxy_test

// End-to-end tests of two nodes on loopback: a SOCKS5 client on node A (default/client,
// 127.0.0.2) reaches a backend of default/server (127.0.0.3) through a real mTLS HBONE tunnel
// to node B's 15008, with both nodes' certificates from one built-in CA.

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

// payload is size pseudo-random bytes determined by seed.
func payload(seed uint64, size int64) io.Reader {
	var key [32]byte
	binary.LittleEndian.PutUint64(key[:], seed)
	return io.LimitReader(rand.NewChaCha8(key), size)
}

// sendAndCheck writes size pseudo-random bytes to c, half-closes, and checks that exactly
// the same bytes come back (by SHA-256) before EOF.
func sendAndCheck(t testing.TB, c *net.TCPConn, size int64, seed uint64) {
	t.Helper()
	src := payload(seed, size)
	sent := sha256.New()
	werr := make(chan error, 1)
	go func() {
		_, err := io.Copy(c, io.TeeReader(src, sent))
		if err == nil {
			err = c.CloseWrite()
		}
		werr <- err
	}()
	got := sha256.New()
	n, rerr := io.Copy(got, c)
	if rerr != nil || n != size {
		c.Close() // unblock the writer
	}
	if err := <-werr; err != nil && rerr == nil && n == size {
		t.Fatalf("write %d bytes: %v", size, err)
	}
	if rerr != nil {
		t.Fatalf("read echo: %v after %d of %d bytes", rerr, n, size)
	}
	if n != size {
		t.Fatalf("echo: got %d bytes, want %d", n, size)
	}
	if !bytes.Equal(got.Sum(nil), sent.Sum(nil)) {
		t.Fatalf("echo of %d bytes: content differs", size)
	}
}

func TestPayloadsThroughHBONE(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	for i, size := range []int64{0, 1, 64 << 10, 64 << 20} {
		t.Run(strconv.FormatInt(size, 10), func(t *testing.T) {
			c, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
			if err != nil {
				t.Fatalf("socks5 connect: code %d: %v", code, err)
			}
			defer c.Close()
			sendAndCheck(t, c, size, uint64(i))
		})
	}
	if got := be.accepted.Load(); got != 4 {
		t.Errorf("backend accepted %d connections, want 4", got)
	}
	// One after another, the streams share one pooled HBONE connection.
	if got := hboneConns(t, m.serverIP); got != 1 {
		t.Errorf("%d HBONE connections from node A to node B, want 1 reused", got)
	}
}

// Connections that come one after another are set up by one goroutine, which keeps the
// stack setup grew: after each, exactly one goroutine waits in setupLoop, the same one.
func TestSetupGoroutineReused(t *testing.T) {
	leaktest.Check(t)
	proxy.SetSetupIdle(t, time.Minute) // a slow machine must not see the goroutine retire
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	waiting := func() []string {
		buf := make([]byte, 1<<20)
		buf = buf[:runtime.Stack(buf, true)]
		var ids []string
		for _, g := range strings.Split(string(buf), "\n\n") {
			if strings.Contains(g, "[select") && strings.Contains(g, "proxy.(*Proxy).setupLoop(") {
				ids = append(ids, strings.Fields(g)[1])
			}
		}
		return ids
	}
	var first string
	for i := range 5 {
		c, code, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatalf("socks5 connect: code %d: %v", code, err)
		}
		sendAndCheck(t, c, 100, uint64(i))
		c.Close()
		var ids []string
		testutil.Eventually(t, "a goroutine waiting in setupLoop", func() bool { ids = waiting(); return len(ids) > 0 })
		if len(ids) != 1 {
			t.Fatalf("connection %d: goroutines waiting in setupLoop %v, want one", i, ids)
		}
		if i == 0 {
			first = ids[0]
		} else if ids[0] != first {
			t.Fatalf("connection %d set up by goroutine %s, the first by %s; want it reused", i, ids[0], first)
		}
	}
}

func TestCurlThroughSocks(t *testing.T) {
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Skip("curl not installed")
	}
	leaktest.Check(t)
	checkFDs(t)
	// The echo service of the example routes port 80 to 8080 on the server pod.
	m := newMesh(t, "8080")
	ln, err := net.Listen("tcp", m.serverIP+":8080")
	if err != nil {
		t.Skipf("needs %s:8080 free for the example's echo service: %v", m.serverIP, err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello %s from %s", r.URL.Path, r.Host)
	})}
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = srv.Serve(ln)
	}()
	defer func() {
		srv.Close()
		<-served
	}()
	m.start(t)
	for _, tc := range []struct{ name, url, want string }{
		{"by-ip", "http://" + m.serverIP + ":8080/ip", "hello /ip from " + m.serverIP + ":8080"},
		{"by-hostname", "http://echo.default.svc.cluster.local/name", "hello /name from echo.default.svc.cluster.local"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			cmd := exec.CommandContext(ctx, curl, "-sS", "--fail", "--noproxy", "", "--socks5-hostname", m.a.socks(t), tc.url)
			cmd.Env = []string{"PATH=/usr/bin:/bin"}
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("curl %s: %v\n%s", tc.url, err, out)
			}
			if string(out) != tc.want {
				t.Fatalf("curl %s: got %q, want %q", tc.url, out, tc.want)
			}
		})
	}
	// Node A knows the service only for the hostname request; node B guesses it for both
	// from the server's port map (8080 is echo's target port).
	echoSvc := map[string]string{"destination_service": "echo.default.svc.cluster.local"}
	testutil.Eventually(t, "both connections recorded", func() bool {
		return counter(t, m.b.reg, "istio_tcp_connections_closed_total", echoSvc) == 2 &&
			counter(t, m.a.reg, "istio_tcp_connections_closed_total", nil) == 2
	})
	if got := counter(t, m.a.reg, "istio_tcp_connections_closed_total", echoSvc); got != 1 {
		t.Errorf("node A: %v connections labelled with the echo service, want 1\n%s", got, dumpCounters(m.a.reg))
	}
}

func TestHalfClose(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)

	t.Run("client-first", func(t *testing.T) {
		// The client sends and half-closes; the server reads to EOF, then still answers.
		be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
			req, err := io.ReadAll(c)
			if err != nil {
				return
			}
			fmt.Fprintf(c, "got %d bytes: %s", len(req), req)
			_ = c.CloseWrite()
		})
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		if _, err := c.Write([]byte("request")); err != nil {
			t.Fatal(err)
		}
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
		resp, err := io.ReadAll(c)
		if err != nil {
			t.Fatalf("read after half-close: %v (got %q)", err, resp)
		}
		if want := "got 7 bytes: request"; string(resp) != want {
			t.Fatalf("response after client FIN: got %q, want %q", resp, want)
		}
	})

	t.Run("server-first", func(t *testing.T) {
		// The server greets and half-closes at once; the client sees EOF, then still sends.
		got := make(chan string, 1)
		be := startBackend(t, m.serverIP+":0", func(c *net.TCPConn) {
			if _, err := c.Write([]byte("greeting")); err != nil {
				got <- "write: " + err.Error()
				return
			}
			if err := c.CloseWrite(); err != nil {
				got <- "closewrite: " + err.Error()
				return
			}
			req, err := io.ReadAll(c)
			if err != nil {
				got <- "read: " + err.Error()
				return
			}
			got <- string(req)
		})
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		greet, err := io.ReadAll(c)
		if err != nil || string(greet) != "greeting" {
			t.Fatalf("read until server FIN: %q, %v; want %q", greet, err, "greeting")
		}
		if _, err := c.Write([]byte("after your FIN")); err != nil {
			t.Fatalf("write after server FIN: %v", err)
		}
		if err := c.CloseWrite(); err != nil {
			t.Fatal(err)
		}
		select {
		case s := <-got:
			if s != "after your FIN" {
				t.Fatalf("server received %q after its FIN, want %q", s, "after your FIN")
			}
		case <-time.After(20 * time.Second):
			t.Fatal("server never saw the client's bytes and FIN")
		}
	})
}

func TestThousandConcurrentConnections(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	be := startBackend(t, m.serverIP+":0", echo)
	const n = 1000
	socks := m.a.socks(t)

	// Every connection is established before any sends, so all 1000 are open at once.
	var established, done sync.WaitGroup
	established.Add(n)
	done.Add(n)
	start := make(chan struct{})
	errs := make(chan error, n)
	for i := range n {
		go func() {
			defer done.Done()
			c, code, err := socksConnect(socks, m.serverIP, be.port())
			established.Done()
			if err != nil {
				errs <- fmt.Errorf("conn %d: code %d: %w", i, code, err)
				return
			}
			defer c.Close()
			<-start
			msg := fmt.Appendf(nil, "connection %04d %s", i, strings.Repeat("x", i))
			if _, err := c.Write(msg); err != nil {
				errs <- fmt.Errorf("conn %d: write: %w", i, err)
				return
			}
			if err := c.CloseWrite(); err != nil {
				errs <- fmt.Errorf("conn %d: closewrite: %w", i, err)
				return
			}
			_ = c.SetReadDeadline(time.Now().Add(30 * time.Second))
			got, err := io.ReadAll(c)
			if err != nil || !bytes.Equal(got, msg) {
				errs <- fmt.Errorf("conn %d: echo %d bytes (%v), want %d", i, len(got), err, len(msg))
			}
		}()
	}
	established.Wait()
	// Every connection is held open until start: node B must see all of them at once.
	// (On a failure above this gives up after a while and reports the failures below.)
	allOpen := testutil.Poll(testutil.Timeout, func() error {
		if got := counter(t, m.b.reg, "istio_tcp_sockets_open", map[string]string{"reporter": "destination"}); got != n {
			return fmt.Errorf("%v open", got)
		}
		return nil
	}) == nil
	// At most 100 streams share a pooled connection, so 1000 need at least 10.
	pooled := hboneConns(t, m.serverIP)
	close(start)
	done.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		if failed < 5 {
			t.Error(err)
		}
		failed++
	}
	if failed > 0 {
		t.Fatalf("%d of %d connections failed", failed, n)
	}
	if pooled < n/100 || pooled > 2*n/100 {
		t.Errorf("%d HBONE connections carry %d streams, want %d to %d (100 streams each)", pooled, n, n/100, 2*n/100)
	}
	t.Logf("%d streams on %d HBONE connections", n, pooled)
	if !allOpen {
		t.Errorf("node B never had all %d inbound connections open at once", n)
	}
	if got := be.accepted.Load(); got != n {
		t.Errorf("backend accepted %d connections, want %d", got, n)
	}
	testutil.Eventually(t, "all connections recorded closed on both nodes", func() bool {
		return counter(t, m.a.reg, "istio_tcp_connections_closed_total", map[string]string{"reporter": "source"}) == n &&
			counter(t, m.b.reg, "istio_tcp_connections_closed_total", map[string]string{"reporter": "destination"}) == n
	})
}

func TestPassthroughUnknownDestination(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	outside := startBackend(t, m.outsideIP+":0", echo)
	c, code, err := socksConnect(m.a.socks(t), m.outsideIP, outside.port())
	if err != nil {
		t.Fatalf("passthrough connect: code %d: %v", code, err)
	}
	sendAndCheck(t, c, 256<<10, 7)
	c.Close()
	testutil.Eventually(t, "node A records the passthrough", func() bool {
		return counter(t, m.a.reg, "istio_tcp_connections_closed_total", map[string]string{"reporter": "source"}) == 1
	})
	// Plain TCP: nothing went through node B, and A did not claim mTLS.
	if got := counter(t, m.b.reg, "istio_tcp_connections_opened_total", nil); got != 0 {
		t.Errorf("node B saw %v connections for an out-of-mesh destination", got)
	}
	if got := counter(t, m.a.reg, "istio_tcp_connections_closed_total", map[string]string{"connection_security_policy": "mutual_tls"}); got != 0 {
		t.Errorf("passthrough recorded as mutual_tls")
	}
}

// TestUpstreamRefused: node B cannot reach the pod's port, answers 503, and node A turns
// that into SOCKS5 "connection refused"; both record a CONNECT failure.
func TestUpstreamRefused(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := startMesh(t)
	_, code, err := socksConnect(m.a.socks(t), m.serverIP, closedPort(t, m.serverIP))
	if err == nil || code != 5 {
		t.Fatalf("connect to a closed port behind node B: code %d, err %v; want 5 (connection refused)", code, err)
	}
	failed := map[string]string{"response_flags": metrics.FlagConnect}
	testutil.Eventually(t, "both nodes record CONNECT failures", func() bool {
		return counter(t, m.a.reg, "istio_tcp_connections_failed_total", failed) == 1 &&
			counter(t, m.b.reg, "istio_tcp_connections_failed_total", failed) == 1
	})
}

func TestPassthroughIPv6(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	}
	ln.Close()
	m := startMesh(t)
	outside := startBackend(t, "[::1]:0", echo)
	c, code, err := socksConnect(m.a.socks(t), "::1", outside.port())
	if err != nil {
		t.Fatalf("socks5 CONNECT [::1]: code %d: %v", code, err)
	}
	defer c.Close()
	sendAndCheck(t, c, 4096, 3)
}

// TestPlaintextListenerDirect: a connection made straight to the inbound plaintext listener
// (on a configured, non-standard port) has the listener itself as its original destination;
// node B must refuse it rather than dial itself in a loop, with a reset (the connection
// was accepted, then refused: a FIN would look like a server that answered nothing).
func TestPlaintextListenerDirect(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := newMesh(t)
	cfg := m.serverConfig()
	cfg.InboundPlaintextAddr = m.serverIP + ":0"
	m.b = startNode(t, "node-b", m.caDir, m.yaml, cfg)
	c, err := net.Dial("tcp", m.b.addr(t, proxy.ListenerInboundPlaintext))
	if err == nil {
		defer c.Close()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		var n int64
		n, err = io.Copy(io.Discard, c)
		if n != 0 {
			t.Fatalf("direct connection to the plaintext listener: %d bytes", n)
		}
	}
	if !errors.Is(err, syscall.ECONNRESET) { // at connect(2) or at the first read
		t.Fatalf("direct connection to the plaintext listener: %v; want a reset", err)
	}
	failed := map[string]string{"reporter": "destination", "response_flags": metrics.FlagConnect}
	testutil.Eventually(t, "node B records the refusal", func() bool {
		return counter(t, m.b.reg, "istio_tcp_connections_failed_total", failed) >= 1
	})
	if got := counter(t, m.b.reg, "istio_tcp_connections_opened_total", nil); got != 1 {
		t.Errorf("node B opened %v connections for one direct connection, want 1 (a loop?)", got)
	}
}

// TestLateLocalWorkload: node B learns its own workload only after the first connection
// arrives (a new pod racing its xDS push); it waits for it, up to WorkloadWait.
func TestLateLocalWorkload(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	const serverUID = "Kubernetes//v1/Pod/default/server"
	m := newMesh(t)
	cfg := m.serverConfig()
	cfg.WorkloadWait = 3 * time.Second
	m.b = startNode(t, "node-b", m.caDir, m.yaml, cfg)
	m.a = startNode(t, "node-a", m.caDir, m.yaml, m.clientConfig())
	full := parseBatch(t, m.yaml)
	m.b.store.Apply(&state.Batch{RemoveAddresses: []string{serverUID}})
	be := startBackend(t, m.serverIP+":0", echo)

	type result struct {
		c   *net.TCPConn
		err error
	}
	waiting := make(chan struct{}, 1)
	m.b.proxy.OnLocalWait(func() {
		select {
		case waiting <- struct{}{}:
		default:
		}
	})
	got := make(chan result, 1)
	go func() {
		c, _, err := socksConnect(m.a.socks(t), m.serverIP, be.port())
		got <- result{c, err}
	}()
	select { // node B's handshake waits for its workload: only now does it learn it
	case <-waiting:
	case <-time.After(testutil.Timeout):
		t.Fatal("node B never waited for its workload")
	}
	m.b.store.Apply(full)
	r := <-got
	if r.err != nil {
		t.Fatalf("connect while node B learns its workload: %v", r.err)
	}
	sendAndCheck(t, r.c, 1000, 9)
	r.c.Close()
}

// TestNodeCaptureMode runs both nodes in node-capture mode (NODE_NAME node-a / node-b): node A finds
// the client workload by the SOCKS5 client's source address, node B the server workload by
// the address the HBONE connection was sent to.
func TestNodeCaptureMode(t *testing.T) {
	leaktest.Check(t)
	checkFDs(t)
	m := newMesh(t)
	bcfg := proxy.Config{Local: state.Local{Mode: state.ModeNode, Node: "node-b"}, InboundAddr: m.serverIP + ":15008"}
	m.b = startNode(t, "node-b", m.caDir, m.yaml, bcfg)
	acfg := proxy.Config{Local: state.Local{Mode: state.ModeNode, Node: "node-a"}, Socks5Addr: m.clientIP + ":0", WorkloadWait: 200 * time.Millisecond}
	m.a = startNode(t, "node-a", m.caDir, m.yaml, acfg)
	be := startBackend(t, m.serverIP+":0", echo)

	c, code, err := socksConnectFrom(m.clientIP, m.a.socks(t), m.serverIP, be.port())
	if err != nil {
		t.Fatalf("socks5 from the client pod's address: code %d: %v", code, err)
	}
	sendAndCheck(t, c, 64<<10, 5)
	c.Close()
	testutil.Eventually(t, "node B records the client's identity", func() bool {
		return counter(t, m.b.reg, "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "destination", "source_principal": "spiffe://" + clientPrinc, "destination_principal": "spiffe://" + serverPrinc,
		}) == 1
	})

	// From an address that is no workload of node A: refused once the wait is over.
	if _, code, err := socksConnectFrom("127.0.0.1", m.a.socks(t), m.serverIP, be.port()); err == nil || code != repNotAllowed {
		t.Fatalf("socks5 from an unknown source: code %d, err %v; want %d", code, err, repNotAllowed)
	}
}
