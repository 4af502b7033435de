package certs

import (
	"context"
	"crypto/fips140"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/gozt/gozt/identity"
)

// Key exchange, the Rust ztunnel's groups (rustls' defaults on aws-lc-rs): hybrid
// post-quantum first, X25519 for peers without ML-KEM (older Rust ztunnels), then P-256 and
// P-384 for peers limited to NIST curves (FIPS builds of either ztunnel). In FIPS 140-3 mode
// crypto/tls drops X25519 from any list (crypto/tls/defaults_fips140.go); fipsCurves is
// what it keeps of ours, offered as such so that what a FIPS node offers is written here.
// P-256 is then also the only group a TLS 1.2 peer (TLS12_ENABLED) can use.
var (
	curves     = []tls.CurveID{tls.X25519MLKEM768, tls.X25519, tls.CurveP256, tls.CurveP384}
	fipsCurves = []tls.CurveID{tls.X25519MLKEM768, tls.CurveP256, tls.CurveP384}
	pqcCurves  = []tls.CurveID{tls.X25519MLKEM768} // COMPLIANCE_POLICY=pqc, in either mode
)

func (m *Manager) curves() []tls.CurveID {
	switch {
	case m.cfg.PQCOnly:
		return pqcCurves
	case fips140.Enabled():
		return fipsCurves
	}
	return curves
}

// ALPN is the only application protocol the mesh speaks over mTLS (HBONE is HTTP/2).
const ALPN = "h2"

// alpns are the protocols offered and accepted, best first: "gozt-h2" is HTTP/2 from a
// peer that never initiates a TLS KeyUpdate (hbone.NextProtoNoKeyUpdate, which decides
// whether a connection may move to kernel TLS), then plain "h2" for every other peer.
var alpns = []string{"gozt-h2", ALPN}

// tls12Suites are the TLS 1.2 suites TLS12_ENABLED accepts, the Rust ztunnel's: ECDHE with
// AES-GCM (TLS 1.3's suites are not configurable and stay AES-GCM by checkSuite).
var tls12Suites = []uint16{
	tls.TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384, tls.TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
	tls.TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384, tls.TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
}

// versions are the TLS versions and 1.2 suites of every mesh config: 1.3 only, or 1.2 and
// 1.3 with TLS12_ENABLED.
func (m *Manager) versions(c *tls.Config) *tls.Config {
	c.MinVersion, c.MaxVersion = tls.VersionTLS13, tls.VersionTLS13
	if m.cfg.TLS12 {
		c.MinVersion, c.CipherSuites = tls.VersionTLS12, tls12Suites
	}
	return c
}

// checkSuite enforces the AES-GCM-only rule: Go does not let TLS 1.3 suites be configured, so
// the negotiated one is checked after the fact (a 1.2 one is among tls12Suites by config).
func checkSuite(cs tls.ConnectionState) error {
	switch cs.CipherSuite {
	case tls.TLS_AES_128_GCM_SHA256, tls.TLS_AES_256_GCM_SHA384:
		return nil
	}
	if cs.Version == tls.VersionTLS12 && slices.Contains(tls12Suites, cs.CipherSuite) {
		return nil
	}
	return &cipherError{cs.CipherSuite}
}

// verifyPeer checks that chain (leaf first) chains to h's bundle now, and that no certificate
// of the verified chain is revoked by crl (nil: none), and returns the leaf's mesh identity.
func verifyPeer(h *held, crl *CRL, chain []*x509.Certificate) (identity.ID, error) {
	if len(chain) == 0 {
		return identity.ID{}, errNoPeerCert
	}
	leaf := chain[0]
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	chains, err := leaf.Verify(x509.VerifyOptions{
		Roots: h.pool, Intermediates: inter, CurrentTime: time.Now(),
		KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		return identity.ID{}, fmt.Errorf("certs: peer certificate %v (serial %s) rejected: %w", leaf.URIs, leaf.SerialNumber, err)
	}
	if chains, err = fipsChains(chains); err != nil {
		return identity.ID{}, err
	}
	for _, verified := range chains {
		if err := crl.check(verified); err != nil {
			return identity.ID{}, err
		}
	}
	id, err := identity.FromCert(leaf)
	if err != nil {
		return identity.ID{}, fmt.Errorf("certs: peer certificate: %w", err)
	}
	return id, nil
}

// ErrNotJudged is Revoked's answer for a peer that a list in force names but whose chain no
// longer verifies against the trust roots held now (they rotated since its handshake): the
// list's authority over it cannot be checked, so it is not closed. The Rust ztunnel counts
// such connections as not tracked for CRL enforcement.
var ErrNotJudged = errors.New("certs: the peer's chain no longer verifies against the trust roots held now; its revocation cannot be judged")

// Revoked re-checks the peer of an established connection (its handshake's state) against
// the CRL in force now, and returns a *RevokedError if a certificate of its chain is
// revoked. A chain a list names that no longer verifies against the bundles held now
// (roots rotated) is not judged: ErrNotJudged (wrapped), and only revocation closes a
// connection. The chain is verified as of the latest start of validity among its
// certificates, a moment the handshake's chain was valid, so a certificate that expired
// since does not hide its revocation.
func (m *Manager) Revoked(cs tls.ConnectionState) error {
	crl := m.cfg.CRL
	if crl == nil || len(cs.PeerCertificates) == 0 || !crl.mayRevoke(cs.PeerCertificates) {
		return nil
	}
	roots := x509.NewCertPool()
	for _, r := range m.roots() {
		roots.AddCert(r)
	}
	leaf, inter := cs.PeerCertificates[0], x509.NewCertPool()
	at := leaf.NotBefore
	for _, c := range cs.PeerCertificates[1:] {
		inter.AddCert(c)
		if c.NotBefore.After(at) {
			at = c.NotBefore
		}
	}
	chains, err := leaf.Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter, CurrentTime: at, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	if err != nil {
		return fmt.Errorf("%w: %v", ErrNotJudged, err)
	}
	for _, c := range chains {
		if err := crl.check(c); err != nil {
			return err
		}
	}
	return nil
}

// roots are the trust roots of every certificate held now.
func (m *Manager) roots() []*x509.Certificate {
	m.mu.Lock()
	defer m.mu.Unlock()
	var roots []*x509.Certificate
	for _, e := range m.entries {
		if e.cur != nil {
			roots = append(roots, e.cur.iss.Roots...)
		}
	}
	for _, e := range m.workloads {
		for _, s := range e.svids {
			roots = append(roots, s.h.iss.Roots...)
		}
	}
	return roots
}

// CheckCRL checks the signature of each list in force that a trust root held now issued,
// reporting (once per list) one that does not verify, so a bad list is found when it is
// loaded rather than when a peer under it first connects. Lists of intermediates are
// checked then: only a peer's chain brings the intermediate.
func (m *Manager) CheckCRL() {
	if m.cfg.CRL != nil {
		m.cfg.CRL.checkSignatures(m.roots())
	}
}

// PeerIdentity returns the identity of a verified peer of a connection built with
// ClientConfig or ServerConfig.
func PeerIdentity(cs tls.ConnectionState) (identity.ID, error) {
	if len(cs.PeerCertificates) == 0 {
		return identity.ID{}, errors.New("certs: no peer certificate")
	}
	return identity.FromCert(cs.PeerCertificates[0])
}

// ClientConfig returns the config for dialing as src a server that must be one of expected:
// TLS 1.3 only (1.2 too with Config.TLS12), AES-GCM, X25519MLKEM768 preferred with X25519,
// P-256 and P-384 fallbacks (no X25519 in FIPS 140-3 mode), ALPN h2, no SNI (the
// caller must leave ServerName empty), no session resumption. The client certificate is
// looked up per handshake, so a long-lived pool picks up rotations by itself. The server's
// chain is verified against src's bundle and its URI SAN must be one of expected. ctx bounds
// the first fetch of src's certificate, which ClientConfig waits for.
func (m *Manager) ClientConfig(ctx context.Context, src identity.ID, expected []identity.ID) (*tls.Config, error) {
	return m.clientConfig(ctx, m.get, src, expected)
}

// getter looks up the certificate to present as an identity: the manager's own (get), or
// one workload's (WorkloadCerts).
type getter func(ctx context.Context, id identity.ID) (*held, error)

func (m *Manager) clientConfig(ctx context.Context, get getter, src identity.ID, expected []identity.ID) (*tls.Config, error) {
	if len(expected) == 0 {
		return nil, errors.New("certs: client config with no expected server identity")
	}
	if _, err := get(ctx, src); err != nil {
		return nil, err
	}
	expected = slices.Clone(expected)
	return m.versions(&tls.Config{
		CurvePreferences: m.curves(),
		NextProtos:       alpns,
		// Verification is VerifyConnection's: chain to the mesh bundle and SPIFFE URI SAN,
		// not a host name.
		InsecureSkipVerify:     true,
		SessionTicketsDisabled: true,
		GetClientCertificate: func(cri *tls.CertificateRequestInfo) (*tls.Certificate, error) {
			h, err := get(cri.Context(), src)
			if err != nil {
				return nil, err
			}
			return &h.iss.Certificate, nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			if err := checkSuite(cs); err != nil {
				return err
			}
			h, err := get(context.Background(), src)
			if err != nil {
				return err
			}
			id, err := verifyPeer(h, m.cfg.CRL, cs.PeerCertificates)
			if err != nil {
				return err
			}
			if !slices.Contains(expected, id) {
				return fmt.Errorf("certs: server identity is %s, expected one of %v", id, expected)
			}
			return nil
		},
	}), nil
}

// ServerConfig returns the config for the mTLS listener. local maps a handshake to the
// identity we serve as (the proxy decides, e.g. by destination address). The client must
// present a certificate chaining to that identity's bundle whose identity is in the same
// trust domain. Certificates are looked up per handshake.
func (m *Manager) ServerConfig(local func(*tls.ClientHelloInfo) (identity.ID, error)) *tls.Config {
	return m.serverConfig(m.get, local)
}

func (m *Manager) serverConfig(get getter, local func(*tls.ClientHelloInfo) (identity.ID, error)) *tls.Config {
	return m.versions(&tls.Config{
		CurvePreferences:       m.curves(),
		NextProtos:             alpns,
		SessionTicketsDisabled: true,
		ClientAuth:             tls.RequireAnyClientCert,
		GetConfigForClient: func(hello *tls.ClientHelloInfo) (*tls.Config, error) {
			id, err := local(hello)
			if err != nil {
				return nil, fmt.Errorf("certs: no local identity for %v: %w: %w", hello.Conn.LocalAddr(), errNoLocalIdentity, err)
			}
			h, err := get(hello.Context(), id)
			if err != nil {
				return nil, err
			}
			return h.serverConfig(id, m), nil
		},
	})
}

// serverConfig is built once per issued certificate; handshakes then allocate nothing for it.
func (h *held) serverConfig(id identity.ID, m *Manager) *tls.Config {
	h.once.Do(func() {
		h.server = m.versions(&tls.Config{
			CurvePreferences:       m.curves(),
			NextProtos:             alpns,
			SessionTicketsDisabled: true,
			Certificates:           []tls.Certificate{h.iss.Certificate},
			// RequireAny + VerifyConnection: the bundle check is ours (Go's would also demand
			// ExtKeyUsageClientAuth and knows nothing of trust domains).
			ClientAuth: tls.RequireAnyClientCert,
			VerifyConnection: func(cs tls.ConnectionState) error {
				if err := checkSuite(cs); err != nil {
					return err
				}
				peer, err := verifyPeer(h, m.cfg.CRL, cs.PeerCertificates)
				if err != nil {
					return err
				}
				if peer.TrustDomain() != id.TrustDomain() {
					return &trustDomainError{peer, id.TrustDomain()}
				}
				return nil
			},
		})
	})
	return h.server
}
