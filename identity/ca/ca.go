// Package ca obtains workload certificates from a certificate authority: Istio's
// IstioCertificateService over gRPC, a SPIFFE Workload API agent, a SPIRE agent's Delegated
// Identity API (per workload: spire.go), or a built-in CA that signs with a local root for
// standalone mode.
//
// It owns one request: "give me a leaf for this identity". Caching, rotation, backoff and
// TLS configuration live in identity/certs; this package keeps no per-identity state.
package ca

import (
	"bytes"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net/url"
	"slices"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/istiogrpc"
)

// Client issues a certificate for one identity.
type Client interface {
	// Fetch returns a fresh leaf for id. It is safe for concurrent use.
	Fetch(ctx context.Context, id identity.ID) (*Issued, error)
	// Close releases connections and watchers; it is idempotent.
	Close() error
}

// Notifier is implemented by clients whose source pushes new certificates (the Workload
// API); identity/certs re-fetches every identity when Changed's channel closes.
type Notifier interface {
	// Changed returns a channel closed at the next update.
	Changed() <-chan struct{}
}

// Issued is a leaf with its chain and trust roots.
type Issued struct {
	Certificate tls.Certificate     // leaf first, then intermediates; PrivateKey set; Leaf parsed
	Roots       []*x509.Certificate // trust bundle (may hold several roots; federated bundles included)
	NotBefore   time.Time           // the leaf's
	NotAfter    time.Time           // the earliest NotAfter on the verified chain: the leaf's, or a CA's that expires first
}

// Identity returns the identity the leaf carries.
func (i *Issued) Identity() (identity.ID, error) {
	if i == nil || i.Certificate.Leaf == nil {
		return identity.ID{}, errors.New("ca: no leaf")
	}
	return identity.FromCert(i.Certificate.Leaf)
}

// Config mirrors the environment (cmd/ztunnel fills it): zero values mean the documented defaults.
type Config struct {
	Provider string // "istio" | "spiffe" | "spire" | "builtin" | "" (auto, see New)
	// The Istio CA's endpoint (CA_ADDRESS [DefaultAddress], CA_ROOT_CA, ALT_CA_HOSTNAME,
	// AUTH_TOKEN, CLUSTER_ID, CA_HEADER_*), with internal/istiogrpc's defaults, the same as
	// the xDS client's: host:port is TLS, http:// plaintext; the root file is re-read at each
	// connection, the token at every call.
	istiogrpc.Config
	SecretTTL    time.Duration // SECRET_TTL [24h]
	Impersonate  bool          // shared mode: send ImpersonatedIdentity metadata
	Dir          string        // CA_DIR for builtin: cacerts layout; a self-signed root is generated on first start
	SpiffeSocket string        // SPIFFE_ENDPOINT_SOCKET for spiffe
	SpireSocket  string        // SPIRE_ADMIN_ENDPOINT_SOCKET for spire: the SPIRE agent's admin socket (Delegated Identity API)
	LocalXDS     bool          // LOCAL_XDS_PATH set (for the auto rule)
}

// Defaults applied by New. The endpoint (Config.Config) takes internal/istiogrpc's
// defaults, the same as the xDS client's, but for the address.
const (
	DefaultAddress   = "https://localhost:15012"
	DefaultSecretTTL = 24 * time.Hour
)

// New picks the provider: explicit Provider, else spire if SpireSocket is set, spiffe if
// SpiffeSocket is, builtin if LocalXDS && Address=="", else istio. Bad configuration is an error naming the variable.
// ctx bounds start-up only.
func New(ctx context.Context, cfg Config) (Client, error) {
	if cfg.SecretTTL < 0 {
		return nil, fmt.Errorf("ca: SECRET_TTL %v is negative", cfg.SecretTTL)
	}
	if cfg.SecretTTL == 0 {
		cfg.SecretTTL = DefaultSecretTTL
	}
	p := cfg.Provider
	if p == "" {
		switch {
		case cfg.SpireSocket != "":
			p = "spire"
		case cfg.SpiffeSocket != "":
			p = "spiffe"
		case cfg.LocalXDS && cfg.Address == "":
			p = "builtin"
		default:
			p = "istio"
		}
	}
	switch p {
	case "istio":
		return newIstio(cfg)
	case "spiffe":
		if cfg.SpiffeSocket == "" {
			return nil, errors.New("ca: CA_PROVIDER=spiffe needs SPIFFE_ENDPOINT_SOCKET")
		}
		return newSpiffe(ctx, cfg.SpiffeSocket)
	case "spire":
		return NewDelegated(ctx, cfg.SpireSocket)
	case "builtin":
		if cfg.Dir == "" {
			return nil, errors.New("ca: CA_PROVIDER=builtin needs CA_DIR")
		}
		return NewBuiltin(cfg.Dir, cfg.SecretTTL)
	default:
		return nil, fmt.Errorf("ca: CA_PROVIDER %q is not one of istio, spiffe, spire, builtin", p)
	}
}

// newKey returns a fresh ECDSA P-256 key, the key type the mesh uses for leaves.
func newKey() (*ecdsa.PrivateKey, error) {
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("ca: generate key: %w", err)
	}
	return k, nil
}

// LeafTemplate is the workload leaf this package's built-in CA issues, and catest's too:
// uri (the SPIFFE ID) its only subject alternative name, digital signature and key
// encipherment, server and client authentication, not a CA, a random 127-bit serial.
func LeafTemplate(uri *url.URL, notBefore, notAfter time.Time) *x509.Certificate {
	return &x509.Certificate{
		SerialNumber:          serial(),
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		URIs:                  []*url.URL{uri},
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
	}
}

// NewCSR returns a PEM PKCS#10 request whose only subject alternative name is id's URI, signed
// with SHA-256 by key (no common name, as Istio expects).
func NewCSR(key crypto.Signer, id identity.ID) ([]byte, error) {
	u, err := url.Parse(id.String())
	if err != nil {
		return nil, fmt.Errorf("ca: csr for %s: %w", id, err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{
		SignatureAlgorithm: x509.ECDSAWithSHA256,
		URIs:               []*url.URL{u},
	}, key)
	if err != nil {
		return nil, fmt.Errorf("ca: csr for %s: %w", id, err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}), nil
}

// ParsePEMCerts parses every CERTIFICATE block in data; other blocks are skipped.
func ParsePEMCerts(data []byte) ([]*x509.Certificate, error) {
	var out []*x509.Certificate
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			continue
		}
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("ca: parse certificate: %w", err)
		}
		out = append(out, c)
	}
	if len(out) == 0 {
		return nil, errors.New("ca: no PEM certificate found")
	}
	return out, nil
}

// assemble builds an Issued from a chain (leaf first) and roots, and checks what every
// provider must guarantee: the leaf carries want, matches key, and chains to the roots now.
func assemble(want identity.ID, key crypto.Signer, chain, roots []*x509.Certificate) (*Issued, error) {
	if len(chain) == 0 {
		return nil, errors.New("ca: empty certificate chain")
	}
	if len(roots) == 0 {
		return nil, errors.New("ca: no trust roots")
	}
	leaf := chain[0]
	got, err := identity.FromCert(leaf)
	if err != nil {
		return nil, fmt.Errorf("ca: issued leaf: %w", err)
	}
	if got != want {
		return nil, fmt.Errorf("ca: issued leaf is for %s, asked for %s", got, want)
	}
	if pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool }); !ok || !pub.Equal(leaf.PublicKey) {
		return nil, fmt.Errorf("ca: issued leaf for %s does not match our private key", want)
	}
	// Checked at the current time; a leaf dated a little in our future (the CA's clock runs
	// ahead of ours) from its start instead.
	at := time.Now()
	if at.Before(leaf.NotBefore) {
		at = leaf.NotBefore
	}
	until, err := verifyChain(leaf, chain[1:], roots, at)
	if err != nil {
		return nil, fmt.Errorf("ca: issued leaf for %s: %w", want, err)
	}
	der := make([][]byte, len(chain))
	for i, c := range chain {
		der[i] = c.Raw
	}
	return &Issued{
		Certificate: tls.Certificate{Certificate: der, PrivateKey: key, Leaf: leaf},
		Roots:       roots,
		NotBefore:   leaf.NotBefore,
		NotAfter:    until,
	}, nil
}

// verifyChain checks that c chains through inter to one of roots at time at, and returns
// when that chain stops being valid: the earliest NotAfter on it (on the longest-lasting
// chain, if several verify). A chain broken by an expired certificate names it.
func verifyChain(c *x509.Certificate, inter, roots []*x509.Certificate, at time.Time) (time.Time, error) {
	rootPool, interPool := x509.NewCertPool(), x509.NewCertPool()
	for _, r := range roots {
		rootPool.AddCert(r)
	}
	for _, i := range inter {
		interPool.AddCert(i)
	}
	chains, err := c.Verify(x509.VerifyOptions{
		Roots: rootPool, Intermediates: interPool, CurrentTime: at,
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		if x := expiredAt(at, append([]*x509.Certificate{c}, inter...), roots); x != nil {
			return time.Time{}, fmt.Errorf("CA chain expired at %s: %q (serial %s)",
				x.NotAfter.UTC().Format(time.RFC3339), certName(x), x.SerialNumber)
		}
		return time.Time{}, fmt.Errorf("does not chain to the roots: %w", err)
	}
	var until time.Time
	for _, ch := range chains {
		end := ch[0].NotAfter
		for _, x := range ch[1:] {
			if x.NotAfter.Before(end) {
				end = x.NotAfter
			}
		}
		if end.After(until) {
			until = end
		}
	}
	return until, nil
}

// expiredAt returns the first of certs, or of the roots that issued one of them, that has
// expired at at; nil if none has.
func expiredAt(at time.Time, certs, roots []*x509.Certificate) *x509.Certificate {
	for _, c := range certs {
		if at.After(c.NotAfter) {
			return c
		}
	}
	for _, r := range roots {
		issued := slices.ContainsFunc(certs, func(c *x509.Certificate) bool { return bytes.Equal(c.RawIssuer, r.RawSubject) })
		if issued && at.After(r.NotAfter) {
			return r
		}
	}
	return nil
}

// certName is c's subject, or its first URI for a leaf that has no subject.
func certName(c *x509.Certificate) string {
	if s := c.Subject.String(); s != "" || len(c.URIs) == 0 {
		return s
	}
	return c.URIs[0].String()
}
