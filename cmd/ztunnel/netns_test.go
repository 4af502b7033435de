//go:build linux

package main

import (
	"bufio"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/cnirules"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns/netnstest"
	"github.com/gozt/gozt/internal/sockopt"
	"github.com/gozt/gozt/internal/testutil"
)

// The namespace topology: two nodes joined by a veth pair. Each node namespace is also its
// pod's namespace (a dedicated proxy next to one workload), so the pod IP is the veth IP.
// These addresses exist only inside the test's namespaces.
const (
	nsClientIP = "10.10.0.1" // node A: pod default/client
	nsServerIP = "10.10.0.2" // node B: pod default/server
	nsEchoVIP  = "10.96.0.10"
	nsClientV6 = "fd00:10::1"
	nsServerV6 = "fd00:10::2"
	nsMark     = 1337 // PACKET_MARK

	nsExcludedPort = "9999" // not redirected on either node
)

// writeWorkloads writes the LOCAL_XDS_PATH file: default/client on node-a, default/server
// on node-b behind the echo service, and a policy denying port 8081. clientIPs and
// serverIPs are comma-separated.
func writeWorkloads(t *testing.T, dir, clientIPs, serverIPs, vip string) {
	t.Helper()
	quoted := func(ips string) string { return `"` + strings.ReplaceAll(ips, ",", `", "`) + `"` }
	yaml := strings.NewReplacer("CLIENT_IPS", quoted(clientIPs), "SERVER_IPS", quoted(serverIPs), "VIP", vip).Replace(`
workloads:
  - uid: Kubernetes//v1/Pod/default/client
    name: client
    namespace: default
    serviceAccount: client
    workloadIps: [CLIENT_IPS]
    protocol: HBONE
    node: node-a
  - uid: Kubernetes//v1/Pod/default/server
    name: server
    namespace: default
    serviceAccount: server
    workloadIps: [SERVER_IPS]
    protocol: HBONE
    node: node-b
    services:
      "default/echo.default.svc.cluster.local":
        80: 8080
services:
  - name: echo
    namespace: default
    hostname: echo.default.svc.cluster.local
    vips: ["/VIP"]
    ports:
      80: 8080
policies:
  - name: deny-8081
    namespace: default
    scope: Namespace
    action: Deny
    rules:
      - - - destinationPorts: [8081]
`)
	if err := os.WriteFile(filepath.Join(dir, "workloads.yaml"), []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
}

// redirect installs the rules istio-cni's dedicated-mode scripts would: the pod's outbound
// TCP goes to 15001 unless it carries ztunnel's packet mark or stays on loopback; inbound
// TCP from outside goes to 15006 except HBONE on 15008, which ztunnel serves directly.
// Port nsExcludedPort is left out both ways (the excludeInboundPorts/excludeOutboundPorts
// annotations): the plain-TCP baseline for the bulk transfer.
func redirect(t *testing.T, ns *netnstest.NS) {
	t.Helper()
	mark := strconv.Itoa(nsMark)
	for _, family := range []struct{ tool, loopback string }{{"iptables", "127.0.0.0/8"}, {"ip6tables", "::1/128"}} {
		if family.tool == "ip6tables" && !haveIP6tables() {
			continue
		}
		for _, rule := range cnirules.Redirect(mark, family.loopback, nsExcludedPort) {
			ns.MustExec(t, append([]string{family.tool, "-w", "-t", "nat"}, rule...)...)
		}
	}
}

func haveIP6tables() bool {
	_, err := exec.LookPath("ip6tables")
	return err == nil
}

// addAddr gives ns's one veth link another address (nodad: usable at once, no duplicate
// address detection wait).
func addAddr(t *testing.T, ns *netnstest.NS, cidr string) {
	t.Helper()
	for _, line := range strings.Split(ns.MustExec(t, "ip", "-o", "link", "show", "type", "veth"), "\n") {
		_, rest, ok := strings.Cut(line, ": ")
		if !ok {
			continue
		}
		name, _, _ := strings.Cut(rest, "@")
		ns.MustExec(t, "ip", "addr", "add", cidr, "dev", name, "nodad")
		return
	}
	t.Fatalf("no veth link in %s", ns.Name)
}

// startNodeIn runs the built ztunnel as its own process inside ns (ip netns exec), so its
// listeners and every socket it dials later belong to that namespace. mode is the
// PROXY_MODE setting and its companion (PROXY_WORKLOAD_INFO or NODE_NAME), plus any
// overrides.
func startNodeIn(t *testing.T, bin string, ns *netnstest.NS, dir string, mode ...string) *proc {
	t.Helper()
	p := startProc(t, "ztunnel in "+ns.Name, append([]string{
		"LOCAL_XDS_PATH=" + filepath.Join(dir, "workloads.yaml"),
		"CA_PROVIDER=builtin",
		"CA_DIR=" + filepath.Join(dir, "ca"),
		"PACKET_MARK=" + strconv.Itoa(nsMark),
		// The server pod would answer a spoofed client address over the veth, not to
		// ztunnel; istio-cni's policy routing for that is not set up here.
		"ENABLE_ORIG_SRC=false",
		"DNS_PROXY_ADDR=off",
		"CONNECTION_TERMINATION_DEADLINE=1s",
	}, mode...), "ip", "netns", "exec", ns.Name, bin) // the last of a repeated variable wins
	p.waitUntil(t, "ready", 20*time.Second, func() error {
		out, err := ns.Exec("curl", "-fsS", "-m", "1", "http://127.0.0.1:15021/healthz/ready")
		if err != nil {
			return fmt.Errorf("%v %s", err, out)
		}
		return nil
	})
	return p
}

// podServer is the server pod's application: HTTP on the pod IP, counting the requests it
// saw per port and remembering who sent the last one.
type podServer struct {
	mu   sync.Mutex
	seen map[string]int    // port -> requests
	from map[string]string // port -> client IP of the last request
}

func (s *podServer) count(port string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.seen[port]
}

func (s *podServer) lastClient(port string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.from[port]
}

// startPodServer listens on ip:ports inside ns (the sockets belong to ns for life) and serves
// them until the test ends.
func startPodServer(t *testing.T, ns *netnstest.NS, ip string, ports ...string) *podServer {
	t.Helper()
	s := &podServer{seen: map[string]int{}, from: map[string]string{}}
	for _, port := range ports {
		var ln net.Listener
		if err := ns.Do(func() (err error) {
			ln, err = net.Listen("tcp", net.JoinHostPort(ip, port))
			return err
		}); err != nil {
			t.Fatal(err)
		}
		srv := &http.Server{
			ReadHeaderTimeout: 5 * time.Second,
			Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				s.mu.Lock()
				s.seen[port]++
				s.from[port], _, _ = net.SplitHostPort(r.RemoteAddr)
				s.mu.Unlock()
				switch r.URL.Path {
				case "/bytes": // ?n=N: N bytes of a fixed pattern
					n, _ := strconv.Atoi(r.URL.Query().Get("n"))
					w.Header().Set("Content-Length", strconv.Itoa(n))
					_, _ = io.CopyN(w, &patternReader{}, int64(n))
				case "/sha256": // the digest and size of the request body
					h := sha256.New()
					n, _ := io.Copy(h, r.Body)
					fmt.Fprintf(w, "%x %d\n", h.Sum(nil), n)
				default:
					body, _ := io.ReadAll(r.Body)
					fmt.Fprintf(w, "server pod port %s got %s %s body=%q\n", port, r.Method, r.URL.Path, body)
				}
			}),
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			_ = srv.Serve(ln)
		}()
		t.Cleanup(func() { srv.Close(); <-done })
	}
	return s
}

// pattern is one period-aligned block of the bulk-transfer bytes (0, 1, ..., 250, 0, ...).
var pattern = func() []byte {
	b := make([]byte, 251*256)
	for i := range b {
		b[i] = byte(i % 251)
	}
	return b
}()

// patternReader yields the pattern endlessly with a copy per block, so the in-test server
// (instrumented under -race) is not the first bottleneck of the throughput comparison.
type patternReader struct{ off int }

func (r *patternReader) Read(p []byte) (int, error) {
	n := 0
	for n < len(p) {
		c := copy(p[n:], pattern[r.off:])
		n += c
		r.off = (r.off + c) % len(pattern)
	}
	return n, nil
}

// scrape reads a node's /metrics from inside its namespace.
func scrape(t *testing.T, ns *netnstest.NS) string {
	t.Helper()
	return ns.MustExec(t, "curl", "-fsS", "-m", "5", "http://127.0.0.1:15020/metrics")
}

// metricSum adds up the samples of metric in a /metrics page whose labels include every
// pair in want.
func metricSum(t *testing.T, text, metric string, want map[string]string) float64 {
	t.Helper()
	sum, _ := testutil.ParseMetrics(t, text).Sum(metric, want)
	return sum
}

// waitMetric polls a node's metrics until metric with labels reaches at least atLeast: the
// proxy records a connection when both of its directions have ended, a moment after the
// client sees the end.
func waitMetric(t *testing.T, ns *netnstest.NS, node, metric string, labels map[string]string, atLeast float64) {
	t.Helper()
	waitMetricFrom(t, func() string { return scrape(t, ns) }, node, metric, labels, atLeast)
}

// waitMetricFrom is waitMetric with the node's metrics read by scrape.
func waitMetricFrom(t *testing.T, scrape func() string, node, metric string, labels map[string]string, atLeast float64) {
	t.Helper()
	err := testutil.Poll(5*time.Second, func() error {
		text := scrape()
		if got := metricSum(t, text, metric, labels); got < atLeast {
			var rel []string
			for _, l := range strings.Split(text, "\n") {
				if strings.HasPrefix(l, "istio_tcp_") {
					rel = append(rel, l)
				}
			}
			return fmt.Errorf("%s %v = %v; want >= %v\n%s", metric, labels, got, atLeast, strings.Join(rel, "\n"))
		}
		return nil
	})
	if err != nil {
		t.Errorf("node %s: %v", node, err)
	}
}

// plainGet sends one HTTP request from inside ns on a socket carrying mark (0: none). With
// ztunnel's mark the namespace's redirection skips it: a client outside the mesh, whose
// plain TCP reaches the destination node as such.
func plainGet(ns *netnstest.NS, mark int, addr, path string) (string, error) {
	var c net.Conn
	d := net.Dialer{Timeout: 5 * time.Second, Control: sockopt.Control(uint32(mark))}
	if err := ns.Do(func() (err error) {
		c, err = d.Dial("tcp", addr)
		return err
	}); err != nil {
		return "", err
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", path, addr)
	b, err := io.ReadAll(c)
	return string(b), err
}

// TestNetnsDedicated is the honest topology: two nodes as network namespaces joined by a
// veth pair, each running ztunnel as its own process in dedicated mode, with iptables
// REDIRECT rules as istio-cni sets them. curl in the client pod speaks plain HTTP; iptables
// hands it to ztunnel A on 15001, which carries it over mTLS HBONE to B's 15008, and
// ztunnel B delivers it to the server pod. Plain TCP arriving at B is redirected to 15006
// and authorized without a peer identity. Also: IPv6 pods, a service VIP, a deny policy,
// 32 MiB both ways against an excluded plain-TCP port, and drain on SIGTERM.
func TestNetnsDedicated(t *testing.T) {
	netnstest.Require(t, "iptables", "curl")
	leaktest.Check(t)
	bin := buildZtunnel(t)

	a := netnstest.New(t, "node-a")
	b := netnstest.New(t, "node-b")
	netnstest.Link(t, a, nsClientIP+"/24", b, nsServerIP+"/24")
	// The service VIP needs a route for the client's connect to leave the socket layer;
	// iptables then captures it like any other destination.
	a.MustExec(t, "ip", "route", "add", nsEchoVIP+"/32", "via", nsServerIP)
	addAddr(t, a, nsClientV6+"/64")
	addAddr(t, b, nsServerV6+"/64")
	redirect(t, a)
	redirect(t, b)

	dir := t.TempDir()
	writeWorkloads(t, dir, nsClientIP+","+nsClientV6, nsServerIP+","+nsServerV6, nsEchoVIP)
	server := startPodServer(t, b, nsServerIP, "8080", "8081", nsExcludedPort)
	server6 := startPodServer(t, b, nsServerV6, "8080")
	nodeB := startNodeIn(t, bin, b, dir, "PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO=default/server/server")
	// Node A drains for 3s so the drain case has room on a loaded machine.
	nodeA := startNodeIn(t, bin, a, dir, "PROXY_MODE=dedicated", "PROXY_WORKLOAD_INFO=default/client/client",
		"CONNECTION_TERMINATION_DEADLINE=3s")

	clientID := "spiffe://cluster.local/ns/default/sa/client"
	serverID := "spiffe://cluster.local/ns/default/sa/server"

	t.Run("pod to pod over HBONE", func(t *testing.T) {
		before := server.count("8080")
		out := a.MustExec(t, "curl", "-sS", "-m", "10", "--data-binary", "ping through the mesh",
			"http://"+nsServerIP+":8080/direct")
		if want := `server pod port 8080 got POST /direct body="ping through the mesh"`; !strings.Contains(out, want) {
			t.Errorf("curl got %q; want %q", out, want)
		}
		if got := server.count("8080"); got != before+1 {
			t.Errorf("server saw %d requests on 8080; want %d", got, before+1)
		}
		// ztunnel B made the last hop from its own address (ENABLE_ORIG_SRC=false).
		if got := server.lastClient("8080"); got != nsServerIP {
			t.Errorf("server saw the request from %s; want ztunnel B's %s", got, nsServerIP)
		}
		waitMetric(t, a, "A", "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "source", "connection_security_policy": "mutual_tls", "response_flags": "-",
			"source_principal": clientID, "destination_principal": serverID, "destination_workload": "server",
		}, 1)
		// B names the source workload from the client pod's IP, which the HBONE connection
		// comes from because ztunnel A dials from inside node A.
		waitMetric(t, b, "B", "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "destination", "connection_security_policy": "mutual_tls", "response_flags": "-",
			"source_principal": clientID, "source_workload": "client", "destination_workload": "server",
		}, 1)
		waitMetric(t, b, "B", "istio_tcp_received_bytes_total", map[string]string{
			"reporter": "destination", "connection_security_policy": "mutual_tls",
		}, float64(len("ping through the mesh")))
	})

	t.Run("pod to pod over HBONE on IPv6", func(t *testing.T) {
		if !haveIP6tables() {
			t.Skip("ip6tables is not installed")
		}
		out := a.MustExec(t, "curl", "-sS", "-m", "10", "http://["+nsServerV6+"]:8080/v6")
		if want := "server pod port 8080 got GET /v6"; !strings.Contains(out, want) {
			t.Errorf("curl got %q; want %q", out, want)
		}
		if got, from := server6.count("8080"), server6.lastClient("8080"); got != 1 || from != nsServerV6 {
			t.Errorf("v6 server saw %d requests, last from %s; want 1 from ztunnel B's %s", got, from, nsServerV6)
		}
		waitMetric(t, b, "B", "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "destination", "connection_security_policy": "mutual_tls", "response_flags": "-",
			"source_principal": clientID, "source_workload": "client", "destination_workload": "server",
		}, 2)
	})

	t.Run("pod to service VIP over HBONE", func(t *testing.T) {
		before := server.count("8080")
		out := a.MustExec(t, "curl", "-sS", "-m", "10", "http://"+nsEchoVIP+"/vip")
		if want := "server pod port 8080 got GET /vip"; !strings.Contains(out, want) {
			t.Errorf("curl got %q; want %q", out, want)
		}
		if got := server.count("8080"); got != before+1 {
			t.Errorf("server saw %d requests on 8080; want %d", got, before+1)
		}
		waitMetric(t, a, "A", "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "source", "connection_security_policy": "mutual_tls",
			"destination_service": "echo.default.svc.cluster.local", "destination_workload": "server",
		}, 1)
	})

	t.Run("plaintext inbound redirected to 15006", func(t *testing.T) {
		before := server.count("8080")
		out, err := plainGet(a, nsMark, nsServerIP+":8080", "/plain")
		if err != nil || !strings.Contains(out, "server pod port 8080 got GET /plain") {
			t.Errorf("plaintext GET: %v %q", err, out)
		}
		if got := server.count("8080"); got != before+1 {
			t.Errorf("server saw %d requests on 8080; want %d", got, before+1)
		}
		// No peer identity: ztunnel B reports the connection without mTLS.
		waitMetric(t, b, "B", "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "destination", "connection_security_policy": "unknown", "response_flags": "-",
			"destination_workload": "server",
		}, 1)
	})

	t.Run("deny policy on plaintext and HBONE", func(t *testing.T) {
		out, err := plainGet(a, nsMark, nsServerIP+":8081", "/denied")
		if strings.Contains(out, "server pod") {
			t.Errorf("plaintext GET to a denied port got through: %v %q", err, out)
		}
		cout, err := a.Exec("curl", "-sS", "-m", "10", "http://"+nsServerIP+":8081/denied")
		if err == nil || strings.Contains(string(cout), "server pod") {
			t.Errorf("curl over HBONE to a denied port: %v %q; want a failure", err, cout)
		}
		if got := server.count("8081"); got != 0 {
			t.Errorf("server saw %d requests on the denied port", got)
		}
		waitMetric(t, b, "B", "istio_tcp_connections_failed_total", map[string]string{
			"reporter": "destination", "response_flags": "DENY", "connection_security_policy": "unknown",
		}, 1)
		waitMetric(t, b, "B", "istio_tcp_connections_failed_total", map[string]string{
			"reporter": "destination", "response_flags": "DENY", "connection_security_policy": "mutual_tls",
			"source_principal": clientID,
		}, 1)
		waitMetric(t, a, "A", "istio_tcp_connections_failed_total", map[string]string{
			"reporter": "source", "response_flags": "DENY", "destination_workload": "server",
		}, 1)
	})

	t.Run("unmarked socket is captured", func(t *testing.T) {
		// The same dial as the plaintext case without the mark: node A's rules capture it,
		// so it reaches the server through the tunnel and node A counts it.
		labels := map[string]string{"reporter": "source", "connection_security_policy": "mutual_tls", "destination_workload": "server"}
		tunneled := metricSum(t, scrape(t, a), "istio_tcp_connections_closed_total", labels)
		before := server.count("8080")
		out, err := plainGet(a, 0, nsServerIP+":8080", "/captured")
		if err != nil || !strings.Contains(out, "server pod port 8080 got GET /captured") {
			t.Fatalf("unmarked GET: %v %q", err, out)
		}
		if got := server.count("8080"); got != before+1 {
			t.Errorf("server saw %d requests; want %d", got, before+1)
		}
		waitMetric(t, a, "A", "istio_tcp_connections_closed_total", labels, tunneled+1)
	})

	t.Run("bulk transfer byte for byte", func(t *testing.T) {
		const size = 32 << 20
		file := filepath.Join(dir, "upload")
		f, err := os.Create(file)
		if err != nil {
			t.Fatal(err)
		}
		h := sha256.New()
		if _, err := io.CopyN(io.MultiWriter(f, h), &patternReader{}, size); err != nil {
			t.Fatal(err)
		}
		f.Close()
		want := fmt.Sprintf("%x %d", h.Sum(nil), size)

		// Upload: the server pod hashes what arrived.
		for _, port := range []string{"8080", nsExcludedPort} {
			out := strings.TrimSpace(a.MustExec(t, "curl", "-sS", "-m", "30", "--data-binary", "@"+file,
				"http://"+nsServerIP+":"+port+"/sha256"))
			if out != want {
				t.Errorf("upload to :%s: server got %q; want %q", port, out, want)
			}
		}
		// Download: curl reports the size and rate; the mesh path against the plain-TCP
		// baseline on the excluded port, same run, same veth.
		rate := map[string]float64{}
		for _, port := range []string{nsExcludedPort, "8080", nsExcludedPort, "8080"} {
			out := a.MustExec(t, "curl", "-sS", "-m", "30", "-o", "/dev/null", "-w", "%{size_download} %{speed_download}",
				"http://"+nsServerIP+":"+port+"/bytes?n="+strconv.Itoa(size))
			var n, bps float64
			if _, err := fmt.Sscan(out, &n, &bps); err != nil || n != size {
				t.Fatalf("download from :%s: %q (%v); want %d bytes", port, out, err, size)
			}
			rate[port] = max(rate[port], bps)
		}
		t.Logf("download %d MiB, best of 2: plain TCP %.0f MiB/s, through both ztunnels (HBONE mTLS) %.0f MiB/s (%.2fx; race detector: %v)",
			size>>20, rate[nsExcludedPort]/(1<<20), rate["8080"]/(1<<20), rate["8080"]/rate[nsExcludedPort], raceBuild)
		waitMetric(t, b, "B", "istio_tcp_sent_bytes_total", map[string]string{
			"reporter": "destination", "connection_security_policy": "mutual_tls",
		}, 2*size)
	})

	t.Run("drain on SIGTERM keeps live connections until the deadline", func(t *testing.T) {
		// A keep-alive HTTP connection from the client pod, captured and tunneled by A.
		var c net.Conn
		if err := a.Do(func() (err error) {
			c, err = net.DialTimeout("tcp", nsServerIP+":8080", 5*time.Second)
			return err
		}); err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(20 * time.Second))
		br := bufio.NewReader(c)
		roundTrip := func(path string) (string, error) {
			if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: server\r\n\r\n", path); err != nil {
				return "", err
			}
			resp, err := http.ReadResponse(br, nil)
			if err != nil {
				return "", err
			}
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			return string(b), err
		}
		if out, err := roundTrip("/before-drain"); err != nil || !strings.Contains(out, "GET /before-drain") {
			t.Fatalf("before drain: %v %q", err, out)
		}

		start := time.Now()
		if err := nodeA.Signal(syscall.SIGTERM); err != nil {
			t.Fatal(err)
		}
		nodeA.waitOutput(t, "msg=draining", 10*time.Second)
		// The live connection still works while draining...
		if out, err := roundTrip("/during-drain"); err != nil || !strings.Contains(out, "GET /during-drain") {
			t.Errorf("during drain: %v %q", err, out)
		}
		// ...but new connections are no longer accepted.
		if out, err := a.Exec("curl", "-sS", "-m", "5", "http://"+nsServerIP+":8080/after-drain"); err == nil {
			t.Errorf("new connection during drain succeeded: %q", out)
		}
		// At the deadline the rest is closed and the process exits 0.
		if err := nodeA.stop(); err != nil {
			t.Errorf("node A after SIGTERM: %v; want exit 0", err)
		}
		if _, err := br.ReadByte(); err == nil {
			t.Error("live connection still open after node A exited")
		}
		// The idle keep-alive connection is live at L4: ztunnel waits for it until the deadline.
		if d := time.Since(start); d < 2500*time.Millisecond || d > 9*time.Second {
			t.Errorf("node A took %v to exit; want about its 3s deadline", d)
		}
	})

	if err := nodeB.stop(); err != nil {
		t.Errorf("node B after SIGTERM: %v; want exit 0", err)
	}
}

// nodeRedirect installs node-level redirection for node mode on a node that routes for
// the pods in podCIDR: their outbound TCP goes to 15001; TCP addressed to one of them goes
// to 15008 when it is HBONE and to 15006 otherwise. REDIRECT keeps the pod address as the
// original destination (SO_ORIGINAL_DST), which is how ztunnel knows the pod meant.
func nodeRedirect(t *testing.T, ns *netnstest.NS, podCIDR string) {
	t.Helper()
	for _, rule := range [][]string{
		{"-N", "GOZT_PREROUTING"},
		{"-A", "GOZT_PREROUTING", "-s", podCIDR, "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15001"},
		{"-A", "GOZT_PREROUTING", "-d", podCIDR, "-p", "tcp", "--dport", "15008", "-j", "REDIRECT", "--to-ports", "15008"},
		{"-A", "GOZT_PREROUTING", "-d", podCIDR, "-p", "tcp", "-j", "REDIRECT", "--to-ports", "15006"},
		{"-A", "PREROUTING", "-p", "tcp", "-j", "GOZT_PREROUTING"},
	} {
		ns.MustExec(t, append([]string{"iptables", "-w", "-t", "nat"}, rule...)...)
	}
}

// TestNetnsNodeCapture is node mode, capture at node level for hosts without istio-cni:
// each node namespace routes for a pod namespace behind it and runs one ztunnel
// (PROXY_MODE=node, NODE_NAME) for every pod on the node, which it tells apart by source
// address (outbound) and original destination (inbound). TestNetnsInPod is the in-pod
// topology that replaces it where istio-cni runs.
func TestNetnsNodeCapture(t *testing.T) {
	netnstest.Require(t, "iptables", "curl")
	leaktest.Check(t)
	bin := buildZtunnel(t)

	const (
		clientPod = "10.21.1.2"
		serverPod = "10.21.2.2"
		vip       = "10.96.0.11"
	)
	nodeA, nodeB := netnstest.New(t, "node-a"), netnstest.New(t, "node-b")
	podA, podB := netnstest.New(t, "pod-client"), netnstest.New(t, "pod-server")
	netnstest.Link(t, nodeA, "10.20.0.1/24", nodeB, "10.20.0.2/24")
	netnstest.Link(t, podA, clientPod+"/24", nodeA, "10.21.1.1/24")
	netnstest.Link(t, podB, serverPod+"/24", nodeB, "10.21.2.1/24")
	podA.MustExec(t, "ip", "route", "add", "default", "via", "10.21.1.1")
	podB.MustExec(t, "ip", "route", "add", "default", "via", "10.21.2.1")
	nodeA.MustExec(t, "ip", "route", "add", "10.21.2.0/24", "via", "10.20.0.2")
	nodeB.MustExec(t, "ip", "route", "add", "10.21.1.0/24", "via", "10.20.0.1")
	for _, n := range []*netnstest.NS{nodeA, nodeB} {
		n.MustExec(t, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
	}
	nodeRedirect(t, nodeA, "10.21.1.0/24")
	nodeRedirect(t, nodeB, "10.21.2.0/24")

	dir := t.TempDir()
	writeWorkloads(t, dir, clientPod, serverPod, vip)
	server := startPodServer(t, podB, serverPod, "8080", "8081")
	ztB := startNodeIn(t, bin, nodeB, dir, "PROXY_MODE=node", "NODE_NAME=node-b")
	ztA := startNodeIn(t, bin, nodeA, dir, "PROXY_MODE=node", "NODE_NAME=node-a")

	clientID := "spiffe://cluster.local/ns/default/sa/client"
	serverID := "spiffe://cluster.local/ns/default/sa/server"

	t.Run("pod to pod over HBONE", func(t *testing.T) {
		out := podA.MustExec(t, "curl", "-sS", "-m", "10", "--data-binary", "shared ping", "http://"+serverPod+":8080/direct")
		if want := `server pod port 8080 got POST /direct body="shared ping"`; !strings.Contains(out, want) {
			t.Errorf("curl got %q; want %q", out, want)
		}
		if got := server.count("8080"); got != 1 {
			t.Errorf("server saw %d requests on 8080; want 1", got)
		}
		// Node A picked the source workload by the pod's address and used its identity.
		waitMetric(t, nodeA, "A", "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "source", "connection_security_policy": "mutual_tls", "response_flags": "-",
			"source_workload": "client", "source_principal": clientID, "destination_principal": serverID,
		}, 1)
		// Node B served the handshake as the pod the connection was addressed to.
		waitMetric(t, nodeB, "B", "istio_tcp_connections_closed_total", map[string]string{
			"reporter": "destination", "connection_security_policy": "mutual_tls", "response_flags": "-",
			"source_principal": clientID, "destination_workload": "server", "destination_principal": serverID,
		}, 1)
	})

	t.Run("pod to service VIP over HBONE", func(t *testing.T) {
		checkVIP(t, podA, vip, func() string { return scrape(t, nodeA) })
	})

	t.Run("plaintext inbound redirected to 15006", func(t *testing.T) {
		// From node A's own namespace, which no rule captures: plain TCP arrives at node B.
		checkPlaintextInbound(t, nodeA, server, serverPod, func() string { return scrape(t, nodeB) })
	})

	t.Run("deny policy", func(t *testing.T) {
		checkDenyPolicy(t, podA, nodeA, server, serverPod)
		waitMetric(t, nodeB, "B", "istio_tcp_connections_failed_total", map[string]string{
			"reporter": "destination", "response_flags": "DENY",
		}, 2)
	})

	for name, p := range map[string]*proc{"A": ztA, "B": ztB} {
		if err := p.stop(); err != nil {
			t.Errorf("node %s after SIGTERM: %v; want exit 0", name, err)
		}
	}
}

// checkPlaintextInbound sends plain HTTP from outside the mesh (from, which no rule
// captures) to the server pod's port 8080: the server's ztunnel captures it on 15006,
// delivers it, and reports it without mTLS in the metrics scrape reads.
func checkPlaintextInbound(t *testing.T, from *netnstest.NS, server *podServer, serverIP string, scrape func() string) {
	t.Helper()
	before := server.count("8080")
	out, err := plainGet(from, 0, net.JoinHostPort(serverIP, "8080"), "/plain")
	if err != nil || !strings.Contains(out, "server pod port 8080 got GET /plain") {
		t.Errorf("plaintext GET: %v %q", err, out)
	}
	if got := server.count("8080"); got != before+1 {
		t.Errorf("server saw %d requests on 8080; want %d", got, before+1)
	}
	waitMetricFrom(t, scrape, "server's", "istio_tcp_connections_closed_total", map[string]string{
		"reporter": "destination", "connection_security_policy": "unknown", "destination_workload": "server",
	}, 1)
}

// checkDenyPolicy checks that the deny-8081 policy of writeWorkloads stops both HBONE from
// the client pod and plain TCP from outside the mesh.
func checkDenyPolicy(t *testing.T, clientPod, outside *netnstest.NS, server *podServer, serverIP string) {
	t.Helper()
	if out, err := clientPod.Exec("curl", "-sS", "-m", "10", "http://"+serverIP+":8081/denied"); err == nil || strings.Contains(string(out), "server pod") {
		t.Errorf("curl over HBONE to a denied port: %v %q; want a failure", err, out)
	}
	if out, _ := plainGet(outside, 0, serverIP+":8081", "/denied"); strings.Contains(out, "server pod") {
		t.Errorf("plaintext GET to a denied port got through: %q", out)
	}
	if got := server.count("8081"); got != 0 {
		t.Errorf("server saw %d requests on the denied port", got)
	}
}

// checkVIP sends HTTP from the client pod to the echo service's VIP: its ztunnel carries it
// over HBONE to the server pod's 8080 and reports the service in the metrics scrape reads.
func checkVIP(t *testing.T, clientPod *netnstest.NS, vip string, scrape func() string) {
	t.Helper()
	out := clientPod.MustExec(t, "curl", "-sS", "-m", "10", "http://"+vip+"/vip")
	if want := "server pod port 8080 got GET /vip"; !strings.Contains(out, want) {
		t.Errorf("curl got %q; want %q", out, want)
	}
	waitMetricFrom(t, scrape, "client's", "istio_tcp_connections_closed_total", map[string]string{
		"reporter": "source", "destination_service": "echo.default.svc.cluster.local", "connection_security_policy": "mutual_tls",
	}, 1)
}
