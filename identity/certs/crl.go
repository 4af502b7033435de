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
	"os"
	"sync"
	"time"
)

// CRL is the peer CA's certificate revocation list (CRL_PATH, mounted from the chart's
// peerCaCrl ConfigMap): one file of PEM blocks or one DER list, several CRLs allowed (a CA and
// its intermediates). A handshake is refused when any certificate of the peer's verified
// chain is listed by a CRL its issuer signed. The file is re-read when it changes; an empty
// or missing file revokes nothing (a ConfigMap may be mounted after start), a malformed one
// keeps the last good lists.
//
// Connections already established are not re-checked when the list changes (the Rust
// ztunnel closes those whose peer became revoked): they end at their next reconnect.
type CRL struct {
	path string
	log  *slog.Logger

	mu    sync.RWMutex
	lists []*x509.RevocationList // guarded by mu
	stamp fileStamp              // guarded by mu: the file as last read

	cancel context.CancelFunc
	done   chan struct{}
}

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

// Watch re-reads the file when it changes until Close.
func (c *CRL) Watch() {
	ctx, cancel := context.WithCancel(context.Background())
	c.cancel, c.done = cancel, make(chan struct{})
	go c.watch(ctx)
}

func (c *CRL) watch(ctx context.Context) {
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
			c.log.Warn("certs: CRL file unreadable; keeping the lists read before", "path", c.path, "err", err)
		case changed:
			c.mu.RLock()
			n := len(c.lists)
			c.mu.RUnlock()
			c.log.Info("certs: CRL file reloaded", "path", c.path, "lists", n)
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
	same := c.stamp == stamp
	c.mu.RUnlock()
	if same {
		return false, nil
	}
	lists, err := parseCRLs(data)
	if err != nil {
		return false, fmt.Errorf("certs: CRL %s: %w", c.path, err)
	}
	c.mu.Lock()
	c.lists, c.stamp = lists, stamp
	c.mu.Unlock()
	return true, nil
}

// parseCRLs reads PEM "X509 CRL" blocks, or one DER list; empty input is no lists.
func parseCRLs(data []byte) ([]*x509.RevocationList, error) {
	data = bytes.TrimSpace(data)
	if len(data) == 0 {
		return nil, nil
	}
	if !bytes.HasPrefix(data, []byte("-----BEGIN")) {
		l, err := x509.ParseRevocationList(data)
		if err != nil {
			return nil, fmt.Errorf("DER list: %w", err)
		}
		return []*x509.RevocationList{l}, nil
	}
	var lists []*x509.RevocationList
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
		lists = append(lists, l)
	}
	return lists, nil
}

// check returns an error if a certificate of chain (leaf first, up to the root) is listed by a
// CRL signed by that certificate's issuer in the chain. A list whose signature does not
// verify against the issuer is not that issuer's and is not used for it. The signature is
// checked without asking for the issuer's cRLSign key usage, which some mesh CAs' certificates
// lack: the key signed the list, and that is what counts.
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
			if !bytes.Equal(l.RawIssuer, cert.RawIssuer) || issuer.CheckSignature(l.SignatureAlgorithm, l.RawTBSRevocationList, l.Signature) != nil {
				continue
			}
			if listed(l, cert.SerialNumber) {
				return fmt.Errorf("certs: peer certificate %v (serial %s) is revoked by the CRL of %s", cert.URIs, cert.SerialNumber, issuer.Subject)
			}
		}
	}
	return nil
}

func listed(l *x509.RevocationList, serial *big.Int) bool {
	for _, e := range l.RevokedCertificateEntries {
		if e.SerialNumber.Cmp(serial) == 0 {
			return true
		}
	}
	return false
}
