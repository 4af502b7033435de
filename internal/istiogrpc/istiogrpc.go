// Package istiogrpc is the client end of an Istio gRPC endpoint, shared by the xDS client
// and the Istio CA client: where to dial, how to verify the server, and the metadata every
// call carries. It does not dial, retry, or know either service's protocol.
//
// One set of defaults, for both clients (the zero value of each Config field):
//   - Address "host:port" with no scheme means TLS, as "https://host:port" does; that is
//     what Istio's chart sets (istiod.istio-system.svc:15012). "http://" is plaintext. Any
//     other scheme is an error.
//   - An address without a port gets istiod's: 15012 for TLS, 15010 for plaintext.
//   - RootCA "" is DefaultRootCA. "SYSTEM" is the OS roots; a value containing "-----BEGIN"
//     is inline PEM; anything else is a file path, read again at every TLS handshake, so a
//     rotated root applies to the next connection without a restart or a watcher. New reads
//     it once too: a missing file or one without a certificate stops the start.
//   - AltHostname "" verifies the server certificate against the address's host.
//   - ClusterID "" is DefaultClusterID, sent as the "clusterid" header.
//   - Headers are sent lower-cased after clusterid, so a "clusterid" header replaces it.
//   - TokenFile "" or a file that does not exist: no authorization header (internal/token);
//     an existing token is re-read for every call and replaces any "authorization" header.
package istiogrpc

import (
	"bytes"
	"cmp"
	"context"
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

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/gozt/gozt/internal/token"
)

// Defaults for Config's zero values, and the defaults cmd/ztunnel shows for CLUSTER_ID,
// XDS_ROOT_CA and CA_ROOT_CA. DefaultClusterID, Istio's name for a cluster nobody named, is
// also what xds gives a workload record without a cluster id.
const (
	DefaultRootCA    = "./var/run/secrets/istio/root-cert.pem"
	DefaultClusterID = "Kubernetes"
	TLSPort          = "15012" // istiod's TLS port (xDS and CA)
	PlaintextPort    = "15010" // istiod's plaintext port (xDS and CA)
)

// Config describes one endpoint: the fields the xDS and CA clients' configurations embed,
// so that each is declared and documented once. The zero value of each is the default in
// the package comment.
type Config struct {
	Address     string            // XDS_ADDRESS, CA_ADDRESS
	RootCA      string            // XDS_ROOT_CA, CA_ROOT_CA
	AltHostname string            // ALT_XDS_HOSTNAME, ALT_CA_HOSTNAME
	TokenFile   string            // AUTH_TOKEN
	ClusterID   string            // CLUSTER_ID
	Headers     map[string]string // XDS_HEADER_*, CA_HEADER_*
}

// Endpoint is a checked Config. It is safe for concurrent use.
type Endpoint struct {
	prefix    string // "xds" or "ca"
	rootVar   string // "XDS_ROOT_CA"
	addr      string // host:port
	plaintext bool
	tls       *tls.Config // without RootCAs when rootFile is set; never mutated
	rootFile  string      // "" unless RootCA is a path
	md        metadata.MD // clusterid and Headers; never mutated
	token     *token.File

	mu       sync.Mutex
	rootPEM  []byte         // guarded by mu: the file content pool was built from
	rootPool *x509.CertPool // guarded by mu
}

// New checks cfg and applies the defaults in the package comment. name is "XDS" or "CA": it
// names the variables in errors (XDS_ADDRESS, XDS_ROOT_CA) and, lower-cased, prefixes them
// ("xds: ..."). log gets the token file's WARN; nil is slog.Default().
func New(name string, cfg Config, log *slog.Logger) (*Endpoint, error) {
	prefix := strings.ToLower(name)
	addrVar, rootVar := name+"_ADDRESS", name+"_ROOT_CA"
	if cfg.Address == "" {
		return nil, fmt.Errorf("%s: %s is empty", prefix, addrVar)
	}
	if log == nil {
		log = slog.Default()
	}
	raw := cfg.Address
	if !strings.Contains(raw, "://") {
		raw = "https://" + raw
	}
	u, err := url.Parse(raw)
	if err != nil || u.Hostname() == "" || (u.Scheme != "https" && u.Scheme != "http") {
		return nil, fmt.Errorf("%s: %s %q is not host:port, https://host:port or http://host:port", prefix, addrVar, cfg.Address)
	}
	e := &Endpoint{
		prefix: prefix, rootVar: rootVar, addr: u.Host, plaintext: u.Scheme == "http",
		md:    metadata.Pairs("clusterid", cmp.Or(cfg.ClusterID, DefaultClusterID)),
		token: token.NewFile(cfg.TokenFile, log),
	}
	if u.Port() == "" {
		e.addr = net.JoinHostPort(u.Hostname(), TLSPort)
		if e.plaintext {
			e.addr = net.JoinHostPort(u.Hostname(), PlaintextPort)
		}
	}
	for k, v := range cfg.Headers {
		e.md.Set(k, v) // lower-cases k
	}
	if e.plaintext {
		return e, nil
	}
	e.tls = &tls.Config{MinVersion: tls.VersionTLS12, ServerName: cmp.Or(cfg.AltHostname, u.Hostname()), NextProtos: []string{"h2"}}
	switch root := cmp.Or(cfg.RootCA, DefaultRootCA); {
	case root == "SYSTEM":
		// nil RootCAs: crypto/tls uses the system pool.
	case strings.Contains(root, "-----BEGIN"):
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM([]byte(root)) {
			return nil, fmt.Errorf("%s: %s: inline PEM holds no certificate", prefix, rootVar)
		}
		e.tls.RootCAs = pool
	default:
		e.rootFile = root
		if _, err := e.roots(); err != nil {
			return nil, err
		}
	}
	return e, nil
}

// Addr is the host:port dialed.
func (e *Endpoint) Addr() string { return e.addr }

// Target is the gRPC dial target: Addr, with no resolver in between.
func (e *Endpoint) Target() string { return "passthrough:///" + e.addr }

// Plaintext reports whether the address is http://.
func (e *Endpoint) Plaintext() bool { return e.plaintext }

// Credentials are the transport credentials for Target: insecure for http://, otherwise
// TLS verified against the roots as they are at each handshake.
func (e *Endpoint) Credentials() credentials.TransportCredentials {
	if e.plaintext {
		return insecure.NewCredentials()
	}
	return &reloadingTLS{e: e, info: credentials.NewTLS(e.tls).Info()}
}

// Outgoing returns ctx with the call's metadata: clusterid, Headers and, when the token
// file has a token, authorization.
func (e *Endpoint) Outgoing(ctx context.Context) (context.Context, error) {
	auth, err := e.token.Authorization()
	if err != nil {
		return nil, fmt.Errorf("%s: AUTH_TOKEN: %w", e.prefix, err)
	}
	md := e.md.Copy()
	if auth != "" {
		md.Set("authorization", auth)
	}
	return metadata.NewOutgoingContext(ctx, md), nil
}

// roots returns the pool from rootFile, parsing it again only when its content changed.
func (e *Endpoint) roots() (*x509.CertPool, error) {
	data, err := os.ReadFile(e.rootFile)
	if err != nil {
		return nil, fmt.Errorf("%s: %s: %w", e.prefix, e.rootVar, err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.rootPool != nil && bytes.Equal(data, e.rootPEM) {
		return e.rootPool, nil
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data) {
		return nil, fmt.Errorf("%s: %s %q holds no PEM certificate", e.prefix, e.rootVar, e.rootFile)
	}
	e.rootPEM, e.rootPool = data, pool
	return pool, nil
}

// reloadingTLS is gRPC's TLS credentials with the root file read at each handshake.
type reloadingTLS struct {
	e    *Endpoint
	info credentials.ProtocolInfo
}

func (r *reloadingTLS) ClientHandshake(ctx context.Context, authority string, conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	tc := r.e.tls
	if r.e.rootFile != "" {
		pool, err := r.e.roots()
		if err != nil {
			return nil, nil, err
		}
		tc = tc.Clone()
		tc.RootCAs = pool
	}
	return credentials.NewTLS(tc).ClientHandshake(ctx, authority, conn)
}

func (r *reloadingTLS) ServerHandshake(net.Conn) (net.Conn, credentials.AuthInfo, error) {
	return nil, nil, errors.New("istiogrpc: client credentials used by a server")
}

func (r *reloadingTLS) Info() credentials.ProtocolInfo { return r.info }

func (r *reloadingTLS) Clone() credentials.TransportCredentials {
	return &reloadingTLS{e: r.e, info: r.info}
}

// OverrideServerName is deprecated in gRPC and unused by it; the name is AltHostname.
func (r *reloadingTLS) OverrideServerName(string) error {
	return errors.New("istiogrpc: set AltHostname instead")
}
