package ca_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/ca/catest"
	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/internal/leaktest"
)

var (
	idA = identity.MustParse("spiffe://cluster.local/ns/a/sa/alice")
	idB = identity.MustParse("spiffe://cluster.local/ns/b/sa/bob")
)

func newClient(t *testing.T, cfg ca.Config) ca.Client {
	t.Helper()
	c, err := ca.New(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func fetch(t *testing.T, c ca.Client, id identity.ID) (*ca.Issued, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	return c.Fetch(ctx, id)
}

func TestIstioIssue(t *testing.T) {
	leaktest.Check(t)
	root := catest.NewRoot(t, "root")
	srv := catest.StartIstio(t, root, nil)
	tok := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(tok, []byte("tok1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	c := newClient(t, ca.Config{
		Provider:  "istio",
		Config:    istiogrpc.Config{Address: "http://" + srv.Addr, TokenFile: tok, ClusterID: "c1", Headers: map[string]string{"x-extra": "v"}},
		SecretTTL: 2 * time.Hour,
	})
	iss, err := fetch(t, c, idA)
	if err != nil {
		t.Fatal(err)
	}
	if got, _ := iss.Identity(); got != idA {
		t.Errorf("leaf identity = %v; want %v", got, idA)
	}
	if len(iss.Roots) != 1 || !iss.Roots[0].Equal(root.Cert) {
		t.Errorf("roots = %d certs; want the test root", len(iss.Roots))
	}
	if life := iss.NotAfter.Sub(iss.NotBefore); life != 2*time.Hour {
		t.Errorf("lifetime = %v; want 2h", life)
	}
	if _, ok := iss.Certificate.PrivateKey.(*ecdsa.PrivateKey); !ok {
		t.Errorf("private key is %T; want ECDSA", iss.Certificate.PrivateKey)
	}
	reqs := srv.Requests()
	if len(reqs) != 1 {
		t.Fatalf("server saw %d requests; want 1", len(reqs))
	}
	r := reqs[0]
	if got := r.MD.Get("authorization"); len(got) != 1 || got[0] != "Bearer tok1" {
		t.Errorf("authorization = %q; want Bearer tok1", got)
	}
	if got := r.MD.Get("clusterid"); len(got) != 1 || got[0] != "c1" {
		t.Errorf("clusterid = %q; want c1", got)
	}
	if got := r.MD.Get("x-extra"); len(got) != 1 || got[0] != "v" {
		t.Errorf("x-extra = %q; want v", got)
	}
	if r.TTL != 2*time.Hour {
		t.Errorf("requested validity = %v; want 2h", r.TTL)
	}
	if r.Impersonated != "" {
		t.Errorf("ImpersonatedIdentity = %q without impersonation", r.Impersonated)
	}
	csr := r.CSR
	if csr.Subject.CommonName != "" || len(csr.DNSNames) != 0 || len(csr.EmailAddresses) != 0 || len(csr.IPAddresses) != 0 ||
		len(csr.URIs) != 1 || csr.URIs[0].String() != idA.String() {
		t.Errorf("csr subject %q dns %v uris %v; want only URI %s", csr.Subject, csr.DNSNames, csr.URIs, idA)
	}
	if pk, ok := csr.PublicKey.(*ecdsa.PublicKey); !ok || pk.Curve != elliptic.P256() {
		t.Errorf("csr key %T; want ECDSA P-256", csr.PublicKey)
	}

	// The token is re-read on every call (projected tokens rotate).
	if err := os.WriteFile(tok, []byte("tok2"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := fetch(t, c, idB); err != nil {
		t.Fatal(err)
	}
	if got := srv.Requests()[1].MD.Get("authorization"); len(got) != 1 || got[0] != "Bearer tok2" {
		t.Errorf("after token change authorization = %q; want Bearer tok2", got)
	}
}

// TestIstioTokenFile: AUTH_TOKEN is "ignored if missing", as the help says: no file means a
// call without authorization (a CA on its plaintext port asks for none); a path that exists
// but cannot be read is an error naming the variable.
func TestIstioTokenFile(t *testing.T) {
	leaktest.Check(t)
	srv := catest.StartIstio(t, catest.NewRoot(t, "root"), nil)
	tok := filepath.Join(t.TempDir(), "token")
	c := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr, TokenFile: tok}})
	if _, err := fetch(t, c, idA); err != nil {
		t.Fatalf("fetch without a token file: %v", err)
	}
	if got := srv.Requests()[0].MD.Get("authorization"); len(got) != 0 {
		t.Errorf("authorization = %q with no token file; want none", got)
	}
	if err := os.WriteFile(tok, []byte("tok1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := fetch(t, c, idA); err != nil {
		t.Fatal(err)
	}
	if got := srv.Requests()[1].MD.Get("authorization"); len(got) != 1 || got[0] != "Bearer tok1" {
		t.Errorf("authorization = %q once the file exists; want Bearer tok1", got)
	}
	if err := os.Remove(tok); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(tok, 0o700); err != nil {
		t.Fatal(err)
	}
	_, err := fetch(t, c, idA)
	if err == nil || !strings.Contains(err.Error(), "AUTH_TOKEN") || !strings.Contains(err.Error(), "is a directory") {
		t.Errorf("token path is a directory: err = %v; want an AUTH_TOKEN read error", err)
	}
	if n := len(srv.Requests()); n != 2 {
		t.Errorf("server saw %d requests; want none with an unreadable token", n)
	}
}

func TestIstioImpersonation(t *testing.T) {
	leaktest.Check(t)
	srv := catest.StartIstio(t, catest.NewRoot(t, "root"), nil)
	c := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr}, Impersonate: true})
	if _, err := fetch(t, c, idB); err != nil {
		t.Fatal(err)
	}
	r := srv.Requests()[0]
	if r.Impersonated != idB.String() {
		t.Errorf("ImpersonatedIdentity = %q; want %q", r.Impersonated, idB)
	}
	if got := r.MD.Get("clusterid"); len(got) != 1 || got[0] != "Kubernetes" {
		t.Errorf("default clusterid = %q; want Kubernetes", got)
	}
	if got := r.MD.Get("authorization"); len(got) != 0 {
		t.Errorf("authorization = %q with no token file", got)
	}
	if r.TTL != 24*time.Hour {
		t.Errorf("default validity = %v; want 24h", r.TTL)
	}
}

func TestIstioWrongIdentityRejected(t *testing.T) {
	leaktest.Check(t)
	srv := catest.StartIstio(t, catest.NewRoot(t, "root"), nil)
	srv.SetOverride(idB.String())
	c := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr}})
	_, err := fetch(t, c, idA)
	if err == nil || !strings.Contains(err.Error(), "asked for "+idA.String()) {
		t.Fatalf("err = %v; want leaf-is-for-other-identity error", err)
	}
}

func TestIstioUnavailable(t *testing.T) {
	leaktest.Check(t)
	srv := catest.StartIstio(t, catest.NewRoot(t, "root"), nil)
	srv.SetFail(catest.ErrUnavailable)
	c := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr}})
	if _, err := fetch(t, c, idA); err == nil || !strings.Contains(err.Error(), "CA down") {
		t.Fatalf("err = %v; want the server's error", err)
	}
	srv.SetFail(nil)
	if _, err := fetch(t, c, idA); err != nil {
		t.Fatalf("after recovery: %v", err)
	}
}

func TestIstioUnauthenticated(t *testing.T) {
	leaktest.Check(t)
	srv := catest.StartIstio(t, catest.NewRoot(t, "root"), nil)
	seen := make(chan string, 2)
	srv.SetAuthenticate(func(_ context.Context, authz string) error {
		seen <- authz
		if authz != "Bearer good" {
			return errors.New("token rejected")
		}
		return nil
	})
	tok := filepath.Join(t.TempDir(), "token")
	c := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr, TokenFile: tok}})
	for _, tc := range []struct{ token, wantErr string }{
		{"bad", "token rejected"},
		{"good", ""},
	} {
		if err := os.WriteFile(tok, []byte(tc.token), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := fetch(t, c, idA)
		if tc.wantErr == "" && err != nil || tc.wantErr != "" && (status.Code(err) != codes.Unauthenticated || !strings.Contains(err.Error(), tc.wantErr)) {
			t.Errorf("token %q: err = %v; want %q", tc.token, err, tc.wantErr)
		}
	}
	if got, want := []string{<-seen, <-seen}, []string{"Bearer bad", "Bearer good"}; !slices.Equal(got, want) {
		t.Errorf("authenticate saw %q; want %q", got, want)
	}
}

func TestIstioSeveralRoots(t *testing.T) {
	leaktest.Check(t)
	root, next := catest.NewRoot(t, "root"), catest.NewRoot(t, "next")
	srv := catest.StartIstio(t, root, nil)
	srv.AddRoot(next.Cert)
	c := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr}})
	iss, err := fetch(t, c, idA)
	if err != nil {
		t.Fatal(err)
	}
	if len(iss.Roots) != 2 || !iss.Roots[0].Equal(root.Cert) || !iss.Roots[1].Equal(next.Cert) {
		t.Errorf("got %d roots; want both roots of the last chain element", len(iss.Roots))
	}
}

// TestIstioRootRotation: the CA's serving certificate moves to a new root and CA_ROOT_CA is
// rewritten; the same client keeps working without a restart (its channel's connection
// stays up; internal/istiogrpc's TestRootFileReread shows the next connection reads the
// new file).
func TestIstioRootRotation(t *testing.T) {
	leaktest.Check(t)
	signer := catest.NewRoot(t, "signer")
	oldRoot, newRoot := catest.NewRoot(t, "old"), catest.NewRoot(t, "new")
	cert := oldRoot.ServingCert(t, "127.0.0.1")
	srv := catest.StartIstio(t, signer, &cert)
	rootFile := oldRoot.WriteRootFile(t)
	c := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "https://" + srv.Addr, RootCA: rootFile}})
	if _, err := fetch(t, c, idA); err != nil {
		t.Fatal(err)
	}

	srv.SetTLSCert(newRoot.ServingCert(t, "127.0.0.1"))
	// A fresh client that still trusts only the old root is refused: the rotation is real.
	stale := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "https://" + srv.Addr, RootCA: string(oldRoot.PEM())}})
	if _, err := fetch(t, stale, idA); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Fatalf("stale root: err = %v; want unknown authority", err)
	}
	if err := os.WriteFile(rootFile, newRoot.PEM(), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := fetch(t, c, idB); err != nil {
		t.Fatalf("after root rotation: %v", err)
	}
}

// TestIstioEndpoint: the endpoint through the CA client, as Istio's chart configures it:
// host:port with no scheme is TLS, verified against a root file and ALT_CA_HOSTNAME, with
// clusterid and CA_HEADER_* reaching the server. Without ALT_CA_HOSTNAME the address's
// host is verified; SYSTEM is the OS roots, which do not hold this test's.
func TestIstioEndpoint(t *testing.T) {
	leaktest.Check(t)
	root := catest.NewRoot(t, "root")
	srv := catest.StartIstioTLS(t, root, "istiod.istio-system.svc")
	rootFile := root.WriteRootFile(t)
	inline := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: srv.Addr, RootCA: string(root.PEM())}})
	if _, err := fetch(t, inline, idA); err == nil || !strings.Contains(err.Error(), "127.0.0.1") {
		t.Fatalf("without ALT_CA_HOSTNAME: err = %v; want a name mismatch for 127.0.0.1", err)
	}
	c := newClient(t, ca.Config{
		Provider: "istio",
		Config:   istiogrpc.Config{Address: srv.Addr, RootCA: rootFile, AltHostname: "istiod.istio-system.svc", ClusterID: "c1", Headers: map[string]string{"X-Extra": "v"}},
	})
	if _, err := fetch(t, c, idA); err != nil {
		t.Fatal(err)
	}
	md := srv.Requests()[0].MD
	if got := md.Get("clusterid"); len(got) != 1 || got[0] != "c1" {
		t.Errorf("clusterid = %q; want c1", got)
	}
	if got := md.Get("x-extra"); len(got) != 1 || got[0] != "v" {
		t.Errorf("x-extra = %q; want v", got)
	}
	system := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: srv.Addr, RootCA: "SYSTEM", AltHostname: "istiod.istio-system.svc"}})
	if _, err := fetch(t, system, idA); err == nil || !strings.Contains(err.Error(), "unknown authority") {
		t.Errorf("CA_ROOT_CA=SYSTEM: err = %v; want unknown authority", err)
	}
	inline = newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: srv.Addr, RootCA: string(root.PEM()), AltHostname: "istiod.istio-system.svc"}})
	if _, err := fetch(t, inline, idA); err != nil {
		t.Fatalf("inline root with ALT_CA_HOSTNAME: %v", err)
	}
	if n := len(srv.Requests()); n != 2 {
		t.Errorf("server saw %d requests; want 2", n)
	}
}

func TestNewErrors(t *testing.T) {
	for _, tc := range []struct {
		cfg  ca.Config
		want string
	}{
		{ca.Config{Provider: "vault"}, "CA_PROVIDER"},
		{ca.Config{Provider: "spiffe"}, "SPIFFE_ENDPOINT_SOCKET"},
		{ca.Config{Provider: "builtin"}, "CA_DIR"},
		{ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "ftp://x:1", RootCA: "SYSTEM"}}, "CA_ADDRESS"},
		{ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "https://x:1", RootCA: "/nonexistent/root.pem"}}, "CA_ROOT_CA"},
		{ca.Config{SecretTTL: -time.Second}, "SECRET_TTL"},
	} {
		c, err := ca.New(context.Background(), tc.cfg)
		if err == nil {
			c.Close()
			t.Errorf("New(%+v) succeeded; want error naming %s", tc.cfg, tc.want)
		} else if !strings.Contains(err.Error(), tc.want) {
			t.Errorf("New(%+v) = %v; want error naming %s", tc.cfg, err, tc.want)
		}
	}
}

func BenchmarkFetch(b *testing.B) {
	root := catest.NewRoot(b, "root")
	b.Run("builtin-baseline", func(b *testing.B) {
		c, err := ca.NewBuiltin(b.TempDir(), time.Hour)
		if err != nil {
			b.Fatal(err)
		}
		for b.Loop() {
			if _, err := c.Fetch(context.Background(), idA); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("istio-grpc-loopback", func(b *testing.B) {
		srv := catest.StartIstio(b, root, nil)
		c, err := ca.New(context.Background(), ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr}})
		if err != nil {
			b.Fatal(err)
		}
		defer c.Close()
		for b.Loop() {
			if _, err := c.Fetch(context.Background(), idA); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestIstioIntermediateExpiresFirst: a CA whose intermediate expires before the leaf's
// mid-life (SPIRE, a plug-in CA, istiod without minTTL) still hands out a good chain; the
// certificate is usable, and so rotated, only until that intermediate expires.
func TestIstioIntermediateExpiresFirst(t *testing.T) {
	leaktest.Check(t)
	root := catest.NewRoot(t, "root")
	now := time.Now()
	inter := root.Intermediate(t, "intermediate", now.Add(-time.Hour), now.Add(time.Hour))
	srv := catest.StartIstio(t, inter, nil)
	c := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr}}) // SECRET_TTL 24h
	iss, err := fetch(t, c, idA)
	if err != nil {
		t.Fatalf("chain with an intermediate valid for another hour: %v", err)
	}
	if n := len(iss.Certificate.Certificate); n != 2 {
		t.Errorf("chain has %d certificates; want leaf and intermediate", n)
	}
	if !iss.Certificate.Leaf.NotAfter.After(inter.Cert.NotAfter) {
		t.Fatalf("leaf ends %v, not after the intermediate's %v: the test does not test", iss.Certificate.Leaf.NotAfter, inter.Cert.NotAfter)
	}
	if !iss.NotAfter.Equal(inter.Cert.NotAfter) {
		t.Errorf("NotAfter = %v; want the intermediate's %v", iss.NotAfter, inter.Cert.NotAfter)
	}
}

// TestIstioIntermediateExpired: a chain whose intermediate has expired is refused with an
// error naming that certificate and when it expired.
func TestIstioIntermediateExpired(t *testing.T) {
	leaktest.Check(t)
	root := catest.NewRoot(t, "root")
	now := time.Now()
	inter := root.Intermediate(t, "old intermediate", now.Add(-2*time.Hour), now.Add(-time.Minute))
	srv := catest.StartIstio(t, inter, nil)
	c := newClient(t, ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + srv.Addr}})
	_, err := fetch(t, c, idA)
	want := "CA chain expired at " + inter.Cert.NotAfter.UTC().Format(time.RFC3339)
	if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "CN=old intermediate") {
		t.Fatalf("err = %v; want %q naming CN=old intermediate", err, want)
	}
}
