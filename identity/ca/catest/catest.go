// Package catest holds test parts for code that needs a CA: a signing root, and a real
// istio.v1.auth.IstioCertificateService gRPC server on loopback that signs with it.
//
// It is for tests, and for zbench's suite, whose namespace paths take their certificates
// from one IstioServer (bench/meshca.go); nothing in the ztunnel binary imports it.
package catest

import (
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	pb "github.com/gozt/gozt/identity/ca/capb"
)

// Root is an ECDSA P-256 CA for tests: self-signed, or an intermediate made by Intermediate.
type Root struct {
	Cert *x509.Certificate
	Key  *ecdsa.PrivateKey

	parent *Root // the CA that signed Cert; nil when self-signed
}

// NewRoot generates a root named name, valid from an hour ago for ten years.
func NewRoot(tb testing.TB, name string) *Root {
	tb.Helper()
	r, err := GenerateRoot(name)
	if err != nil {
		tb.Fatal(err)
	}
	return r
}

// GenerateRoot is NewRoot for callers that are not tests (the load generator's CA).
func GenerateRoot(name string) (*Root, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &Root{Cert: cert, Key: key}, nil
}

// Intermediate returns a CA named name signed by r and valid from notBefore to notAfter.
// Leaves it issues carry it (and any intermediate above it) in their chain; the roots are
// the self-signed CA at the top.
func (r *Root) Intermediate(tb testing.TB, name string, notBefore, notAfter time.Time) *Root {
	tb.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		tb.Fatal(err)
	}
	der, err := x509.CreateCertificate(rand.Reader, &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: name},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}, r.Cert, key.Public(), r.Key)
	if err != nil {
		tb.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		tb.Fatal(err)
	}
	return &Root{Cert: cert, Key: key, parent: r}
}

// chain returns the intermediates from r up to, not including, the self-signed top, and the top.
func (r *Root) chain() (inter []*x509.Certificate, top *Root) {
	for top = r; top.parent != nil; top = top.parent {
		inter = append(inter, top.Cert)
	}
	return inter, top
}

// WriteRootFile writes r's PEM to root-cert.pem in a fresh directory and returns its path,
// as CA_ROOT_CA or XDS_ROOT_CA name it.
func (r *Root) WriteRootFile(tb testing.TB) string {
	tb.Helper()
	path := filepath.Join(tb.TempDir(), "root-cert.pem")
	if err := os.WriteFile(path, r.PEM(), 0o600); err != nil {
		tb.Fatal(err)
	}
	return path
}

// WriteCACerts writes Istio's cacerts layout for r (ca-cert.pem and ca-key.pem; its chain
// up to the self-signed top in cert-chain.pem; the top in root-cert.pem) to a fresh
// directory and returns it.
func (r *Root) WriteCACerts(tb testing.TB) string {
	tb.Helper()
	key, err := x509.MarshalECPrivateKey(r.Key)
	if err != nil {
		tb.Fatal(err)
	}
	inter, top := r.chain()
	chain := ""
	for _, c := range append(inter, top.Cert) {
		chain += certPEM(c)
	}
	dir := tb.TempDir()
	for name, data := range map[string]string{
		ca.CACertFile:    certPEM(r.Cert),
		ca.CAKeyFile:     string(pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: key})),
		ca.RootCertFile:  certPEM(top.Cert),
		ca.CertChainFile: chain,
	} {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(data), 0o600); err != nil {
			tb.Fatal(err)
		}
	}
	return dir
}

func serial() *big.Int {
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	return n
}

// PEM returns the CA certificate as PEM.
func (r *Root) PEM() []byte {
	return []byte(certPEM(r.Cert))
}

// sign issues a leaf for pub with the given URI SAN and validity, from the template the
// built-in CA uses (ca.LeafTemplate).
func (r *Root) sign(pub any, uri string, notBefore, notAfter time.Time) (*x509.Certificate, error) {
	u, err := url.Parse(uri)
	if err != nil {
		return nil, err
	}
	der, err := x509.CreateCertificate(rand.Reader, ca.LeafTemplate(u, notBefore, notAfter), r.Cert, pub, r.Key)
	if err != nil {
		return nil, err
	}
	return x509.ParseCertificate(der)
}

// Issue returns a leaf for id with the given validity and its key, with r's intermediates
// in the chain and the self-signed top as bundle.
// Unlike a real CA it does not refuse odd validities: tests use it for expired leaves.
func (r *Root) Issue(tb testing.TB, id identity.ID, notBefore, notAfter time.Time) *ca.Issued {
	tb.Helper()
	iss, err := r.IssueErr(id, notBefore, notAfter)
	if err != nil {
		tb.Fatal(err)
	}
	return iss
}

// IssueErr is Issue for use off the test goroutine.
func (r *Root) IssueErr(id identity.ID, notBefore, notAfter time.Time) (*ca.Issued, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	return r.issueKey(id, key, notBefore, notAfter)
}

// IssueKey is Issue for a leaf carrying key (RSA, Ed25519, another curve: what a CA with
// other keys than Istio's issues), valid from a minute ago for an hour.
func (r *Root) IssueKey(tb testing.TB, id identity.ID, key crypto.Signer) *ca.Issued {
	tb.Helper()
	now := time.Now()
	iss, err := r.issueKey(id, key, now.Add(-time.Minute), now.Add(time.Hour))
	if err != nil {
		tb.Fatal(err)
	}
	return iss
}

func (r *Root) issueKey(id identity.ID, key crypto.Signer, notBefore, notAfter time.Time) (*ca.Issued, error) {
	leaf, err := r.sign(key.Public(), id.String(), notBefore, notAfter)
	if err != nil {
		return nil, err
	}
	inter, top := r.chain()
	der := [][]byte{leaf.Raw}
	for _, c := range inter {
		der = append(der, c.Raw)
	}
	return &ca.Issued{
		Certificate: tls.Certificate{Certificate: der, PrivateKey: key, Leaf: leaf},
		Roots:       []*x509.Certificate{top.Cert},
		NotBefore:   leaf.NotBefore,
		NotAfter:    leaf.NotAfter,
	}, nil
}

// CRL returns a PEM certificate revocation list signed by r that revokes serials, as an
// operator's CA publishes it for CRL_PATH.
func (r *Root) CRL(tb testing.TB, serials ...*big.Int) []byte {
	tb.Helper()
	tmpl := &x509.RevocationList{Number: serial(), ThisUpdate: time.Now().Add(-time.Minute), NextUpdate: time.Now().Add(time.Hour)}
	for _, s := range serials {
		tmpl.RevokedCertificateEntries = append(tmpl.RevokedCertificateEntries, x509.RevocationListEntry{SerialNumber: s, RevocationTime: time.Now().Add(-time.Minute)})
	}
	der, err := x509.CreateRevocationList(rand.Reader, tmpl, r.Cert, r.Key)
	if err != nil {
		tb.Fatal(err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "X509 CRL", Bytes: der})
}

// ServingCert returns a TLS server certificate for the given DNS names and IPs.
func (r *Root) ServingCert(tb testing.TB, names ...string) tls.Certificate {
	tb.Helper()
	c, err := r.NewServingCert(names...)
	if err != nil {
		tb.Fatal(err)
	}
	return c
}

// NewServingCert is ServingCert for callers that are not tests.
func (r *Root) NewServingCert(names ...string) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	return r.servingCert(key, names)
}

// ServingCertKey is ServingCert carrying key (an RSA key, say).
func (r *Root) ServingCertKey(tb testing.TB, key crypto.Signer, names ...string) tls.Certificate {
	tb.Helper()
	c, err := r.servingCert(key, names)
	if err != nil {
		tb.Fatal(err)
	}
	return c
}

func (r *Root) servingCert(key crypto.Signer, names []string) (tls.Certificate, error) {
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, r.Cert, key.Public(), r.Key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// ClientFunc adapts a function to ca.Client.
type ClientFunc func(ctx context.Context, id identity.ID) (*ca.Issued, error)

var _ ca.Client = ClientFunc(nil)

// Fetch calls f.
func (f ClientFunc) Fetch(ctx context.Context, id identity.ID) (*ca.Issued, error) { return f(ctx, id) }

// Close does nothing.
func (f ClientFunc) Close() error { return nil }

// Request is what the Istio server saw in one CreateCertificate call.
type Request struct {
	CSR          *x509.CertificateRequest
	TTL          time.Duration
	Impersonated string // ImpersonatedIdentity metadata, "" if absent
	MD           metadata.MD
}

// IstioServer is a real IstioCertificateService on a loopback port signing with a Root;
// with an intermediate, its answer holds the leaf, the intermediates, then the top root.
type IstioServer struct {
	pb.UnimplementedIstioCertificateServiceServer
	Addr string // 127.0.0.1:port, from StartIstio; "" from NewIstio

	root *Root
	srv  *grpc.Server

	mu       sync.Mutex
	requests []Request
	fail     error
	auth     func(ctx context.Context, authorization string) error
	override string // URI to sign instead of the CSR's
	extra    []*x509.Certificate
	tlsCert  *tls.Certificate
	stopOnce sync.Once
	serving  sync.WaitGroup // one per Serve
}

// StartIstio starts the server; tlsCert nil means plaintext (reach it at http://Addr). It is
// stopped when tb ends.
func StartIstio(tb testing.TB, root *Root, tlsCert *tls.Certificate) *IstioServer {
	tb.Helper()
	return StartIstioAt(tb, "127.0.0.1:0", root, tlsCert)
}

// StartIstioAt is StartIstio listening on addr: a test that stops the server and starts
// another on the same Addr has its clients see the CA go down and come back. Binding is
// retried for a second while the old socket goes.
func StartIstioAt(tb testing.TB, addr string, root *Root, tlsCert *tls.Certificate) *IstioServer {
	tb.Helper()
	var ln net.Listener
	var err error
	for range 50 {
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		tb.Fatal(err)
	}
	s := NewIstio(root, tlsCert)
	s.Addr = ln.Addr().String()
	s.Serve(ln)
	tb.Cleanup(s.Stop)
	return s
}

// NewIstio returns a server that serves no listener yet (see Serve); tlsCert nil means
// plaintext. Its owner calls Stop.
func NewIstio(root *Root, tlsCert *tls.Certificate) *IstioServer {
	s := &IstioServer{root: root, tlsCert: tlsCert}
	var opts []grpc.ServerOption
	if tlsCert != nil {
		opts = append(opts, grpc.Creds(credentials.NewTLS(&tls.Config{
			GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
				s.mu.Lock()
				defer s.mu.Unlock()
				return s.tlsCert, nil
			},
		})))
	}
	s.srv = grpc.NewServer(opts...)
	pb.RegisterIstioCertificateServiceServer(s.srv, s)
	return s
}

// Serve serves ln until Stop, in a goroutine Stop waits for. One server may serve several
// listeners, such as one inside each network namespace of a test topology.
func (s *IstioServer) Serve(ln net.Listener) {
	s.serving.Add(1)
	go func() {
		defer s.serving.Done()
		s.srv.Serve(ln)
	}()
}

// StartIstioTLS starts the server over TLS with a serving certificate from root for names
// (DNS names or IPs), as istiod serves on 15012.
func StartIstioTLS(tb testing.TB, root *Root, names ...string) *IstioServer {
	tb.Helper()
	cert := root.ServingCert(tb, names...)
	return StartIstio(tb, root, &cert)
}

// Stop stops the server and waits for it; it is idempotent.
func (s *IstioServer) Stop() {
	s.stopOnce.Do(func() {
		s.srv.Stop()
		s.serving.Wait()
	})
}

// SetTLSCert replaces the serving certificate for new connections.
func (s *IstioServer) SetTLSCert(c tls.Certificate) {
	s.mu.Lock()
	s.tlsCert = &c
	s.mu.Unlock()
}

// SetFail makes every call fail with err (nil restores service).
func (s *IstioServer) SetFail(err error) {
	s.mu.Lock()
	s.fail = err
	s.mu.Unlock()
}

// SetAuthenticate makes every call pass its "authorization" metadata value ("" if absent)
// to f first; an error from f fails the call with Unauthenticated, as istiod answers a token
// its TokenReview rejects. nil restores signing for any caller.
func (s *IstioServer) SetAuthenticate(f func(ctx context.Context, authorization string) error) {
	s.mu.Lock()
	s.auth = f
	s.mu.Unlock()
}

// SetOverride makes the server sign uri instead of the identity in the CSR ("" restores).
func (s *IstioServer) SetOverride(uri string) {
	s.mu.Lock()
	s.override = uri
	s.mu.Unlock()
}

// AddRoot appends an extra root to the last chain element, as istiod does during root rotation.
func (s *IstioServer) AddRoot(c *x509.Certificate) {
	s.mu.Lock()
	s.extra = append(s.extra, c)
	s.mu.Unlock()
}

// Requests returns the calls seen so far, failed ones included.
func (s *IstioServer) Requests() []Request {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]Request(nil), s.requests...)
}

// CreateCertificate signs the CSR for the validity asked (default 1h).
func (s *IstioServer) CreateCertificate(ctx context.Context, req *pb.IstioCertificateRequest) (*pb.IstioCertificateResponse, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	r := Request{TTL: time.Duration(req.GetValidityDuration()) * time.Second, MD: md}
	if v, ok := req.GetMetadata().GetFields()["ImpersonatedIdentity"]; ok {
		r.Impersonated = v.GetStringValue()
	}
	b, _ := pem.Decode([]byte(req.GetCsr()))
	if b != nil {
		r.CSR, _ = x509.ParseCertificateRequest(b.Bytes)
	}
	s.mu.Lock()
	s.requests = append(s.requests, r)
	fail, auth, override, extra := s.fail, s.auth, s.override, append([]*x509.Certificate(nil), s.extra...)
	s.mu.Unlock()
	if fail != nil {
		return nil, fail
	}
	if auth != nil {
		var authz string
		if v := md.Get("authorization"); len(v) > 0 {
			authz = v[0]
		}
		if err := auth(ctx, authz); err != nil {
			return nil, status.Errorf(codes.Unauthenticated, "authenticate: %v", err)
		}
	}
	if r.CSR == nil {
		return nil, status.Error(codes.InvalidArgument, "bad csr")
	}
	if err := r.CSR.CheckSignature(); err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "csr signature: %v", err)
	}
	if len(r.CSR.URIs) != 1 {
		return nil, status.Errorf(codes.InvalidArgument, "csr has %d URI SANs", len(r.CSR.URIs))
	}
	uri := r.CSR.URIs[0].String()
	if override != "" {
		uri = override
	}
	ttl := r.TTL
	if ttl <= 0 {
		ttl = time.Hour
	}
	now := time.Now()
	leaf, err := s.root.sign(r.CSR.PublicKey, uri, now, now.Add(ttl))
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	inter, top := s.root.chain()
	resp := &pb.IstioCertificateResponse{CertChain: []string{certPEM(leaf)}}
	for _, c := range inter {
		resp.CertChain = append(resp.CertChain, certPEM(c))
	}
	roots := certPEM(top.Cert)
	for _, c := range extra {
		roots += certPEM(c)
	}
	resp.CertChain = append(resp.CertChain, roots)
	return resp, nil
}

func certPEM(c *x509.Certificate) string {
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw}))
}

// ErrUnavailable is a ready-made SetFail value.
var ErrUnavailable = status.Error(codes.Unavailable, "catest: CA down")
