// Package identity is the SPIFFE workload identity of the mesh,
// spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>, as a comparable value.
//
// It owns parsing and formatting only. Certificates, trust bundles and CAs live in
// identity/ca and identity/certs; this package imports nothing from the module so every
// other package may use it as a map key.
package identity

import (
	"crypto/x509"
	"errors"
	"fmt"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// DefaultTrustDomain is the trust domain of workloads whose record names none.
const DefaultTrustDomain = "cluster.local"

// ID is a mesh workload identity. The zero ID is "no identity" (a plaintext peer).
// IDs are comparable and hashable without allocating: the whole URI is one string and the
// component boundaries are small integers.
type ID struct {
	uri   string // spiffe://td/ns/ns/sa/sa
	tdEnd uint16 // uri[len("spiffe://"):tdEnd] is the trust domain
	nsEnd uint16 // uri[tdEnd+len("/ns/"):nsEnd] is the namespace
}

const scheme = "spiffe://"

// ErrNotMeshID is returned (wrapped) for a valid SPIFFE ID that is not of the mesh's shape.
var ErrNotMeshID = errors.New("identity: not of the form spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>")

// Parse parses a strict mesh identity: exactly spiffe://TD/ns/NS/sa/SA. Anything else,
// including extra path segments, is an error.
func Parse(s string) (ID, error) {
	sid, err := spiffeid.FromString(s)
	if err != nil {
		return ID{}, fmt.Errorf("identity: parse %q: %w", s, err)
	}
	segs := strings.Split(strings.TrimPrefix(sid.Path(), "/"), "/")
	if len(segs) != 4 || segs[0] != "ns" || segs[2] != "sa" || segs[1] == "" || segs[3] == "" {
		return ID{}, fmt.Errorf("%w: got %q", ErrNotMeshID, s)
	}
	return New(sid.TrustDomain().Name(), segs[1], segs[3])
}

// New builds an identity from its parts; empty trust domain and service account take the
// defaults Istio applies (cluster.local, default).
func New(trustDomain, namespace, serviceAccount string) (ID, error) {
	if trustDomain == "" {
		trustDomain = DefaultTrustDomain
	}
	if serviceAccount == "" {
		serviceAccount = "default"
	}
	if namespace == "" {
		return ID{}, fmt.Errorf("%w: empty namespace", ErrNotMeshID)
	}
	// A '/' inside a part would shift the component boundaries and make String unparseable.
	if strings.Contains(trustDomain, "/") || strings.Contains(namespace, "/") || strings.Contains(serviceAccount, "/") {
		return ID{}, fmt.Errorf("%w: '/' in %q, %q or %q", ErrNotMeshID, trustDomain, namespace, serviceAccount)
	}
	uri := scheme + trustDomain + "/ns/" + namespace + "/sa/" + serviceAccount
	if len(uri) > 2048 {
		return ID{}, fmt.Errorf("identity: %d-byte identity is too long", len(uri))
	}
	if _, err := spiffeid.FromString(uri); err != nil {
		return ID{}, fmt.Errorf("identity: %q: %w", uri, err)
	}
	tdEnd := len(scheme) + len(trustDomain)
	return ID{uri: uri, tdEnd: uint16(tdEnd), nsEnd: uint16(tdEnd + len("/ns/") + len(namespace))}, nil
}

// MustParse is Parse for constants in tests and examples; it panics on error.
func MustParse(s string) ID {
	id, err := Parse(s)
	if err != nil {
		panic(err)
	}
	return id
}

// String returns the SPIFFE URI, or "" for the zero ID.
func (id ID) String() string { return id.uri }

// IsZero reports whether id is the zero ID (no identity).
func (id ID) IsZero() bool { return id.uri == "" }

// TrustDomain returns the trust domain name, e.g. "cluster.local".
func (id ID) TrustDomain() string {
	if id.uri == "" {
		return ""
	}
	return id.uri[len(scheme):id.tdEnd]
}

// Namespace returns the Kubernetes namespace.
func (id ID) Namespace() string {
	if id.uri == "" {
		return ""
	}
	return id.uri[int(id.tdEnd)+len("/ns/") : id.nsEnd]
}

// ServiceAccount returns the Kubernetes service account.
func (id ID) ServiceAccount() string {
	if id.uri == "" {
		return ""
	}
	return id.uri[int(id.nsEnd)+len("/sa/"):]
}

// Principal is the identity without the scheme, the form authorization policies match on
// (e.g. "cluster.local/ns/default/sa/sleep").
func (id ID) Principal() string {
	if id.uri == "" {
		return ""
	}
	return id.uri[len(scheme):]
}

// MarshalText makes IDs print as their URI in JSON and YAML (the zero ID as "").
func (id ID) MarshalText() ([]byte, error) { return []byte(id.uri), nil }

// UnmarshalText parses a strict mesh identity; "" gives the zero ID.
func (id *ID) UnmarshalText(b []byte) error {
	if len(b) == 0 {
		*id = ID{}
		return nil
	}
	v, err := Parse(string(b))
	if err != nil {
		return err
	}
	*id = v
	return nil
}

// FromCert returns the first URI SAN of cert that parses as a mesh identity.
func FromCert(cert *x509.Certificate) (ID, error) {
	for _, u := range cert.URIs {
		if id, err := Parse(u.String()); err == nil {
			return id, nil
		}
	}
	return ID{}, fmt.Errorf("%w: certificate %s has no such URI SAN", ErrNotMeshID, cert.SerialNumber)
}
