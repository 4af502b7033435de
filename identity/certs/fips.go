package certs

import (
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/fips140"
	"crypto/rsa"
	"crypto/x509"
	"fmt"
	"strings"
)

// FIPS 140-3 mode (crypto/fips140.Enabled: GODEBUG fips140=on, the default of a binary
// built with GOFIPS140) is process-wide and fixed at start. crypto/tls then negotiates only
// approved versions, suites, groups and signature algorithms by itself; the one rule it
// cannot apply to the mesh's configs is its check of the peer's certificate keys, which it
// makes only on chains it verifies itself. The mesh verifies in VerifyConnection
// (InsecureSkipVerify, RequireAnyClientCert: SPIFFE IDs, not host names), so fipsChains
// stands in for it.

// fipsChains returns, in FIPS 140-3 mode, the verified chains whose every key FIPS 140-3
// approves, and an *unapprovedKeyError if none is left; outside it, chains as they are. The
// rule is crypto/tls's (isCertificateAllowedFIPS): RSA of 2048 bits or more, ECDSA on P-256,
// P-384 or P-521, Ed25519.
func fipsChains(chains [][]*x509.Certificate) ([][]*x509.Certificate, error) {
	if !fips140.Enabled() {
		return chains, nil
	}
	var kept [][]*x509.Certificate
	var bad *x509.Certificate
	for _, chain := range chains {
		if c := unapprovedKey(chain); c != nil {
			bad = c
			continue
		}
		kept = append(kept, chain)
	}
	if len(kept) == 0 { // x509's Verify returns a chain or an error: bad is set
		return nil, &unapprovedKeyError{bad}
	}
	return kept, nil
}

// unapprovedKey returns the first certificate of chain whose key FIPS 140-3 does not
// approve, or nil.
func unapprovedKey(chain []*x509.Certificate) *x509.Certificate {
	for _, c := range chain {
		switch k := c.PublicKey.(type) {
		case *rsa.PublicKey:
			if k.N.BitLen() >= 2048 {
				continue
			}
		case *ecdsa.PublicKey:
			if k.Curve == elliptic.P256() || k.Curve == elliptic.P384() || k.Curve == elliptic.P521() {
				continue
			}
		case ed25519.PublicKey:
			continue
		}
		return c
	}
	return nil
}

// unapprovedKeyError is a peer chain refused in FIPS 140-3 mode for a key of cert.
type unapprovedKeyError struct{ cert *x509.Certificate }

func (e *unapprovedKeyError) Error() string {
	name := e.cert.Subject.String()
	if len(e.cert.URIs) > 0 {
		name = e.cert.URIs[0].String()
	}
	return fmt.Sprintf("certs: FIPS 140-3 mode: peer certificate %q has a %s key, which FIPS 140-3 does not approve (accepted: RSA of 2048 bits or more, ECDSA P-256, P-384 or P-521, Ed25519)", name, keyName(e.cert.PublicKey))
}

// keyName names a public key's type and size, for an error.
func keyName(pub any) string {
	switch k := pub.(type) {
	case *rsa.PublicKey:
		return fmt.Sprintf("%d-bit RSA", k.N.BitLen())
	case *ecdsa.PublicKey:
		return "ECDSA " + k.Curve.Params().Name
	}
	return strings.TrimPrefix(fmt.Sprintf("%T", pub), "*")
}

// notApprovedNegotiation reports whether msg is crypto/tls's failure to agree on parameters
// in FIPS 140-3 mode: a peer whose offer is all outside what the mode approves (X25519
// alone, ChaCha20-Poly1305 suites alone, TLS 1.2 without extended master secret).
func notApprovedNegotiation(msg string) bool {
	return strings.Contains(msg, "tls: no key exchanges supported by both") ||
		strings.Contains(msg, "tls: no cipher suite supported by both") ||
		strings.Contains(msg, "tls: FIPS 140-3 ")
}
