// Package certs is the certificate manager: one entry per workload identity, fetched from a
// ca.Client on first use or prefetch, rotated at half of its lifetime, retried with jittered
// exponential backoff, and served while unexpired even if the CA is down. A CA that issues
// per workload instead (SPIRE's agent) pushes each workload's certificates (workload.go). It also builds the
// mesh's *tls.Config for both ends of an mTLS connection, looking certificates up per
// handshake so a rotation never needs a listener restart or reconnect logic.
//
// It does not talk to a CA itself (identity/ca does) and knows nothing of workloads or
// connections: callers say which identity they need and which identities they expect.
package certs

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
)

// Config tunes the manager; the zero value means the documented defaults.
type Config struct {
	FetchTimeout time.Duration // [10s] how long Certificate waits for a first fetch
	MaxInflight  int           // [8] CSRs in flight at once
	PQCOnly      bool          // COMPLIANCE_POLICY=pqc: key exchange X25519MLKEM768 only, no X25519 fallback
	TLS12        bool          // TLS12_ENABLED: accept TLS 1.2 (ECDHE, AES-GCM) beside 1.3, for peers limited to it (FIPS)
	CRL          *CRL          // CRL_PATH: refuse peers it revokes; nil: no revocation checks
	Logger       *slog.Logger  // [slog.Default()]
	// OnFetchFailure, if set, is told of every failed CSR with its reason, one of the
	// CSRFail* words (a metric label). It runs with the manager's lock held: it must only
	// count.
	OnFetchFailure func(reason string)
	// OnWithdraw, if set, is told the key of a workload whose SVIDs the SPIRE agent
	// withdrew (its entry was deleted), so that its live connections can be closed. It
	// runs on the subscription's goroutine, without the manager's lock.
	OnWithdraw func(key string)
}

// Backoff bounds for a failing fetch: start, factor 2, ±20% jitter, cap.
const (
	backoffStart = time.Second
	backoffMax   = 150 * time.Second
	fetchLimit   = time.Minute // one CSR round trip may not take longer
	// certlessBackoffMax caps the backoff of an identity with no valid certificate, whose
	// connections fail until a fetch succeeds: within it (and the CA client's own
	// reconnect backoff, capped at 1 s) of the CA's return, traffic resumes. An identity
	// still serving its certificate backs off to backoffMax.
	certlessBackoffMax = 1500 * time.Millisecond
	// retryWait is how long a caller with no certificate waits for a retry already
	// running after a failed fetch, rather than FetchTimeout: while the CA is down each
	// new connection fails fast.
	retryWait = time.Second
)

// Manager caches certificates per identity. An identity stays (and keeps rotating) from its
// first Certificate or Prefetch until Forget. Its rotation timers and fetches belong to it;
// Close stops them.
type Manager struct {
	cfg    Config
	client ca.Client
	slots  *slots // MaxInflight CSR slots, callers first
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	// subscriber is the client when it issues certificates per workload (SPIRE): then
	// certificates are workloads' (workload.go), never fetched per identity.
	subscriber Subscriber

	mu        sync.Mutex
	entries   map[identity.ID]*entry
	workloads map[string]*workloadEntry // per-workload certificates by workload key (workload.go)
	anyPush   chan struct{}             // closed and replaced at every push of any workload
	closed    bool
}

// entry is the state of one identity; its fields are guarded by Manager.mu.
type entry struct {
	id        identity.ID
	cur       *held         // latest good certificate, possibly expired
	err       error         // last fetch error, nil after a success
	fetching  chan struct{} // non-nil while a fetch runs; closed when it ends
	timer     *time.Timer   // next refresh or retry
	retryAt   time.Time     // when timer fires after a failure (zero otherwise)
	backoff   time.Duration // last backoff used; 0 after a success
	result    chan struct{} // closed and replaced each time a fetch ends
	wait      *waiter       // the running fetch's place in the CSR queue
	again     bool          // the source changed during the running fetch: fetch once more
	gen       uint64        // bumped when the timer is re-armed; a stale timer callback does nothing
	forgotten bool
}

// held is one issued certificate with what handshakes need, built once.
type held struct {
	iss  *ca.Issued
	pool *x509.CertPool

	once   sync.Once
	server *tls.Config // serverConfig, built on first inbound handshake
}

func newHeld(iss *ca.Issued) *held {
	pool := x509.NewCertPool()
	for _, r := range iss.Roots {
		pool.AddCert(r)
	}
	return &held{iss: iss, pool: pool}
}

func (h *held) valid(now time.Time) bool {
	return h != nil && now.Before(h.iss.NotAfter)
}

// New returns a manager fetching from c. It owns its rotation goroutines; Close stops them
// (Close does not close c).
func New(cfg Config, c ca.Client) *Manager {
	if cfg.FetchTimeout <= 0 {
		cfg.FetchTimeout = 10 * time.Second
	}
	if cfg.MaxInflight <= 0 {
		cfg.MaxInflight = 8
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &Manager{
		cfg: cfg, client: c, slots: newSlots(cfg.MaxInflight),
		ctx: ctx, cancel: cancel, entries: make(map[identity.ID]*entry),
		workloads: make(map[string]*workloadEntry), anyPush: make(chan struct{}),
	}
	if s, ok := c.(Subscriber); ok {
		m.subscriber = s
	}
	if n, ok := c.(ca.Notifier); ok {
		m.wg.Add(1)
		go m.followSource(n)
	}
	return m
}

// Close stops rotation and waits for in-flight fetches to end; it is idempotent.
func (m *Manager) Close() error {
	m.mu.Lock()
	m.closed = true
	for _, e := range m.entries {
		if e.timer != nil {
			e.timer.Stop()
		}
	}
	var stops []func()
	for _, e := range m.workloads {
		if e.stop != nil {
			stops, e.stop = append(stops, e.stop), nil
		}
	}
	m.mu.Unlock()
	for _, stop := range stops {
		stop()
	}
	m.cancel()
	m.wg.Wait()
	return nil
}

// followSource re-fetches every identity when a pushing source (Workload API) changes.
func (m *Manager) followSource(n ca.Notifier) {
	defer m.wg.Done()
	for {
		select {
		case <-n.Changed():
		case <-m.ctx.Done():
			return
		}
		m.mu.Lock()
		for _, e := range m.entries {
			if e.fetching != nil {
				e.again = true // it may have read the old state
			}
			m.startFetchLocked(e, false)
		}
		m.mu.Unlock()
	}
}

// Certificate returns the certificate for id: the cached one while unexpired, otherwise the
// result of a fetch that concurrent callers share, waited for at most FetchTimeout.
func (m *Manager) Certificate(ctx context.Context, id identity.ID) (*ca.Issued, error) {
	h, err := m.get(ctx, id)
	if err != nil {
		return nil, err
	}
	return h.iss, nil
}

func (m *Manager) get(ctx context.Context, id identity.ID) (*held, error) {
	if id.IsZero() {
		return nil, errors.New("certs: certificate for the zero identity")
	}
	if m.subscriber != nil {
		return m.anyWorkloadHeld(ctx, id)
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, errors.New("certs: manager closed")
	}
	e := m.entryLocked(id)
	now := time.Now()
	if e.cur.valid(now) {
		h := e.cur
		m.mu.Unlock()
		return h, nil
	}
	if e.fetching == nil {
		if e.retryAt.IsZero() {
			m.startFetchLocked(e, true)
		} else if e.err != nil || e.retryAt.After(now.Add(m.cfg.FetchTimeout)) {
			// Backing off after a failure: fail fast rather than let every new connection
			// wait for the retry or hammer a CA that is down.
			err := fmt.Errorf("certs: %s unavailable, next try in %v: %w", id, e.retryAt.Sub(now).Round(time.Millisecond), e.err)
			m.mu.Unlock()
			return nil, err
		}
	}
	if e.wait != nil {
		m.slots.promote(e.wait)
	}
	ch := e.result
	wait := m.cfg.FetchTimeout
	if e.err != nil { // a fetch already failed (or timed a caller out): fail fast
		wait = min(wait, retryWait)
	}
	m.mu.Unlock()

	t := time.NewTimer(wait)
	defer t.Stop()
	timeout := t.C
	if dl, ok := ctx.Deadline(); ok && !dl.After(now.Add(wait)) {
		timeout = nil // the caller gives up first: its error, not ours
	}
	select {
	case <-ch:
	case <-timeout:
		err := fmt.Errorf("certs: %s: no certificate after %v", id, wait)
		m.mu.Lock()
		if e.err == nil && !e.cur.valid(time.Now()) {
			e.err = err // the fetch hangs: callers after this one wait only retryWait
		}
		if e.err != err {
			err = fmt.Errorf("%w (last fetch: %w)", err, e.err)
		}
		m.mu.Unlock()
		return nil, err
	case <-ctx.Done():
		return nil, fmt.Errorf("certs: %s: %w", id, ctx.Err())
	case <-m.ctx.Done():
		return nil, errors.New("certs: manager closed")
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if e.cur.valid(time.Now()) {
		return e.cur, nil
	}
	if e.err != nil {
		return nil, fmt.Errorf("certs: %s: %w", id, e.err)
	}
	return nil, fmt.Errorf("certs: %s: no certificate", id)
}

// entryLocked returns id's entry, creating it.
func (m *Manager) entryLocked(id identity.ID) *entry {
	e := m.entries[id]
	if e == nil {
		e = &entry{id: id, result: make(chan struct{})}
		m.entries[id] = e
	}
	return e
}

// Prefetch starts a background fetch for id unless it is cached or already being fetched
// (a workload with that identity appeared on this node).
func (m *Manager) Prefetch(id identity.ID) {
	if id.IsZero() || m.subscriber != nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return
	}
	e := m.entryLocked(id)
	if e.cur == nil && e.fetching == nil && e.retryAt.IsZero() {
		m.startFetchLocked(e, false)
	}
}

// Forget drops id's certificate and stops its rotation (the last workload with that
// identity went). A fetch in flight finishes for its waiters and is then discarded.
func (m *Manager) Forget(id identity.ID) {
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.entries[id]
	if e == nil {
		return
	}
	delete(m.entries, id)
	e.forgotten = true
	if e.timer != nil {
		e.timer.Stop()
	}
}

// startFetchLocked starts a fetch for e unless one is running; urgent when a caller waits.
func (m *Manager) startFetchLocked(e *entry, urgent bool) {
	if m.closed || e.forgotten || e.fetching != nil {
		return
	}
	if e.timer != nil {
		e.timer.Stop()
		e.timer = nil
	}
	e.gen++
	e.retryAt = time.Time{}
	e.fetching = make(chan struct{})
	e.wait = newWaiter(urgent)
	m.wg.Add(1)
	go m.fetch(e, e.wait)
}

// fetch runs one CSR for e, bounded by MaxInflight, and schedules the next one.
func (m *Manager) fetch(e *entry, w *waiter) {
	defer m.wg.Done()
	var iss *ca.Issued
	err := m.slots.acquire(m.ctx, w)
	if err != nil {
		err = errors.New("certs: manager closed")
	} else {
		ctx, cancel := context.WithTimeout(m.ctx, fetchLimit)
		start := time.Now()
		iss, err = m.client.Fetch(ctx, e.id)
		cancel()
		m.slots.release()
		if err == nil {
			if got, ierr := iss.Identity(); ierr != nil || got != e.id {
				err = fmt.Errorf("certs: CA returned a certificate for %v, asked for %s: %w", got, e.id, errBadIssued)
			} else if !time.Now().Before(iss.NotAfter) {
				err = fmt.Errorf("certs: CA returned a certificate for %s that expired at %s (is this host's clock ahead?): %w",
					e.id, iss.NotAfter.UTC().Format(time.RFC3339), errBadIssued)
			}
		}
		if err == nil {
			m.cfg.Logger.Debug("certs: fetched", "identity", e.id, "took", time.Since(start), "notAfter", iss.NotAfter)
		}
	}

	m.mu.Lock()
	defer m.mu.Unlock()
	now := time.Now()
	if err == nil {
		e.cur, e.err, e.backoff = newHeld(iss), nil, 0
		m.scheduleLocked(e, refreshIn(iss, now), false)
	} else {
		// A retry failing as the last attempt did is DEBUG: a CA that stays down is one
		// WARN per identity, not one per retry.
		level := slog.LevelWarn
		if e.err != nil && e.err.Error() == err.Error() {
			level = slog.LevelDebug
		}
		e.err = err
		if e.backoff == 0 {
			e.backoff = backoffStart
		} else {
			e.backoff = min(2*e.backoff, backoffMax)
		}
		if !e.cur.valid(now) {
			e.backoff = min(e.backoff, certlessBackoffMax)
		}
		d := jitter(e.backoff)
		if m.ctx.Err() == nil {
			m.cfg.Logger.Log(m.ctx, level, "certs: fetch failed", "identity", e.id, "err", err, "retryIn", d, "serving", e.cur.valid(now))
			if m.cfg.OnFetchFailure != nil {
				m.cfg.OnFetchFailure(fetchFailure(err))
			}
		}
		m.scheduleLocked(e, d, true)
	}
	close(e.fetching)
	e.fetching = nil
	e.wait = nil
	close(e.result)
	e.result = make(chan struct{})
	if e.again {
		e.again = false
		m.startFetchLocked(e, false)
	}
}

// refreshIn is when to renew iss: at half its lifetime (as ztunnel does), but no sooner
// than a quarter of what is left of it. A certificate issued with more than a third of its
// life gone (a NotBefore backdated that far, a skewed clock) would otherwise be renewed at
// once, and its successor too, in a loop against the CA.
func refreshIn(iss *ca.Issued, now time.Time) time.Duration {
	life := iss.NotAfter.Sub(iss.NotBefore)
	return max(iss.NotBefore.Add(life/2).Sub(now), iss.NotAfter.Sub(now)/4)
}

// scheduleLocked arms e's timer to fetch again after d.
func (m *Manager) scheduleLocked(e *entry, d time.Duration, retry bool) {
	if m.closed || e.forgotten {
		return
	}
	if d < 0 {
		d = 0
	}
	if retry {
		e.retryAt = time.Now().Add(d)
	} else {
		e.retryAt = time.Time{}
	}
	if e.timer != nil {
		e.timer.Stop()
	}
	e.gen++
	gen := e.gen
	e.timer = time.AfterFunc(d, func() {
		m.mu.Lock()
		defer m.mu.Unlock()
		if e.gen != gen {
			return
		}
		e.retryAt = time.Time{}
		m.startFetchLocked(e, false)
	})
}

// jitter spreads d by ±20% so identities that failed together do not retry together.
func jitter(d time.Duration) time.Duration {
	return time.Duration(float64(d) * (0.8 + 0.4*rand.Float64()))
}
