package certs

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"math/big"
	"net/url"
	"os"
	"sync"
	"sync/atomic"
	"time"
)

// CRL is the peer CA's certificate revocation list (CRL_PATH, mounted from the chart's
// peerCaCrl ConfigMap): one file of PEM blocks or one DER list, several CRLs allowed (a CA and
// its intermediates). A handshake is refused when any certificate of the peer's verified
// chain is listed by a CRL its issuer signed. The file is re-read when it changes, and Watch's
// callback then lets the caller close live connections whose peer became revoked
// (Manager.Revoked). An empty or missing file revokes nothing (a ConfigMap may be mounted
// after start); a malformed one keeps the last good lists, with an error logged once per
// content and shown by Refused: a node keeps enforcing what it knew rather than trusting
// every peer because of a bad push.
//
// A list past its nextUpdate stays in force, reported (a warning at each load, Info, and the
// caller's metric): revocation is permanent, so dropping a stale list would re-admit every
// certificate it revokes, and refusing to start would take a node's data plane down because
// the CA was late to re-sign; the Rust ztunnel ignores nextUpdate too. A list whose signature
// does not verify against the issuer it names is never used for that issuer and is reported
// the first time a peer of that issuer meets it (the issuer is known only then: intermediates
// come with the peer's chain).
type CRL struct {
	path string
	log  *slog.Logger

	mu    sync.RWMutex
	lists []*crlList // guarded by mu
	stamp fileStamp  // guarded by mu: the file as last read
	// The last content refused, and why; guarded by mu. It is logged once, not at every poll,
	// and shown by Refused until a good file replaces it.
	refused    fileStamp
	refusedErr error

	cancel context.CancelFunc
	done   chan struct{}
}

// crlList is one parsed list and what checking it against peers has shown of its signature.
type crlList struct {
	*x509.RevocationList
	sig atomic.Int32 // sigUnknown until a peer's chain holds its issuer
}

const (
	sigUnknown int32 = iota
	sigVerified
	sigInvalid
)

// fileStamp tells a changed file from the one read last: the content's SHA-256, so a
// rewrite within one mtime tick (or a ConfigMap's symlink swap) is seen too.
type fileStamp [sha256.Size]byte

// crlPoll is how often Watch looks at the file: a ConfigMap update lands within a minute or
// so anyway, and a stat every few seconds costs nothing.
const crlPoll = 2 * time.Second

// OpenCRL reads path. A file that exists but does not parse is an error: the operator
// asked for revocation and would otherwise get none.
func OpenCRL(path string, log *slog.Logger) (*CRL, error) {
	if log == nil {
		log = slog.Default()
	}
	c := &CRL{path: path, log: log}
	if _, err := c.reload(); err != nil {
		if !errors.Is(err, fs.ErrNotExist) {
			return nil, err
		}
		log.Warn("certs: CRL file not found; revoking nothing until it appears", "path", path)
	}
	return c, nil
}

// Watch re-reads the file when it changes until Close, and calls changed (if not nil) from
// its goroutine after new lists are in force.
func (c *CRL) Watch(changed func()) {
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel, c.done = cancel, make(chan struct{})
	go c.watch(ctx, changed)
}

func (c *CRL) watch(ctx context.Context, onChange func()) {
	defer close(c.done)
	t := time.NewTicker(crlPoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		changed, err := c.reload()
		switch {
		case err != nil && !errors.Is(err, fs.ErrNotExist):
			c.log.Error("certs: CRL file refused; the lists read before stay in force", "path", c.path, "err", err)
		case changed:
			c.mu.RLock()
			n := len(c.lists)
			c.mu.RUnlock()
			c.log.Info("certs: CRL file reloaded", "path", c.path, "lists", n)
			if onChange != nil {
				onChange()
			}
		}
	}
}

// Close stops Watch and waits for it; it is idempotent.
func (c *CRL) Close() {
	if c.cancel != nil {
		c.cancel()
		<-c.done
	}
}

// reload reads the file if it changed and swaps in its lists; changed says whether it did.
func (c *CRL) reload() (changed bool, err error) {
	data, err := os.ReadFile(c.path)
	if err != nil {
		return false, fmt.Errorf("certs: CRL %s: %w", c.path, err)
	}
	stamp := fileStamp(sha256.Sum256(data))
	c.mu.RLock()
	same := c.stamp == stamp || (c.refusedErr != nil && c.refused == stamp)
	c.mu.RUnlock()
	if same {
		return false, nil
	}
	lists, err := parseCRLs(data)
	if err != nil {
		err = fmt.Errorf("certs: CRL %s: %w", c.path, err)
		c.mu.Lock()
		c.refused, c.refusedErr = stamp, err
		c.mu.Unlock()
		return false, err
	}
	now := time.Now()
	for _, l := range lists {
		if !l.NextUpdate.IsZero() && now.After(l.NextUpdate) {
			c.log.Warn("certs: CRL is past its nextUpdate; its revocations stay in force until the CA publishes a new one",
				"path", c.path, "issuer", l.Issuer.String(), "number", l.Number, "nextUpdate", l.NextUpdate)
		}
	}
	c.mu.Lock()
	c.lists, c.stamp, c.refusedErr = lists, stamp, nil
	c.mu.Unlock()
	return true, nil
}

// Refused is why the file's current content was refused (the lists before it stay in
// force), or nil.
func (c *CRL) Refused() error {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return c.refusedErr
}

// parseCRLs reads PEM "X509 CRL" blocks, or one DER list; empty input is no lists.
func parseCRLs(data []byte) ([]*crlList, error) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return nil, nil
	}
	if !bytes.HasPrefix(data, []byte("-----BEGIN")) {
		l, err := x509.ParseRevocationList(data)
		if err != nil {
			return nil, fmt.Errorf("DER list: %w", err)
		}
		return []*crlList{{RevocationList: l}}, nil
	}
	var lists []*crlList
	for n := 1; ; n++ {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			if len(bytes.TrimSpace(data)) > 0 {
				return nil, fmt.Errorf("PEM block %d does not decode", n)
			}
			break
		}
		if b.Type != "X509 CRL" {
			return nil, fmt.Errorf("PEM block %d is %q, not X509 CRL", n, b.Type)
		}
		l, err := x509.ParseRevocationList(b.Bytes)
		if err != nil {
			return nil, fmt.Errorf("PEM block %d: %w", n, err)
		}
		lists = append(lists, &crlList{RevocationList: l})
	}
	return lists, nil
}

// RevokedError is a peer chain's certificate that a CRL revokes.
type RevokedError struct {
	Peer   []*url.URL        // the leaf's URI SANs: the peer's identity
	Cert   *x509.Certificate // the revoked certificate: the leaf or an intermediate
	Issuer *x509.Certificate // the CA whose CRL revokes it
}

func (e *RevokedError) Error() string {
	what := "peer certificate"
	if e.Cert.IsCA {
		what = "intermediate CA " + e.Cert.Subject.String() + " of peer"
	}
	return fmt.Sprintf("certs: %s %v (serial %s) is revoked by the CRL of %s", what, e.Peer, e.Cert.SerialNumber, e.Issuer.Subject)
}

// check returns a *RevokedError if a certificate of chain (leaf first, up to the root) is
// listed by a CRL signed by that certificate's issuer in the chain. A list whose signature
// does not verify against the issuer is not that issuer's and is not used for it (and is
// reported once). The signature is checked without asking for the issuer's cRLSign key
// usage, which some mesh CAs' certificates lack: the key signed the list, and that is what
// counts.
func (c *CRL) check(chain []*x509.Certificate) error {
	if c == nil {
		return nil
	}
	c.mu.RLock()
	lists := c.lists
	c.mu.RUnlock()
	for i := 0; i+1 < len(chain); i++ {
		cert, issuer := chain[i], chain[i+1]
		for _, l := range lists {
			if !bytes.Equal(l.RawIssuer, cert.RawIssuer) || !c.signedBy(l, issuer) {
				continue
			}
			if listed(l.RevocationList, cert.SerialNumber) {
				return &RevokedError{Peer: chain[0].URIs, Cert: cert, Issuer: issuer}
			}
		}
	}
	return nil
}

// signedBy reports whether issuer signed l, remembering the answer for Info and logging
// the first time a list is found not to be.
func (c *CRL) signedBy(l *crlList, issuer *x509.Certificate) bool {
	if issuer.CheckSignature(l.SignatureAlgorithm, l.RawTBSRevocationList, l.Signature) == nil {
		l.sig.Store(sigVerified) // over invalid too: another CA of the same name signed it
		return true
	}
	if l.sig.CompareAndSwap(sigUnknown, sigInvalid) {
		c.log.Error("certs: a CRL's signature does not verify against the CA it names; it revokes nothing",
			"path", c.path, "issuer", l.Issuer.String(), "number", l.Number)
	}
	return false
}

// checkSignatures runs signedBy for every list whose issuer is one of cas.
func (c *CRL) checkSignatures(cas []*x509.Certificate) {
	c.mu.RLock()
	lists := c.lists
	c.mu.RUnlock()
	for _, l := range lists {
		var named *x509.Certificate // a CA of the list's issuer name; several when a root is rotated under one name
		for _, ca := range cas {
			if !bytes.Equal(l.RawIssuer, ca.RawSubject) {
				continue
			}
			if named = ca; ca.CheckSignature(l.SignatureAlgorithm, l.RawTBSRevocationList, l.Signature) == nil {
				break
			}
		}
		if named != nil {
			c.signedBy(l, named)
		}
	}
}

// CRLInfo describes one list in force, for /config_dump and metrics.
type CRLInfo struct {
	Issuer     string    `json:"issuer"`
	Number     string    `json:"number"`
	ThisUpdate time.Time `json:"thisUpdate"`
	NextUpdate time.Time `json:"nextUpdate,omitzero"`
	Revoked    int       `json:"revokedCertificates"`
	Expired    bool      `json:"expired"`   // past nextUpdate: still in force
	Signature  string    `json:"signature"` // "verified", "invalid" (not used), or "unchecked" (no peer of its issuer met yet)
}

// Info describes the lists in force, in file order.
func (c *CRL) Info() []CRLInfo {
	c.mu.RLock()
	lists := c.lists
	c.mu.RUnlock()
	now := time.Now()
	out := make([]CRLInfo, 0, len(lists))
	for _, l := range lists {
		i := CRLInfo{
			Issuer: l.Issuer.String(), ThisUpdate: l.ThisUpdate, NextUpdate: l.NextUpdate,
			Revoked: len(l.RevokedCertificateEntries),
			Expired: !l.NextUpdate.IsZero() && now.After(l.NextUpdate),
		}
		if l.Number != nil {
			i.Number = l.Number.String()
		}
		switch l.sig.Load() {
		case sigVerified:
			i.Signature = "verified"
		case sigInvalid:
			i.Signature = "invalid"
		default:
			i.Signature = "unchecked"
		}
		out = append(out, i)
	}
	return out
}

// mayRevoke is a cheap first look for Manager.Revoked: whether any list names the issuer of
// a certificate of the presented chain and lists its serial. Only then is the chain
// verified, which costs far more.
func (c *CRL) mayRevoke(presented []*x509.Certificate) bool {
	c.mu.RLock()
	lists := c.lists
	c.mu.RUnlock()
	for _, cert := range presented {
		for _, l := range lists {
			if bytes.Equal(l.RawIssuer, cert.RawIssuer) && listed(l.RevocationList, cert.SerialNumber) {
				return true
			}
		}
	}
	return false
}

func listed(l *x509.RevocationList, serial *big.Int) bool {
	for _, e := range l.RevokedCertificateEntries {
		if e.SerialNumber.Cmp(serial) == 0 {
			return true
		}
	}
	return false
}
