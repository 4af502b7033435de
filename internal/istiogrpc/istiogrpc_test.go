package istiogrpc_test

import (
	"context"
	"crypto/rand"
	"crypto/rsa"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	pb "github.com/gozt/gozt/identity/ca/capb"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// The server in these tests is catest's real IstioCertificateService on loopback; an empty
// request reaches it (and is recorded) and fails with InvalidArgument, so that code means
// "connected, verified, delivered".

// call makes one call on a fresh connection, as a reconnect would, and returns the metadata
// the server saw.
func call(t *testing.T, ep *istiogrpc.Endpoint, srv *catest.IstioServer) (metadata.MD, error) {
	t.Helper()
	conn, err := grpc.NewClient(ep.Target(), grpc.WithTransportCredentials(ep.Credentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if ctx, err = ep.Outgoing(ctx); err != nil {
		return nil, err
	}
	n := len(srv.Requests())
	_, err = pb.NewIstioCertificateServiceClient(conn).CreateCertificate(ctx, &pb.IstioCertificateRequest{}, grpc.WaitForReady(false))
	if status.Code(err) != codes.InvalidArgument {
		return nil, err
	}
	reqs := srv.Requests()
	if len(reqs) != n+1 {
		t.Fatalf("server saw %d requests; want %d", len(reqs), n+1)
	}
	return reqs[n].MD, nil
}

func newEndpoint(t *testing.T, cfg istiogrpc.Config) *istiogrpc.Endpoint {
	t.Helper()
	ep, err := istiogrpc.New("XDS", cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	return ep
}

func TestAddress(t *testing.T) {
	for _, tc := range []struct {
		addr, want string
		plaintext  bool
	}{
		{"istiod.istio-system.svc:15012", "istiod.istio-system.svc:15012", false}, // Istio's chart
		{"https://istiod.istio-system.svc:15012", "istiod.istio-system.svc:15012", false},
		{"https://istiod.istio-system.svc", "istiod.istio-system.svc:15012", false},
		{"istiod.istio-system.svc", "istiod.istio-system.svc:15012", false},
		{"http://istiod.istio-system.svc:15010", "istiod.istio-system.svc:15010", true},
		{"http://istiod.istio-system.svc", "istiod.istio-system.svc:15010", true},
		{"[::1]:15012", "[::1]:15012", false},
		{"http://10.0.0.1:8080", "10.0.0.1:8080", true},
	} {
		ep := newEndpoint(t, istiogrpc.Config{Address: tc.addr, RootCA: "SYSTEM"})
		if got := ep.Addr(); got != tc.want || ep.Plaintext() != tc.plaintext {
			t.Errorf("%q: Addr %q plaintext %v; want %q %v", tc.addr, got, ep.Plaintext(), tc.want, tc.plaintext)
		}
		if got, want := ep.Target(), "passthrough:///"+tc.want; got != want {
			t.Errorf("%q: Target %q; want %q", tc.addr, got, want)
		}
	}
}

func TestConfigErrors(t *testing.T) {
	dir := t.TempDir()
	empty := filepath.Join(dir, "empty.pem")
	if err := os.WriteFile(empty, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		cfg  istiogrpc.Config
		want string
	}{
		{istiogrpc.Config{}, "ca: CA_ADDRESS"},
		{istiogrpc.Config{Address: "ftp://x:1"}, "ca: CA_ADDRESS"},
		{istiogrpc.Config{Address: "dns:///x:1"}, "ca: CA_ADDRESS"},
		{istiogrpc.Config{Address: "https://:1"}, "ca: CA_ADDRESS"},
		{istiogrpc.Config{Address: "x:1"}, "ca: CA_ROOT_CA: open " + istiogrpc.DefaultRootCA}, // the default root
		{istiogrpc.Config{Address: "x:1", RootCA: filepath.Join(dir, "missing.pem")}, "ca: CA_ROOT_CA"},
		{istiogrpc.Config{Address: "x:1", RootCA: empty}, "ca: CA_ROOT_CA"},
		{istiogrpc.Config{Address: "x:1", RootCA: "-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----"}, "ca: CA_ROOT_CA"},
	} {
		if _, err := istiogrpc.New("CA", tc.cfg, nil); err == nil || !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v; want an error starting %q", tc.cfg, err, tc.want)
		}
	}
	// Plaintext reads no root at all.
	if _, err := istiogrpc.New("CA", istiogrpc.Config{Address: "http://x:1"}, nil); err != nil {
		t.Errorf("plaintext with the default (missing) root: %v", err)
	}
}

// TestRoots: a TLS server whose certificate names istiod, on 127.0.0.1, dialed as host:port
// with no scheme.
func TestRoots(t *testing.T) {
	leaktest.Check(t)
	root := catest.NewRoot(t, "root")
	srv := catest.StartIstioTLS(t, root, "istiod.istio-system.svc")
	rootFile := root.WriteRootFile(t)
	const alt = "istiod.istio-system.svc"
	for _, tc := range []struct {
		name, rootCA, alt, wantErr string
	}{
		{"inline", string(root.PEM()), alt, ""},
		{"path", rootFile, alt, ""},
		{"no alt hostname", rootFile, "", "127.0.0.1"}, // verified against the address's host
		{"SYSTEM", "SYSTEM", alt, "unknown authority"}, // the OS roots, not no verification
	} {
		ep := newEndpoint(t, istiogrpc.Config{Address: srv.Addr, RootCA: tc.rootCA, AltHostname: tc.alt})
		if ep.Plaintext() {
			t.Fatalf("%s: %q with no scheme is plaintext; want TLS", tc.name, srv.Addr)
		}
		_, err := call(t, ep, srv)
		switch {
		case tc.wantErr == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
			t.Errorf("%s: err = %v; want one containing %q", tc.name, err, tc.wantErr)
		}
	}
}

// TestFIPSMode: in FIPS 140-3 mode (a child process, testutil.InFIPSMode) the xDS and CA
// connections still reach an istiod whose chain has approved keys (catest's P-256), and
// refuse one whose serving key is 1024-bit RSA: crypto/tls verifies these chains itself, and
// applies FIPS 140-3's key rule to them.
func TestFIPSMode(t *testing.T) {
	if !testutil.InFIPSMode(t) {
		return
	}
	leaktest.Check(t)
	root := catest.NewRoot(t, "root")
	srv := catest.StartIstioTLS(t, root, "127.0.0.1")
	ep := newEndpoint(t, istiogrpc.Config{Address: srv.Addr, RootCA: root.WriteRootFile(t)})
	if _, err := call(t, ep, srv); err != nil {
		t.Fatalf("P-256 chain: %v", err)
	}
	key, err := rsa.GenerateKey(rand.Reader, 1024)
	if err != nil {
		t.Fatal(err)
	}
	srv.SetTLSCert(root.ServingCertKey(t, key, "127.0.0.1"))
	if _, err := call(t, ep, srv); err == nil || !strings.Contains(err.Error(), "no FIPS compatible certificate chains found") {
		t.Fatalf("1024-bit RSA serving key: err = %v; want no FIPS compatible chain", err)
	}
}

// TestRootFileReread: the root file is read at each handshake, so the same Endpoint follows
// a rotation on its next connection.
func TestRootFileReread(t *testing.T) {
	leaktest.Check(t)
	signer, oldRoot, newRoot := catest.NewRoot(t, "signer"), catest.NewRoot(t, "old"), catest.NewRoot(t, "new")
	cert := oldRoot.ServingCert(t, "127.0.0.1")
	srv := catest.StartIstio(t, signer, &cert)
	rootFile := oldRoot.WriteRootFile(t)
	ep := newEndpoint(t, istiogrpc.Config{Address: srv.Addr, RootCA: rootFile})
	if _, err := call(t, ep, srv); err != nil {
		t.Fatal(err)
	}
	srv.SetTLSCert(newRoot.ServingCert(t, "127.0.0.1"))
	if _, err := call(t, ep, srv); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Fatalf("server on the new root, file on the old: err = %v; want unknown authority", err)
	}
	if err := os.WriteFile(rootFile, newRoot.PEM(), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := call(t, ep, srv); err != nil {
		t.Fatalf("after the file was rewritten: %v", err)
	}
	if err := os.WriteFile(rootFile, []byte("garbage"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := call(t, ep, srv); err == nil || !strings.Contains(err.Error(), "XDS_ROOT_CA") {
		t.Fatalf("root file without a certificate: err = %v; want an XDS_ROOT_CA error", err)
	}
}

func TestMetadata(t *testing.T) {
	leaktest.Check(t)
	srv := catest.StartIstio(t, catest.NewRoot(t, "root"), nil)
	tok := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tok, []byte("tok-1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		cfg  istiogrpc.Config
		want map[string]string // "" = absent
	}{
		{"defaults", istiogrpc.Config{}, map[string]string{"clusterid": istiogrpc.DefaultClusterID, "authorization": ""}},
		{"set", istiogrpc.Config{ClusterID: "c1", TokenFile: tok, Headers: map[string]string{"X-Extra": "v"}},
			map[string]string{"clusterid": "c1", "x-extra": "v", "authorization": "Bearer tok-1"}},
		{"header replaces clusterid, token replaces authorization",
			istiogrpc.Config{ClusterID: "c1", TokenFile: tok, Headers: map[string]string{"clusterid": "c2", "authorization": "x"}},
			map[string]string{"clusterid": "c2", "authorization": "Bearer tok-1"}},
		{"missing token file", istiogrpc.Config{TokenFile: tok + ".missing"}, map[string]string{"authorization": ""}},
	} {
		tc.cfg.Address = "http://" + srv.Addr
		md, err := call(t, newEndpoint(t, tc.cfg), srv)
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		for k, want := range tc.want {
			got := md.Get(k)
			if (want == "" && len(got) != 0) || (want != "" && (len(got) != 1 || got[0] != want)) {
				t.Errorf("%s: %s = %q; want %q", tc.name, k, got, want)
			}
		}
	}
}
