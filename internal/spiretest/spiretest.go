// Package spiretest runs a real SPIRE server and agent for tests: the spire-server and
// spire-agent binaries that `make spire-tools` builds into .tools/ from SPIRE's own Go module
// (tools/spire). The server attests the agent with a join token and keeps its data in SQLite;
// the agent attests workloads with its unix attestor (uid, gid and the program's path:
// ProgramSelector) and serves the Delegated Identity API on its admin socket, to the
// delegates its configuration names.
//
// Without the binaries a test skips, saying how to build them (under CI=true it fails).
package spiretest

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/testutil"
)

// TrustDomain is the SPIRE server's trust domain: the mesh's default.
const TrustDomain = "cluster.local"

// NodeID is the SPIFFE ID the agent's join token gives its node: the parent of every
// workload entry.
const NodeID = "spiffe://" + TrustDomain + "/node/test"

// SPIRE is a running server and agent, stopped when the test ends.
type SPIRE struct {
	Dir         string // configuration, data and sockets
	AdminSocket string // the agent's admin socket (Delegated Identity API)
	server      string // spire-server binary
	serverSock  string
}

// Binaries returns the paths of spire-server and spire-agent in the repository's .tools/,
// skipping t (failing it under CI=true) when either is missing.
func Binaries(t testing.TB) (server, agent string) {
	t.Helper()
	root, err := repoRoot()
	if err == nil {
		server, agent = filepath.Join(root, ".tools", "spire-server"), filepath.Join(root, ".tools", "spire-agent")
		for _, b := range []string{server, agent} {
			if _, err = os.Stat(b); err != nil {
				break
			}
		}
	}
	if err != nil {
		msg := fmt.Sprintf("no SPIRE server and agent (%v): run `make spire-tools`, which builds them into .tools/ from SPIRE's Go module (tools/spire)", err)
		if os.Getenv("CI") == "true" {
			t.Fatal(msg)
		}
		t.Skip(msg)
	}
	return server, agent
}

// repoRoot is the directory of the module's go.mod above the working directory.
func repoRoot() (string, error) {
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		if b, err := os.ReadFile(filepath.Join(dir, "go.mod")); err == nil && bytes.HasPrefix(b, []byte("module github.com/gozt/gozt\n")) {
			return dir, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", fmt.Errorf("no gozt go.mod above the working directory")
		}
		dir = parent
	}
}

// Start runs a server and an agent whose authorized_delegates are delegates (SPIFFE IDs),
// and returns once the agent is healthy. The agent syncs with the server every second, so an
// entry registered or deleted reaches it within about a second.
func Start(t testing.TB, delegates ...string) *SPIRE {
	t.Helper()
	serverBin, agentBin := Binaries(t)
	dir, err := os.MkdirTemp("", "spire") // short: unix socket paths are limited to 108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	s := &SPIRE{Dir: dir, server: serverBin, serverSock: filepath.Join(dir, "server.sock"),
		AdminSocket: filepath.Join(dir, "private", "admin.sock")}
	for _, d := range []string{"server", "agent", "public", "private"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			t.Fatal(err)
		}
	}
	port := freePort(t)
	write(t, filepath.Join(dir, "server.conf"), fmt.Sprintf(`server {
	bind_address = "127.0.0.1"
	bind_port = "%d"
	socket_path = %q
	trust_domain = %q
	data_dir = %q
	log_level = "WARN"
	ca_key_type = "ec-p256"
	default_x509_svid_ttl = "1h"
}
plugins {
	DataStore "sql" {
		plugin_data {
			database_type = "sqlite3"
			connection_string = %q
		}
	}
	NodeAttestor "join_token" {
		plugin_data {}
	}
	KeyManager "memory" {
		plugin_data {}
	}
}
`, port, s.serverSock, TrustDomain, filepath.Join(dir, "server"), filepath.Join(dir, "server", "datastore.sqlite3")))
	run(t, "spire-server", serverBin, "run", "-config", filepath.Join(dir, "server.conf"))
	waitHealthy(t, serverBin, s.serverSock)

	out := s.Server(t, "token", "generate", "-spiffeID", NodeID)
	token, ok := strings.CutPrefix(strings.TrimSpace(out), "Token: ")
	if !ok {
		t.Fatalf("spire-server token generate: %q", out)
	}
	quoted := make([]string, len(delegates))
	for i, d := range delegates {
		quoted[i] = strconv.Quote(d)
	}
	agentSock := filepath.Join(dir, "public", "agent.sock")
	write(t, filepath.Join(dir, "agent.conf"), fmt.Sprintf(`agent {
	data_dir = %q
	log_level = "WARN"
	server_address = "127.0.0.1"
	server_port = "%d"
	socket_path = %q
	admin_socket_path = %q
	trust_domain = %q
	insecure_bootstrap = true
	join_token = %q
	authorized_delegates = [%s]
	experimental {
		sync_interval = "1s"
	}
}
plugins {
	NodeAttestor "join_token" {
		plugin_data {}
	}
	KeyManager "memory" {
		plugin_data {}
	}
	WorkloadAttestor "unix" {
		plugin_data {
			discover_workload_path = true
			workload_size_limit = -1
		}
	}
}
`, filepath.Join(dir, "agent"), port, agentSock, s.AdminSocket, TrustDomain, token, strings.Join(quoted, ", ")))
	run(t, "spire-agent", agentBin, "run", "-config", filepath.Join(dir, "agent.conf"))
	waitHealthy(t, agentBin, agentSock)
	return s
}

// Server runs a spire-server command against the server's socket and returns its output.
func (s *SPIRE) Server(t testing.TB, args ...string) string {
	t.Helper()
	out, err := exec.Command(s.server, append(args[:len(args):len(args)], "-socketPath", s.serverSock)...).CombinedOutput()
	if err != nil {
		t.Fatalf("spire-server %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// Register creates the workload entry id for spiffeID on the test node, matching workloads
// with every one of selectors ("type:value:..."); ttl, if not zero, is its SVIDs' lifetime.
func (s *SPIRE) Register(t testing.TB, id, spiffeID string, ttl time.Duration, selectors ...string) {
	t.Helper()
	args := []string{"entry", "create", "-entryID", id, "-parentID", NodeID, "-spiffeID", spiffeID}
	if ttl != 0 {
		args = append(args, "-x509SVIDTTL", strconv.Itoa(int(ttl.Seconds())))
	}
	for _, sel := range selectors {
		args = append(args, "-selector", sel)
	}
	s.Server(t, args...)
}

// ProgramSelector is the selector the agent's unix attestor gives a process running the
// program at path ("": this test's binary), so that an entry can name one program of the
// machine's processes: the test's process, not a ztunnel binary it starts.
func ProgramSelector(t testing.TB, path string) string {
	t.Helper()
	if path == "" {
		var err error
		if path, err = os.Executable(); err != nil {
			t.Fatal(err)
		}
	}
	path, err := filepath.EvalSymlinks(path)
	if err != nil {
		t.Fatal(err)
	}
	return "unix:path:" + path
}

// Delete deletes entry id.
func (s *SPIRE) Delete(t testing.TB, id string) {
	t.Helper()
	s.Server(t, "entry", "delete", "-entryID", id)
}

// Bundle is the trust domain's X.509 bundle.
func (s *SPIRE) Bundle(t testing.TB) []*x509.Certificate {
	t.Helper()
	rest := []byte(s.Server(t, "bundle", "show"))
	var out []*x509.Certificate
	for {
		var b *pem.Block
		if b, rest = pem.Decode(rest); b == nil {
			break
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		t.Fatal("spire-server bundle show: no certificate")
	}
	return out
}

// run starts a SPIRE process, stopped (and its output shown on failure) when the test ends.
func run(t testing.TB, name, bin string, args ...string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	var out lockedBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %s: %v", name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%s output:\n%s", name, out.String())
		}
	})
}

// waitHealthy waits until `bin healthcheck` passes on socket.
func waitHealthy(t testing.TB, bin, socket string) {
	t.Helper()
	err := testutil.Poll(60*time.Second, func() error {
		out, err := exec.Command(bin, "healthcheck", "-socketPath", socket).CombinedOutput()
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})
	if err != nil {
		t.Fatalf("%s not healthy: %v", filepath.Base(bin), err)
	}
}

func freePort(t testing.TB) int {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port
}

func write(t testing.TB, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
}

// lockedBuffer is a process's output, written by its pipes' goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
