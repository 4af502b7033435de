//go:build linux

package interop

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/cnirules"
)

// The dedicated-mode mesh: node A serves workload default/client on 10.31.0.1 with SOCKS5,
// node B serves default/server on 10.31.0.2, each in its own namespace joined by a veth,
// with the backends below inside node B's namespace on node B's address.
const (
	meshPrefix = "10.31.0"
	clientIP   = meshPrefix + ".1"
	serverIP   = meshPrefix + ".2"
	echoVIP    = "10.31.1.1" // service echo.default.svc.cluster.local, port 80 -> 8080

	clientID = "spiffe://cluster.local/ns/default/sa/client"
	serverID = "spiffe://cluster.local/ns/default/sa/server"
)

// Backend ports on the server workload. The policies below decide by these ports.
const (
	portEcho        = "8080" // echoes, half-closes after the client does
	portServerFirst = "8081" // writes a banner before reading, then echoes
	portReset       = "8082" // reads a byte, then resets the connection
	portSHA         = "8083" // reads to EOF, answers the SHA-256 of what it read, closes
	portHalfServer  = "8084" // writes "bye", half-closes, reads to EOF, reports the count
	portNotAllowed  = "8085" // echo; no ALLOW rule names it
	portDenied      = "8086" // echo; a DENY rule names it
	portBySA        = "8087" // echo; allowed by serviceAccounts, not by principal
	portReport      = "8088" // reads until EOF or an error and reports which
	portDenyByID    = "8089" // echo; ALLOW names it, a DENY rule for the client's principal too
)

const banner = "hello from the server\n"

// packetMark is the SO_MARK both programs put on their own sockets (PACKET_MARK), so that
// the capture rules let them pass.
const packetMark = "1337"

// meshConfig is the local config both programs read, in the Rust ztunnel's shape (its
// examples/localhost.yaml; string matches as YAML tags, which is all its serde_yaml reads):
// the two workloads with the metadata istiod would send (names, revision, cluster,
// locality), the echo service, and the server namespace's policies.
var meshConfig = `workloads:
  - uid: Kubernetes//Pod/default/client
    name: client
    namespace: default
    serviceAccount: client
    trustDomain: cluster.local # the Rust ztunnel's local config has no default (spiffe:///ns/...)
    workloadName: client
    workloadType: deployment
    canonicalName: client
    canonicalRevision: v1
    clusterId: Kubernetes
    locality: {region: region-c, zone: zone-c, subzone: ""}
    workloadIps: ["` + clientIP + `"]
    protocol: HBONE
    node: node-a
    network: ""
    services: {}
  - uid: Kubernetes//Pod/default/server
    name: server
    namespace: default
    serviceAccount: server
    trustDomain: cluster.local
    workloadName: server
    workloadType: deployment
    canonicalName: server
    canonicalRevision: v1
    clusterId: Kubernetes
    locality: {region: region-s, zone: zone-s, subzone: ""}
    workloadIps: ["` + serverIP + `"]
    protocol: HBONE
    node: node-b
    network: ""
    services:
      "default/echo.default.svc.cluster.local":
        80: 8080
services:
  - name: echo
    namespace: default
    hostname: echo.default.svc.cluster.local
    vips: ["/` + echoVIP + `"]
    ports:
      80: 8080
policies:
  - name: allow-client
    namespace: default
    scope: Namespace
    action: Allow
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/default/sa/client"]
        - - destinationPorts: [8080, 8081, 8082, 8083, 8084, 8086, 8088, 8089]
      - - - serviceAccounts: [{namespace: default, serviceAccount: client}]
        - - destinationPorts: [8087]
  - name: deny-8086
    namespace: default
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - namespaces: [!Exact default]
        - - destinationPorts: [8086]
  - name: deny-client-8089
    namespace: default
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - principals: [!Exact "cluster.local/ns/default/sa/client"]
        - - destinationPorts: [8089]
  - name: deny-strangers
    namespace: default
    scope: Namespace
    action: Deny
    dryRun: false
    rules:
      - - - notPrincipals: [!Prefix "cluster.local/ns/default/"]
`

// mesh is one dedicated-mode pair of nodes and what they share.
type mesh struct {
	a, b       *host
	ca         *ca
	config     string
	nodeA      *node
	nodeB      *node
	halfServer chan int    // bytes portHalfServer read after its half-close
	reported   chan string // how portReport's reads ended (errKind)
}

// newHosts builds node A's and node B's namespaces joined by a veth, the CA (served inside
// both) and the config file, and starts nothing.
func newHosts(t *testing.T) *mesh {
	t.Helper()
	m := &mesh{a: newHost(t, "ia"), b: newHost(t, "ib"), ca: newCA(t), halfServer: make(chan int, 16), reported: make(chan string, 16)}
	link(t, m.a, m.b, meshPrefix)
	m.ca.serveIn(t, m.a)
	m.ca.serveIn(t, m.b)
	m.config = writeConfig(t, meshConfig)
	return m
}

// newMesh builds newHosts and the backends, and starts the pair, each node with env added to
// its environment.
func newMesh(t *testing.T, pair [2]string, env ...string) *mesh {
	t.Helper()
	m := newHosts(t)
	m.serveBackends(t)
	// Dedicated capture on node A, as next to a sidecar-like ztunnel: TCP the client
	// workload dials to another host goes to 15001 unless it carries ztunnel's mark.
	for _, rule := range cnirules.Redirect(packetMark, "127.0.0.0/8", "9999") {
		m.a.MustExec(t, append([]string{"iptables", "-w", "-t", "nat"}, rule...)...)
	}
	envB, envA := m.dedicatedEnv(pair[1], "node-b", "default/server/server"), m.dedicatedEnv(pair[0], "node-a", "default/client/client")
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		envA[k], envB[k] = v, v
	}
	m.nodeB = startNode(t, pair[1], m.b, envB)
	m.nodeA = startNode(t, pair[0], m.a, envA)
	return m
}

// writeConfig writes a local config file both programs read and returns its path.
func writeConfig(t *testing.T, yaml string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "config.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// dedicatedEnv is one node's environment: dedicated mode for workload (ns/name/sa), the
// mesh's config, the shared CA, SOCKS5 on.
func (m *mesh) dedicatedEnv(prog, nodeName, workload string) map[string]string {
	e := m.ca.env(prog)
	for k, v := range map[string]string{
		"PROXY_MODE":             "dedicated",
		"PROXY_WORKLOAD_INFO":    workload,
		"NODE_NAME":              nodeName,
		"XDS_ADDRESS":            "",
		"LOCAL_XDS_PATH":         m.config,
		"UNSTABLE_ENABLE_SOCKS5": "true",
		"PACKET_MARK":            packetMark,
		// The Rust ztunnel spoofs the client's address toward the backend unless told not
		// to; replies to it would leave over the veth, as no in-pod routes bring them back
		// here. gozt's default is off (docs/CONFIGURATION.md): both say it.
		"ENABLE_ORIG_SRC": "false",
		"RUST_LOG":        "info",
	} {
		e[k] = v
	}
	return e
}

// serveBackends starts node B's backends; they run until t ends.
func (m *mesh) serveBackends(t *testing.T) {
	t.Helper()
	serve := func(port string, handle func(c *net.TCPConn)) {
		serveConns(m.b.listen(t, net.JoinHostPort(serverIP, port)), handle)
	}
	for _, p := range []string{portEcho, portNotAllowed, portDenied, portBySA, portDenyByID} {
		serve(p, echo)
	}
	serve(portServerFirst, func(c *net.TCPConn) {
		io.WriteString(c, banner)
		echo(c)
	})
	serve(portReset, func(c *net.TCPConn) {
		c.Read(make([]byte, 1))
		c.SetLinger(0) // Close sends RST
	})
	serve(portSHA, func(c *net.TCPConn) {
		h := sha256.New()
		io.Copy(h, c)
		io.WriteString(c, hex.EncodeToString(h.Sum(nil)))
	})
	serve(portReport, func(c *net.TCPConn) {
		_, err := io.Copy(io.Discard, c)
		if err == nil {
			err = io.EOF // io.Copy's clean end
		}
		m.reported <- errKind(err)
	})
	serve(portHalfServer, func(c *net.TCPConn) {
		io.WriteString(c, "bye")
		c.CloseWrite()
		n, _ := io.Copy(io.Discard, c)
		m.halfServer <- int(n)
	})
}

// serveConns runs handle on each connection ln accepts, in a goroutine of its own, until ln
// is closed (at the test's end); handle's connection is closed when it returns.
func serveConns(ln net.Listener, handle func(c *net.TCPConn)) {
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				handle(c.(*net.TCPConn))
			}()
		}
	}()
}

// echo is a backend that writes back what it reads and half-closes after the client does.
func echo(c *net.TCPConn) {
	io.Copy(c, c)
	c.CloseWrite()
}

// dial opens a connection from the client workload to addr through node A's SOCKS5.
func (m *mesh) dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, _, err := socks5(context.Background(), m.a, addr)
	if err != nil {
		t.Fatalf("socks5 %s: %v", addr, err)
	}
	t.Cleanup(func() { c.Close() })
	c.SetDeadline(time.Now().Add(30 * time.Second))
	return c
}

// roundTrip reports whether a short message to addr through node A comes back: what the
// client sees of a connection the destination allows ("ok") or refuses ("refused: ...").
func (m *mesh) roundTrip(addr string) string {
	c, rep, err := socks5(context.Background(), m.a, addr)
	if err != nil {
		return "refused: socks5 reply " + socksReply(rep)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	// Closed or reset after a SOCKS5 success is one outcome: which of the two a client sees
	// of a refused tunnel varies with timing.
	if _, err := io.WriteString(c, "ping"); err != nil {
		return "refused: closed after socks5 reply succeeded"
	}
	got := make([]byte, 4)
	if _, err := io.ReadFull(c, got); err != nil {
		return "refused: closed after socks5 reply succeeded"
	}
	if string(got) != "ping" {
		return "wrong bytes " + string(got)
	}
	return "ok"
}

func socksReply(rep byte) string {
	switch rep {
	case 0:
		return "succeeded"
	case 2:
		return "not allowed"
	case 3:
		return "network unreachable"
	case 4:
		return "host unreachable"
	case 5:
		return "refused"
	default:
		return "general failure"
	}
}

// errKind names what a client sees when a connection ends: "eof" or "reset", else the error.
func errKind(err error) string {
	switch {
	case err == nil:
		return "none"
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "eof"
	case errors.Is(err, syscall.ECONNRESET):
		return "reset"
	default:
		return err.Error()
	}
}

// send writes n pseudo-random bytes to c, half-closes it and returns their SHA-256.
func send(c net.Conn, n int64, seed uint64) (string, error) {
	h := sha256.New()
	if _, err := io.Copy(io.MultiWriter(c, h), io.LimitReader(rand.NewChaCha8([32]byte{byte(seed)}), n)); err != nil {
		return "", err
	}
	return hex.EncodeToString(h.Sum(nil)), c.(interface{ CloseWrite() error }).CloseWrite()
}

// stream writes n pseudo-random bytes to c while reading what comes back, and returns the
// SHA-256 of both.
func stream(c net.Conn, n int64, seed uint64) (sent, got string, err error) {
	hg := sha256.New()
	done := make(chan error, 1)
	go func() {
		var err error
		sent, err = send(c, n, seed)
		done <- err
	}()
	_, rerr := io.Copy(hg, c)
	werr := <-done
	return sent, hex.EncodeToString(hg.Sum(nil)), errors.Join(werr, rerr)
}

// sumSeries adds up the values of the series of family carrying every label in want.
func sumSeries(text, family string, want ...string) float64 {
	var sum float64
	for _, line := range series(text, family, want...) {
		if i := strings.LastIndexByte(line, ' '); i >= 0 {
			v, _ := strconv.ParseFloat(line[i+1:], 64)
			sum += v
		}
	}
	return sum
}

// hasSeries reports whether text has a series of family carrying every label in want.
func hasSeries(text, family string, want ...string) bool {
	return len(series(text, family, want...)) > 0
}

func labels(kv ...string) []string {
	var out []string
	for i := 0; i+1 < len(kv); i += 2 {
		out = append(out, kv[i]+`="`+kv[i+1]+`"`)
	}
	return out
}

// eventually polls cond for up to 10 s.
func eventually(cond func() bool) bool {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		if cond() {
			return true
		}
	}
	return false
}

// trimLog shortens a value for a failure message.
func trimLog(s string) string {
	if len(s) > 300 {
		return s[:300] + "..."
	}
	return strings.TrimSpace(s)
}
