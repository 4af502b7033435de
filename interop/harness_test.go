//go:build linux

package interop

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/internal/child"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
)

// The two programs. A node runs one of them; goztFIPS is gozt's FIPS 140-3 build
// (GOFIPS140=v1.0.0, as make image FIPS=1 builds it), which TestFlows also runs beside the
// Rust ztunnel.
const (
	gozt     = "gozt"
	rs       = "rs"
	goztFIPS = "gozt-fips"
)

var (
	buildOnce   sync.Once
	goztBin     string // built once per test binary, into buildDir
	goztFIPSBin string // likewise, with GOFIPS140
	buildErr    error
	buildDir    string
)

func TestMain(m *testing.M) {
	flag.Parse()
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// rsBinary returns the Rust ztunnel's binary, $ZTUNNEL_RS, or "".
func rsBinary() string { return os.Getenv("ZTUNNEL_RS") }

// requirePeers skips t unless both programs can run here: the Rust ztunnel's binary by path,
// root, ip and iptables. It builds gozt's binary the first time.
func requirePeers(t *testing.T) {
	t.Helper()
	bin := rsBinary()
	if bin == "" {
		t.Skip("the Rust ztunnel's binary is needed: set ZTUNNEL_RS=/path/to/ztunnel (make interop-rs ZTUNNEL_RS=...)")
	}
	if _, err := os.Stat(bin); err != nil {
		t.Fatalf("ZTUNNEL_RS: %v", err)
	}
	netnstest.Require(t, "iptables")
	buildOnce.Do(func() {
		if buildDir, buildErr = os.MkdirTemp("", "gozt-interop-"); buildErr != nil {
			return
		}
		goztBin, goztFIPSBin = filepath.Join(buildDir, "ztunnel"), filepath.Join(buildDir, "ztunnel-fips")
		for bin, env := range map[string][]string{goztBin: nil, goztFIPSBin: {"GOFIPS140=v1.0.0"}} {
			if err := child.BuildZtunnel(context.Background(), "..", bin, false, env...); err != nil {
				buildErr = fmt.Errorf("%s %w", env, err)
				return
			}
		}
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
}

// binary returns the program's binary.
func binary(prog string) string {
	switch prog {
	case rs:
		return rsBinary()
	case goztFIPS:
		return goztFIPSBin
	}
	return goztBin
}

// pairs are the four ways to put the two programs on a client node and a server node.
var pairs = [][2]string{{gozt, gozt}, {gozt, rs}, {rs, gozt}, {rs, rs}}

func pairName(p [2]string) string { return p[0] + "-" + p[1] }

// fipsPairs put the FIPS gozt beside the Rust ztunnel, each in place of gozt in one of the
// mixed pairs, whose outcomes it must match.
var fipsPairs = []struct{ pair, as [2]string }{
	{[2]string{goztFIPS, rs}, [2]string{gozt, rs}},
	{[2]string{rs, goztFIPS}, [2]string{rs, gozt}},
}

// host is a network namespace with the sockets to reach into it from the test process.
type host struct {
	*netnstest.NS
	ip   string // its address on the veth; "" for a node namespace with loopback only
	sock netns.Sockets
}

func newHost(t *testing.T, name string) *host {
	t.Helper()
	ns := netnstest.New(t, name)
	h, err := netns.Open("/var/run/netns/" + ns.Name)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return &host{NS: ns, sock: netns.Sockets{NS: h}}
}

// link joins two hosts with a veth pair in prefix (e.g. "10.31.0"), .1 and .2.
func link(t *testing.T, a, b *host, prefix string) {
	t.Helper()
	a.ip, b.ip = prefix+".1", prefix+".2"
	netnstest.Link(t, a.NS, a.ip+"/24", b.NS, b.ip+"/24")
}

// dial connects from inside the host.
func (h *host) dial(ctx context.Context, addr string) (net.Conn, error) {
	return h.sock.Dial(ctx, &net.Dialer{Timeout: 5 * time.Second}, "tcp", addr)
}

// listen opens a TCP listener inside the host, closed when t ends.
func (h *host) listen(t *testing.T, addr string) net.Listener {
	t.Helper()
	ln, err := h.sock.Listen(context.Background(), "tcp", addr)
	if err != nil {
		t.Fatalf("listen %s in %s: %v", addr, h.Name, err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// http does one HTTP request from inside the host and returns the status and body.
func (h *host) http(ctx context.Context, method, url string) (int, string, error) {
	client := &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DisableKeepAlives: true,
		DialContext:       func(ctx context.Context, _, addr string) (net.Conn, error) { return h.dial(ctx, addr) },
	}}
	req, err := http.NewRequestWithContext(ctx, method, url, nil)
	if err != nil {
		return 0, "", err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// ca is one Istio-CA-protocol server for a test, served on 127.0.0.1:15012 inside every host
// that asks (each node reaches it on its own loopback), with the files its clients read.
type ca struct {
	srv       *catest.IstioServer
	root      *catest.Root
	rootFile  string
	tokenFile string
}

func newCA(t *testing.T) *ca {
	t.Helper()
	root := catest.NewRoot(t, "interop-root")
	cert := root.ServingCert(t, "127.0.0.1", "istiod.istio-system.svc")
	dir := t.TempDir()
	c := &ca{srv: catest.NewIstio(root, &cert), root: root,
		rootFile: filepath.Join(dir, "root-cert.pem"), tokenFile: filepath.Join(dir, "istio-token")}
	t.Cleanup(c.srv.Stop)
	if err := os.WriteFile(c.rootFile, root.PEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(c.tokenFile, []byte("interop-token"), 0o644); err != nil {
		t.Fatal(err)
	}
	return c
}

// serveIn makes the CA reachable at 127.0.0.1:15012 inside h.
func (c *ca) serveIn(t *testing.T, h *host) {
	t.Helper()
	c.srv.Serve(h.listen(t, "127.0.0.1:15012"))
}

// env is what both programs need to get certificates from c, in each one's words.
func (c *ca) env(prog string) map[string]string {
	e := map[string]string{"CA_ROOT_CA": c.rootFile, "AUTH_TOKEN": c.tokenFile, "CLUSTER_ID": "Kubernetes"}
	if prog == rs {
		e["CA_ADDRESS"] = "https://127.0.0.1:15012"
	} else {
		e["CA_PROVIDER"] = "istio"
		e["CA_ADDRESS"] = "127.0.0.1:15012"
	}
	return e
}

// node is one ztunnel process running inside a host's namespace.
type node struct {
	prog string
	host *host
	*child.Process
}

// startNode starts prog inside h with env (and the machine's environment) and waits until
// its readiness endpoint answers 200. It is stopped when t ends.
func startNode(t *testing.T, prog string, h *host, env map[string]string) *node {
	t.Helper()
	n := startProcess(t, prog, h, env)
	n.waitReady(t)
	return n
}

// startProcess starts prog inside h and returns without waiting for readiness.
func startProcess(t *testing.T, prog string, h *host, env map[string]string) *node {
	t.Helper()
	n := &node{prog: prog, host: h}
	spec := child.Spec{
		Name: prog + " node in " + h.Name,
		// ip netns exec execs the binary: the child is ztunnel itself, and
		// /etc/netns/<name>/ files (resolv.conf) are bind-mounted over /etc for it.
		Args: []string{"ip", "netns", "exec", h.Name, binary(prog)},
		Env:  os.Environ(),
		Dir:  t.TempDir(),
		Log:  filepath.Join(t.TempDir(), prog+".log"),
		// Group: SIGTERM reaches ztunnel through ip netns exec.
		Group: true,
	}
	for k, v := range env {
		spec.Env = append(spec.Env, k+"="+v)
	}
	var err error
	if n.Process, err = child.Start(spec); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		n.Stop(5 * time.Second)
		if t.Failed() {
			t.Logf("%s, log ends:\n%s", n.Name, n.Tail(40))
		}
	})
	return n
}

// logLines returns the lines of the node's output so far.
func (n *node) logLines() []string {
	return strings.Split(strings.TrimRight(n.Output(), "\n"), "\n")
}

func (n *node) waitReady(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := n.WaitReady(ctx, 100*time.Millisecond, func(context.Context) error {
		code, body, err := n.get("15021", "/healthz/ready")
		if err == nil && code != 200 {
			err = fmt.Errorf("%d %s", code, strings.TrimSpace(body))
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
}

// get fetches path from one of the node's own ports on its loopback.
func (n *node) get(port, path string) (int, string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	return n.host.http(ctx, http.MethodGet, "http://127.0.0.1:"+port+path)
}

// metrics returns the node's /metrics text.
func (n *node) metrics(t *testing.T) string {
	t.Helper()
	code, body, err := n.get("15020", "/metrics")
	if err != nil || code != 200 {
		t.Fatalf("%s /metrics: %d %v", n.prog, code, err)
	}
	return body
}

// socks5 opens a connection to target through the SOCKS5 listener at 127.0.0.1:15080 inside
// h (a CONNECT with an IPv4 address) and returns it with the reply code.
func socks5(ctx context.Context, h *host, target string) (net.Conn, byte, error) {
	c, err := h.dial(ctx, "127.0.0.1:15080")
	if err != nil {
		return nil, 0, err
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	ap, err := netip.ParseAddrPort(target)
	if err != nil {
		c.Close()
		return nil, 0, err
	}
	ip := ap.Addr().As4()
	req := []byte{5, 1, 0, 5, 1, 0, 1, ip[0], ip[1], ip[2], ip[3], byte(ap.Port() >> 8), byte(ap.Port())}
	if _, err := c.Write(req); err != nil {
		c.Close()
		return nil, 0, err
	}
	// Method selection (2 bytes), then the reply: VER REP RSV ATYP, an IPv4 or IPv6 address,
	// a port. Read exactly that: a server-first protocol's bytes may follow at once.
	var head [6]byte
	if _, err := io.ReadFull(c, head[:]); err != nil {
		c.Close()
		return nil, 0, fmt.Errorf("socks5 reply: %w", err)
	}
	if head[0] != 5 || head[1] != 0 {
		c.Close()
		return nil, 0, fmt.Errorf("socks5 method selection %v", head[:2])
	}
	rep := head[3]
	skip := 4 + 2
	if head[5] == 4 {
		skip = 16 + 2
	}
	if _, err := io.ReadFull(c, make([]byte, skip)); err != nil {
		c.Close()
		return nil, rep, fmt.Errorf("socks5 reply address: %w", err)
	}
	if rep != 0 {
		c.Close()
		return nil, rep, fmt.Errorf("socks5 reply %d", rep)
	}
	c.SetDeadline(time.Time{})
	return c, rep, nil
}

// series returns the lines of a metrics text whose name is family (with any suffix such as
// _total) and that carry every label in want.
func series(text, family string, want ...string) []string {
	var out []string
	for line := range strings.SplitSeq(text, "\n") {
		if !strings.HasPrefix(line, family) || strings.HasPrefix(line, "#") {
			continue
		}
		if !slices.ContainsFunc(want, func(w string) bool { return !strings.Contains(line, w) }) {
			out = append(out, line)
		}
	}
	return out
}
