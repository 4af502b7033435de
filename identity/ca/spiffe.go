package ca

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"

	"github.com/spiffe/go-spiffe/v2/workloadapi"

	"github.com/gozt/gozt/identity"
)

// spiffeClient follows a SPIFFE Workload API agent (e.g. SPIRE). The agent pushes SVIDs and
// bundles; the client keeps the latest context and Fetch picks the SVID whose ID is the one
// asked for. Roots are every bundle the agent sent, federated ones included.
type spiffeClient struct {
	api    *workloadapi.Client
	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex
	latest  *workloadapi.X509Context
	lastErr error
	updated chan struct{} // closed and replaced on every update
	closed  bool
}

var _ Notifier = (*spiffeClient)(nil)

func newSpiffe(ctx context.Context, socket string) (*spiffeClient, error) {
	addr := socket
	if !strings.Contains(addr, "://") {
		addr = "unix://" + addr
	}
	api, err := workloadapi.New(ctx, workloadapi.WithAddr(addr))
	if err != nil {
		return nil, fmt.Errorf("ca: SPIFFE_ENDPOINT_SOCKET %q: %w", socket, err)
	}
	wctx, cancel := context.WithCancel(context.Background())
	c := &spiffeClient{api: api, cancel: cancel, done: make(chan struct{}), updated: make(chan struct{})}
	go c.watch(wctx)
	return c, nil
}

// watch runs the Workload API stream until Close; go-spiffe reconnects with backoff.
func (c *spiffeClient) watch(ctx context.Context) {
	defer close(c.done)
	// It returns only when ctx ends or the stream fails for good.
	if err := c.api.WatchX509Context(ctx, c); ctx.Err() == nil {
		slog.Warn("ca: workload API watch ended", "err", err)
	}
}

func (c *spiffeClient) OnX509ContextUpdate(x *workloadapi.X509Context) {
	c.mu.Lock()
	c.latest, c.lastErr = x, nil
	close(c.updated)
	c.updated = make(chan struct{})
	c.mu.Unlock()
}

func (c *spiffeClient) OnX509ContextWatchError(err error) {
	c.mu.Lock()
	c.lastErr = err
	c.mu.Unlock()
}

// Changed implements Notifier.
func (c *spiffeClient) Changed() <-chan struct{} {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.updated
}

// Fetch waits (bounded by ctx) for the first update, then returns the SVID for id.
func (c *spiffeClient) Fetch(ctx context.Context, id identity.ID) (*Issued, error) {
	for {
		c.mu.Lock()
		x, lastErr, ch, closed := c.latest, c.lastErr, c.updated, c.closed
		c.mu.Unlock()
		if closed {
			return nil, errors.New("ca: client closed")
		}
		if x != nil {
			return fromX509Context(id, x)
		}
		select {
		case <-ch:
		case <-ctx.Done():
			if lastErr != nil {
				return nil, fmt.Errorf("ca: workload API: %w", lastErr)
			}
			return nil, fmt.Errorf("ca: workload API: no SVIDs yet: %w", ctx.Err())
		}
	}
}

func fromX509Context(id identity.ID, x *workloadapi.X509Context) (*Issued, error) {
	var have []string
	for _, s := range x.SVIDs {
		if s.ID.String() != id.String() {
			have = append(have, s.ID.String())
			continue
		}
		signer := s.PrivateKey
		if signer == nil || len(s.Certificates) == 0 {
			return nil, fmt.Errorf("ca: workload API SVID for %s has no usable key", id)
		}
		// The SVID's own trust domain first, then federated bundles.
		var roots []*x509.Certificate
		if b, ok := x.Bundles.Get(s.ID.TrustDomain()); ok {
			roots = append(roots, b.X509Authorities()...)
		}
		for _, b := range x.Bundles.Bundles() {
			if b.TrustDomain() != s.ID.TrustDomain() {
				roots = append(roots, b.X509Authorities()...)
			}
		}
		return assemble(id, signer, s.Certificates, roots)
	}
	return nil, fmt.Errorf("ca: workload API has no SVID for %s (has %v)", id, have)
}

// Close stops the watch and closes the Workload API connection; it is idempotent.
func (c *spiffeClient) Close() error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	c.mu.Unlock()
	c.cancel()
	<-c.done
	return c.api.Close()
}
