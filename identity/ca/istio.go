package ca

import (
	"cmp"
	"context"
	"crypto"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/gozt/gozt/identity"
	pb "github.com/gozt/gozt/identity/ca/capb"
	"github.com/gozt/gozt/internal/istiogrpc"
)

// istioClient speaks istio.v1.auth.IstioCertificateService over one gRPC channel. The
// endpoint (internal/istiogrpc) reads a CA_ROOT_CA file again at every TLS handshake, so a
// rotated istiod root applies to the channel's next connection without a restart and
// without a watcher goroutine.
type istioClient struct {
	cfg Config
	ep  *istiogrpc.Endpoint

	mu     sync.Mutex
	conn   *grpc.ClientConn // guarded by mu
	closed bool             // guarded by mu
}

func newIstio(cfg Config) (*istioClient, error) {
	endpoint := cfg.Config
	endpoint.Address = cmp.Or(endpoint.Address, DefaultAddress)
	ep, err := istiogrpc.New("CA", endpoint, slog.Default().With("component", "ca"))
	if err != nil {
		return nil, err
	}
	return &istioClient{cfg: cfg, ep: ep}, nil
}

// caConnectParams caps gRPC's reconnect backoff at 1 s (its default grows to 120 s): while
// the CA is away, connections of identities with no certificate fail, and together with
// the certificate manager's retry cap (certs) traffic resumes within 3 s of its return.
// Reconnecting once a second to one CA address costs nothing worth saving.
var caConnectParams = grpc.ConnectParams{
	Backoff:           backoff.Config{BaseDelay: 100 * time.Millisecond, Multiplier: 1.6, Jitter: 0.2, MaxDelay: time.Second},
	MinConnectTimeout: 5 * time.Second,
}

// connLocked returns the channel, creating it on first use.
func (c *istioClient) connLocked() (*grpc.ClientConn, error) {
	if c.closed {
		return nil, errors.New("ca: client closed")
	}
	if c.conn == nil {
		conn, err := grpc.NewClient(c.ep.Target(), grpc.WithTransportCredentials(c.ep.Credentials()), grpc.WithConnectParams(caConnectParams))
		if err != nil {
			return nil, fmt.Errorf("ca: dial %s: %w", c.ep.Addr(), err)
		}
		c.conn = conn
	}
	return c.conn, nil
}

// Fetch sends a CSR for id and checks that the leaf in the answer carries id.
func (c *istioClient) Fetch(ctx context.Context, id identity.ID) (*Issued, error) {
	if id.IsZero() {
		return nil, errors.New("ca: fetch for the zero identity")
	}
	c.mu.Lock()
	conn, err := c.connLocked()
	c.mu.Unlock()
	if err != nil {
		return nil, err
	}
	octx, err := c.ep.Outgoing(ctx)
	if err != nil {
		return nil, err
	}
	key, err := newKey()
	if err != nil {
		return nil, err
	}
	csr, err := NewCSR(key, id)
	if err != nil {
		return nil, err
	}
	req := &pb.IstioCertificateRequest{Csr: string(csr), ValidityDuration: int64(c.cfg.SecretTTL / time.Second)}
	if c.cfg.Impersonate {
		req.Metadata = &structpb.Struct{Fields: map[string]*structpb.Value{
			"ImpersonatedIdentity": structpb.NewStringValue(id.String()),
		}}
	}
	resp, err := pb.NewIstioCertificateServiceClient(conn).CreateCertificate(octx, req)
	if err != nil {
		return nil, fmt.Errorf("ca: create certificate for %s at %s: %w", id, c.ep.Addr(), err)
	}
	return fromIstioChain(id, key, resp.GetCertChain())
}

// fromIstioChain reads cert_chain: leaf first, then intermediates, and the last element the
// trust roots (possibly several PEM certificates concatenated).
func fromIstioChain(id identity.ID, key crypto.Signer, elems []string) (*Issued, error) {
	if len(elems) < 2 {
		return nil, fmt.Errorf("ca: response for %s has %d chain elements, want leaf and root", id, len(elems))
	}
	var chain []*x509.Certificate
	for _, e := range elems[:len(elems)-1] {
		cs, err := ParsePEMCerts([]byte(e))
		if err != nil {
			return nil, fmt.Errorf("ca: response for %s: %w", id, err)
		}
		chain = append(chain, cs...)
	}
	roots, err := ParsePEMCerts([]byte(elems[len(elems)-1]))
	if err != nil {
		return nil, fmt.Errorf("ca: response for %s: roots: %w", id, err)
	}
	// An intermediate equal to a root adds nothing to the chain we present.
	for len(chain) > 1 && isRoot(chain[len(chain)-1], roots) {
		chain = chain[:len(chain)-1]
	}
	return assemble(id, key, chain, roots)
}

func isRoot(c *x509.Certificate, roots []*x509.Certificate) bool {
	for _, r := range roots {
		if c.Equal(r) {
			return true
		}
	}
	return false
}

// Close closes the gRPC channel; it is idempotent.
func (c *istioClient) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	if c.conn != nil {
		err := c.conn.Close()
		c.conn = nil
		return err
	}
	return nil
}
