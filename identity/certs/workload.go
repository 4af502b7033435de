package certs

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
)

// Per-workload certificates: CA_PROVIDER=spire, whose agent issues SVIDs to workloads, not
// to identities (ca.Delegated). The manager does not fetch or renew these: it subscribes
// to each workload the node serves (Workload), keeps what the agent last pushed, and builds
// the TLS configurations from it as for any certificate. A pod's proxy presents its own
// pod's SVID (WorkloadCerts); the manager's own ClientConfig and ServerConfig, which node
// mode's one proxy uses for every workload, present an SVID of some subscribed workload
// with the identity asked for, since its HBONE pool is shared by identity.

// Subscriber is a per-workload certificate source: *ca.Delegated.
type Subscriber interface {
	Subscribe(w ca.DelegatedWorkload, push func(ca.SVIDs)) (stop func())
}

var _ Subscriber = (*ca.Delegated)(nil)

// WorkloadRef names a workload to subscribe to.
type WorkloadRef struct {
	Key  string // unique per workload on this node: its pod UID (in-pod) or xDS UID
	Name string // namespace/name, for logs and /config_dump
	As   ca.DelegatedWorkload
}

// errNoSVID is the agent's answer with no SVID for a workload: no entry matches it yet, or
// its entry was deleted.
var errNoSVID = errors.New("the SPIRE agent gives it no SVID (no registration entry matches it, or its entry was deleted)")

// workloadEntry is one subscribed workload; its fields are guarded by Manager.mu.
type workloadEntry struct {
	ref     WorkloadRef
	refs    int           // holders of Workload's release; the subscription stops at 0
	stop    func()        // the subscription's
	svids   []svid        // the agent's last push, one per SVID; nil when it has none
	err     error         // why svids is empty, or why the stream is down
	pushed  bool          // the agent has answered (or failed) at least once
	had     bool          // it had an SVID once: none now is a withdrawal, not a wait
	changed chan struct{} // closed and replaced at every push
}

// svid is one SVID of a workload, with the identity it carries.
type svid struct {
	id identity.ID
	h  *held
}

// Workload subscribes to w's certificates, unless it is subscribed already (the same key),
// and returns the certificate source its proxy presents them with. release, called once
// when the workload's proxy has stopped, drops the subscription with the last holder.
func (m *Manager) Workload(w WorkloadRef) (src *WorkloadCerts, release func(), err error) {
	if m.subscriber == nil {
		return nil, nil, errors.New("certs: the CA issues certificates per identity, not per workload")
	}
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil, nil, errors.New("certs: manager closed")
	}
	e := m.workloads[w.Key]
	fresh := e == nil
	if fresh {
		e = &workloadEntry{ref: w, changed: make(chan struct{})}
		m.workloads[w.Key] = e
	}
	e.refs++
	m.mu.Unlock()
	if fresh {
		stop := m.subscriber.Subscribe(w.As, func(u ca.SVIDs) { m.pushed(e, u) })
		m.mu.Lock()
		e.stop = stop
		m.mu.Unlock()
	}
	var once bool
	return &WorkloadCerts{m, w.Key}, func() {
		m.mu.Lock()
		if once {
			m.mu.Unlock()
			return
		}
		once = true
		e.refs--
		var stop func()
		if e.refs == 0 {
			delete(m.workloads, w.Key)
			stop, e.stop = e.stop, nil
		}
		m.mu.Unlock()
		if stop != nil {
			stop() // waits for the subscription's goroutine, which may be waiting for mu
		}
	}, nil
}

// pushed takes one push of e's subscription; none once e was released (a push racing the
// release must not act on a new subscription of the same key).
func (m *Manager) pushed(e *workloadEntry, u ca.SVIDs) {
	m.mu.Lock()
	if m.workloads[e.ref.Key] != e {
		m.mu.Unlock()
		return
	}
	e.pushed = true
	withdrawn := false
	switch {
	case u.Err != nil:
		e.err = u.Err // what it holds stays: the agent is away, not withdrawing it
	case len(u.Issued) == 0:
		withdrawn = e.had && len(e.svids) > 0
		e.svids, e.err = nil, errNoSVID
	default:
		e.svids, e.err, e.had = make([]svid, 0, len(u.Issued)), nil, true
		for _, iss := range u.Issued {
			if id, err := iss.Identity(); err == nil {
				e.svids = append(e.svids, svid{id, newHeld(iss)})
			}
		}
	}
	close(e.changed)
	e.changed = make(chan struct{})
	close(m.anyPush)
	m.anyPush = make(chan struct{})
	onWithdraw := m.cfg.OnWithdraw
	m.mu.Unlock()
	if u.Err != nil {
		m.cfg.Logger.Debug("certs: SPIRE stream down", "workload", e.ref.Name, "err", u.Err)
	} else {
		m.cfg.Logger.Debug("certs: SPIRE pushed SVIDs", "workload", e.ref.Name, "svids", len(u.Issued))
	}
	if withdrawn {
		m.cfg.Logger.Warn("certs: the SPIRE agent withdrew a workload's SVIDs; its connections are closed and new ones refused", "workload", e.ref.Name, "key", e.ref.Key)
		if onWithdraw != nil {
			onWithdraw(e.ref.Key)
		}
	}
}

// pickLocked returns e's valid SVID for id, nil if it has none.
func (e *workloadEntry) pickLocked(id identity.ID, now time.Time) *held {
	for _, s := range e.svids {
		if s.id == id && s.h.valid(now) {
			return s.h
		}
	}
	return nil
}

// errLocked says why e has no SVID for id.
func (e *workloadEntry) errLocked(id identity.ID) error {
	if e.err != nil {
		return fmt.Errorf("certs: workload %s (%s): %w", e.ref.Name, e.ref.As, e.err)
	}
	var have []string
	for _, s := range e.svids {
		have = append(have, s.id.String())
	}
	return fmt.Errorf("certs: workload %s (%s): the SPIRE agent gives it no valid SVID for %s (has %v)", e.ref.Name, e.ref.As, id, have)
}

// workloadHeld returns workload key's SVID for id, waiting up to FetchTimeout while the
// workload has had none yet and its stream is up (a new pod's first connection can race
// the agent's first push). A workload whose SVID was withdrawn, or whose stream is down
// with none held, fails at once.
func (m *Manager) workloadHeld(ctx context.Context, key string, id identity.ID) (*held, error) {
	var timeout *time.Timer // made when a lookup first has to wait
	defer func() {
		if timeout != nil {
			timeout.Stop()
		}
	}()
	for {
		m.mu.Lock()
		e := m.workloads[key]
		if e == nil {
			m.mu.Unlock()
			return nil, fmt.Errorf("certs: workload %s is not subscribed to (its proxy has stopped)", key)
		}
		if h := e.pickLocked(id, time.Now()); h != nil {
			m.mu.Unlock()
			return h, nil
		}
		if e.had || (e.pushed && e.err != errNoSVID) {
			err := e.errLocked(id)
			m.mu.Unlock()
			return nil, err
		}
		ch := e.changed
		m.mu.Unlock()
		if timeout == nil {
			timeout = time.NewTimer(m.cfg.FetchTimeout)
		}
		select {
		case <-ch:
		case <-timeout.C:
			m.mu.Lock()
			err := fmt.Errorf("certs: workload %s (%s): no SVID for %s after %v", e.ref.Name, e.ref.As, id, m.cfg.FetchTimeout)
			if e.pushed {
				err = fmt.Errorf("%w: %w", err, e.errLocked(id))
			}
			m.mu.Unlock()
			return nil, err
		case <-ctx.Done():
			return nil, fmt.Errorf("certs: %s: %w", id, ctx.Err())
		case <-m.ctx.Done():
			return nil, errors.New("certs: manager closed")
		}
	}
}

// anyWorkloadHeld returns an SVID for id of any subscribed workload, the one that lasts
// longest, waiting up to FetchTimeout while a subscription has had no answer yet.
func (m *Manager) anyWorkloadHeld(ctx context.Context, id identity.ID) (*held, error) {
	var timeout *time.Timer // made when a lookup first has to wait
	defer func() {
		if timeout != nil {
			timeout.Stop()
		}
	}()
	for {
		m.mu.Lock()
		var best *held
		pending := false
		now := time.Now()
		for _, e := range m.workloads {
			if h := e.pickLocked(id, now); h != nil && (best == nil || h.iss.NotAfter.After(best.iss.NotAfter)) {
				best = h
			}
			pending = pending || !e.pushed
		}
		if best != nil {
			m.mu.Unlock()
			return best, nil
		}
		var errs []error // why, for the first few workloads (a node may have hundreds)
		more := 0
		for _, e := range m.sortedWorkloadsLocked() {
			if e.pushed && len(errs) < 3 {
				errs = append(errs, e.errLocked(id))
			} else if e.pushed {
				more++
			}
		}
		if more > 0 {
			errs = append(errs, fmt.Errorf("and %d more workloads", more))
		}
		ch := m.anyPush
		m.mu.Unlock()
		if !pending {
			if len(errs) == 0 {
				return nil, fmt.Errorf("certs: no workload with identity %s is subscribed to SPIRE", id)
			}
			return nil, fmt.Errorf("certs: no SPIRE SVID for %s: %w", id, errors.Join(errs...))
		}
		if timeout == nil {
			timeout = time.NewTimer(m.cfg.FetchTimeout)
		}
		select {
		case <-ch:
		case <-timeout.C:
			return nil, fmt.Errorf("certs: no SPIRE SVID for %s after %v", id, m.cfg.FetchTimeout)
		case <-ctx.Done():
			return nil, fmt.Errorf("certs: %s: %w", id, ctx.Err())
		case <-m.ctx.Done():
			return nil, errors.New("certs: manager closed")
		}
	}
}

// WorkloadsReady is nil once every subscribed workload holds an SVID, else why each that
// does not has none: readiness waits for a workload's SVID as for an identity's certificate.
func (m *Manager) WorkloadsReady() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	var errs []error
	now := time.Now()
	for _, e := range m.sortedWorkloadsLocked() {
		if !slices.ContainsFunc(e.svids, func(s svid) bool { return s.h.valid(now) }) {
			err := e.err
			if err == nil {
				err = errors.New("waiting for the SPIRE agent's first answer")
			}
			errs = append(errs, fmt.Errorf("workload %s (%s): %w", e.ref.Name, e.ref.As, err))
		}
	}
	return errors.Join(errs...)
}

func (m *Manager) sortedWorkloadsLocked() []*workloadEntry {
	out := make([]*workloadEntry, 0, len(m.workloads))
	for _, e := range m.workloads {
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b *workloadEntry) int { return cmp.Compare(a.ref.Key, b.ref.Key) })
	return out
}

// WorkloadCerts is one workload's certificate source (proxy.CertSource): its TLS
// configurations present that workload's own SVIDs and nothing else.
type WorkloadCerts struct {
	m   *Manager
	key string
}

func (w *WorkloadCerts) get(ctx context.Context, id identity.ID) (*held, error) {
	return w.m.workloadHeld(ctx, w.key, id)
}

// ClientConfig is Manager.ClientConfig presenting the workload's SVID for src.
func (w *WorkloadCerts) ClientConfig(ctx context.Context, src identity.ID, expected []identity.ID) (*tls.Config, error) {
	return w.m.clientConfig(ctx, w.get, src, expected)
}

// ServerConfig is Manager.ServerConfig presenting the workload's SVID for local's identity.
func (w *WorkloadCerts) ServerConfig(local func(*tls.ClientHelloInfo) (identity.ID, error)) *tls.Config {
	return w.m.serverConfig(w.get, local)
}
