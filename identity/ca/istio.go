package ca

import (
	"bytes"
	"context"
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"os"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/gozt/gozt/identity"
	pb "github.com/gozt/gozt/identity/ca/capb"
	"github.com/gozt/gozt/internal/token"
)

// istioClient speaks istio.v1.auth.IstioCertificateService. The gRPC channel is rebuilt when
// the CA_ROOT_CA file changes, checked (one stat) at every fetch, so a rotated istiod root
// takes effect without a restart and without a watcher goroutine.
type istioClient struct {
	cfg       Config
	target    string // host:port
	plaintext bool
	rootFile  string // "" unless CA_ROOT_CA names a file
	token     *token.File

	mu       sync.Mutex
	conn     *grpc.ClientConn
	rootSeen []byte // content of rootFile the conn was built with
	closed   bool
}

func newIstio(cfg Config) (*istioClient, error) {
	if cfg.Address == "" {
		cfg.Address = DefaultAddress
	}
	if cfg.RootCA == "" {
		cfg.RootCA = DefaultRootCA
	}
	if cfg.ClusterID == "" {
		cfg.ClusterID = DefaultClusterID
	}
	addr := cfg.Address
	if !strings.Contains(addr, "://") {
		addr = "https://" + addr
	}
	u, err := url.Parse(addr)
	if err != nil || u.Host == "" || (u.Scheme != "https" && u.Scheme != "http") {
		return nil, fmt.Errorf("ca: CA_ADDRESS %q is not https://host:port or http://host:port", cfg.Address)
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "15012")
	}
	c := &istioClient{
		cfg: cfg, target: host, plaintext: u.Scheme == "http",
		token: token.NewFile(cfg.TokenFile, slog.Default().With("component", "ca")),
	}
	if !c.plaintext && cfg.RootCA != "SYSTEM" && !strings.Contains(cfg.RootCA, "-----BEGIN") {
		c.rootFile = cfg.RootCA
	}
	if !c.plaintext {
		if _, err := c.readRootPEM(); err != nil {
			return nil, err
		}
	}
	return c, nil
}

// readRootPEM loads the CA_ROOT_CA roots; nil means the system roots.
func (c *istioClient) readRootPEM() ([]byte, error) {
	switch {
	case c.cfg.RootCA == "SYSTEM":
		return nil, nil
	case c.rootFile == "":
		return []byte(c.cfg.RootCA), nil
	}
	data, err := os.ReadFile(c.rootFile)
	if err != nil {
		return nil, fmt.Errorf("ca: CA_ROOT_CA: %w", err)
	}
	return data, nil
}

// connLocked returns the channel, rebuilding it if the root file changed.
func (c *istioClient) connLocked() (*grpc.ClientConn, error) {
	if c.closed {
		return nil, errors.New("ca: client closed")
	}
	var rootPEM []byte
	if !c.plaintext {
		var err error
		if rootPEM, err = c.readRootPEM(); err != nil {
			return nil, err
		}
		if c.conn != nil && !bytes.Equal(rootPEM, c.rootSeen) {
			c.conn.Close()
			c.conn = nil
		}
	}
	if c.conn != nil {
		return c.conn, nil
	}
	creds := insecure.NewCredentials()
	if !c.plaintext {
		tc := &tls.Config{MinVersion: tls.VersionTLS12}
		if rootPEM != nil {
			pool := x509.NewCertPool()
			if !pool.AppendCertsFromPEM(rootPEM) {
				return nil, fmt.Errorf("ca: CA_ROOT_CA %q holds no PEM certificate", c.rootFile)
			}
			tc.RootCAs = pool
		}
		if c.cfg.AltHostname != "" {
			tc.ServerName = c.cfg.AltHostname
		}
		creds = credentials.NewTLS(tc)
	}
	conn, err := grpc.NewClient("passthrough:///"+c.target, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, fmt.Errorf("ca: dial %s: %w", c.target, err)
	}
	c.conn, c.rootSeen = conn, rootPEM
	return conn, nil
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
	md := metadata.MD{"clusterid": []string{c.cfg.ClusterID}}
	for k, v := range c.cfg.Headers {
		md.Set(k, v)
	}
	auth, err := c.token.Authorization()
	if err != nil {
		return nil, fmt.Errorf("ca: AUTH_TOKEN: %w", err)
	}
	if auth != "" {
		md.Set("authorization", auth)
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
	resp, err := pb.NewIstioCertificateServiceClient(conn).CreateCertificate(metadata.NewOutgoingContext(ctx, md), req)
	if err != nil {
		return nil, fmt.Errorf("ca: create certificate for %s at %s: %w", id, c.target, err)
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
