package certs

import (
	"crypto/x509"
	"encoding/base64"
	"encoding/pem"
	"slices"
	"strings"
	"time"
)

// CertState is one identity's entry in the admin /config_dump "certificates" list.
type CertState struct {
	Identity  string     `json:"identity"`
	State     string     `json:"state"` // Initializing | Available | "Unavailable: <err>"
	CertChain []CertInfo `json:"certChain"`
	RootCerts []CertInfo `json:"rootCerts"`
	// Per-workload certificates (CA_PROVIDER=spire) only: whose SVID this is, and how it
	// was asked of the agent, e.g. "spire: selectors k8s:ns:default,k8s:sa:client,...".
	Workload string `json:"workload,omitempty"`
	Source   string `json:"source,omitempty"`
}

// CertInfo describes one certificate of a chain or bundle.
type CertInfo struct {
	PEM            string `json:"pem"` // base64 of the PEM text, as ztunnel prints it
	SerialNumber   string `json:"serialNumber"`
	ValidFrom      string `json:"validFrom"`      // RFC 3339
	ExpirationTime string `json:"expirationTime"` // RFC 3339
}

// Dump returns every identity's state, sorted by identity.
func (m *Manager) Dump() []CertState {
	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	out := make([]CertState, 0, len(m.entries))
	for id, e := range m.entries {
		s := CertState{Identity: id.String(), CertChain: []CertInfo{}, RootCerts: []CertInfo{}}
		switch {
		case e.cur.valid(now):
			s.State = "Available"
		case e.err != nil:
			s.State = "Unavailable: " + e.err.Error()
		case e.cur != nil:
			s.State = "Unavailable: certificate expired"
		default:
			s.State = "Initializing"
		}
		s.addChain(e.cur)
		out = append(out, s)
	}
	for _, e := range m.sortedWorkloadsLocked() {
		base := CertState{Workload: e.ref.Name, Source: "spire: " + e.ref.As.String(), CertChain: []CertInfo{}, RootCerts: []CertInfo{}}
		for _, sv := range e.svids {
			s := base
			s.Identity, s.State = sv.id.String(), "Available"
			if !sv.h.valid(now) {
				s.State = "Unavailable: certificate expired"
			}
			s.addChain(sv.h)
			out = append(out, s)
		}
		if len(e.svids) == 0 {
			s := base
			s.State = "Initializing"
			if e.err != nil {
				s.State = "Unavailable: " + e.err.Error()
			}
			out = append(out, s)
		}
	}
	slices.SortStableFunc(out, func(a, b CertState) int { return strings.Compare(a.Identity, b.Identity) })
	return out
}

// addChain lists h's chain and roots; nothing for nil.
func (s *CertState) addChain(h *held) {
	if h == nil {
		return
	}
	for _, c := range h.iss.Certificate.Certificate {
		if xc, err := x509.ParseCertificate(c); err == nil {
			s.CertChain = append(s.CertChain, info(xc))
		}
	}
	for _, r := range h.iss.Roots {
		s.RootCerts = append(s.RootCerts, info(r))
	}
}

func info(c *x509.Certificate) CertInfo {
	p := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: c.Raw})
	return CertInfo{
		PEM:            base64.StdEncoding.EncodeToString(p),
		SerialNumber:   c.SerialNumber.String(),
		ValidFrom:      c.NotBefore.UTC().Format(time.RFC3339),
		ExpirationTime: c.NotAfter.UTC().Format(time.RFC3339),
	}
}

// Expiry is when one identity's certificate in use expires.
type Expiry struct {
	Identity string
	NotAfter time.Time
}

// Expiries returns each identity's certificate expiry, for a gauge an operator alerts on
// before a node's certificates lapse (a CA that keeps failing, an expired token): an
// identity that has no certificate yet is left out. Of several workloads' SVIDs with one
// identity (SPIRE), the one that expires first counts.
func (m *Manager) Expiries() []Expiry {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Expiry, 0, len(m.entries))
	for id, e := range m.entries {
		if e.cur != nil {
			out = append(out, Expiry{id.String(), e.cur.iss.NotAfter})
		}
	}
	first := map[string]time.Time{}
	for _, e := range m.workloads {
		for _, s := range e.svids {
			if t, ok := first[s.id.String()]; !ok || s.h.iss.NotAfter.Before(t) {
				first[s.id.String()] = s.h.iss.NotAfter
			}
		}
	}
	for id, t := range first {
		out = append(out, Expiry{id, t})
	}
	return out
}
