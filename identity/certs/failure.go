package certs

import (
	"context"
	"crypto/fips140"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"

	"github.com/gozt/gozt/identity"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// The verification errors HandshakeFailure tells apart.
var (
	errNoPeerCert      = errors.New("certs: peer presented no certificate")
	errNoLocalIdentity = errors.New("no workload identity serves this address")
)

// trustDomainError is a client certificate of another trust domain than ours.
type trustDomainError struct {
	peer   identity.ID
	domain string
}

func (e *trustDomainError) Error() string {
	return fmt.Sprintf("certs: client %s is not in trust domain %q", e.peer, e.domain)
}

// cipherError is a negotiated cipher suite the mesh does not use.
type cipherError struct{ suite uint16 }

func (e *cipherError) Error() string {
	return fmt.Sprintf("certs: negotiated cipher suite %s is not AES-GCM", tls.CipherSuiteName(e.suite))
}

// Handshake failure reasons: a bounded set, fit for a metric label.
const (
	FailNoClientCert    = "no_client_certificate" // the client sent none
	FailUnknownCA       = "unknown_ca"            // its chain reaches none of our roots (another mesh, a rotated root)
	FailExpired         = "expired"               // a certificate of its chain is expired or not yet valid
	FailBadCert         = "bad_certificate"       // otherwise invalid (no SPIFFE identity, wrong key usage, ...)
	FailRevoked         = "revoked"               // CRL_PATH revokes a certificate of its chain
	FailTrustDomain     = "wrong_trust_domain"    // a valid certificate of another trust domain
	FailCipher          = "cipher"                // a cipher suite the mesh does not use
	FailNotApproved     = "not_fips_approved"     // FIPS 140-3 mode: the peer offered only parameters, or a certificate key, the mode refuses
	FailNoLocalIdentity = "no_local_identity"     // we have no certificate for the address it dialed
	FailPeerAlert       = "peer_alert"            // the peer refused the handshake (our certificate, say)
	FailProtocol        = "protocol"              // not TLS, or a version or parameters we do not speak
	FailTimeout         = "timeout"               // the handshake did not finish in time
	FailPeerClosed      = "peer_closed"           // the peer closed or reset the connection mid-handshake
	FailOther           = "other"
)

// HandshakeFailure names why an inbound TLS handshake with a server config of this
// package failed (err as crypto/tls returned it), as one of the Fail* reasons, and says
// whether we closed the connection ourselves (shutdown, eviction): then it is not the
// peer's failure and the reason is "".
func HandshakeFailure(err error) string {
	var (
		revoked *RevokedError
		td      *trustDomainError
		ce      *cipherError
		uk      *unapprovedKeyError
		ua      x509.UnknownAuthorityError
		ci      x509.CertificateInvalidError
		op      *net.OpError
		rh      tls.RecordHeaderError
	)
	switch {
	case err == nil:
		return ""
	case errors.Is(err, errNoLocalIdentity):
		return FailNoLocalIdentity
	case errors.Is(err, net.ErrClosed):
		return ""
	case errors.Is(err, errNoPeerCert), strings.Contains(err.Error(), "client didn't provide a certificate"):
		return FailNoClientCert
	case errors.As(err, &revoked):
		return FailRevoked
	case errors.As(err, &td):
		return FailTrustDomain
	case errors.As(err, &ce):
		return FailCipher
	case errors.As(err, &uk), fips140.Enabled() && notApprovedNegotiation(err.Error()):
		return FailNotApproved
	case errors.As(err, &ua):
		return FailUnknownCA
	case errors.As(err, &ci):
		if ci.Reason == x509.Expired {
			return FailExpired
		}
		return FailBadCert
	case strings.HasPrefix(err.Error(), "certs: peer certificate"):
		return FailBadCert
	case errors.As(err, &op) && op.Op == "remote error":
		return FailPeerAlert
	case errors.Is(err, os.ErrDeadlineExceeded), errors.Is(err, context.DeadlineExceeded):
		return FailTimeout
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return FailPeerClosed
	case errors.As(err, &rh), strings.HasPrefix(err.Error(), "tls: "):
		return FailProtocol
	}
	return FailOther
}

// errBadIssued marks a certificate the CA returned that we cannot use.
var errBadIssued = errors.New("unusable certificate")

// CSR failure reasons (Config.OnFetchFailure): a bounded set, fit for a metric label.
const (
	CSRFailUnauthenticated  = "unauthenticated"   // the CA refused our token (expired, wrong audience): the failure users meet
	CSRFailPermissionDenied = "permission_denied" // the CA refused to sign this identity for us
	CSRFailUnavailable      = "unavailable"       // the CA cannot be reached
	CSRFailTimeout          = "timeout"           // no answer in time
	CSRFailInvalidResponse  = "invalid_response"  // an answer we cannot use: another identity, expired, malformed
	CSRFailOther            = "other"
)

// fetchFailure names why a CSR failed.
func fetchFailure(err error) string {
	switch status.Code(err) {
	case codes.Unauthenticated:
		return CSRFailUnauthenticated
	case codes.PermissionDenied:
		return CSRFailPermissionDenied
	case codes.Unavailable:
		return CSRFailUnavailable
	case codes.DeadlineExceeded:
		return CSRFailTimeout
	}
	switch {
	case errors.Is(err, context.DeadlineExceeded):
		return CSRFailTimeout
	case errors.Is(err, errBadIssued), strings.HasPrefix(err.Error(), "ca: response"):
		return CSRFailInvalidResponse
	case strings.HasPrefix(err.Error(), "ca: dial"):
		return CSRFailUnavailable
	}
	return CSRFailOther
}
