// Package outlier is passive outlier detection for the endpoints outbound connections go
// to: an endpoint whose connects keep failing is ejected for a while, so new connections
// go elsewhere until it recovers or the control plane catches up.
//
// The rules, and where they come from:
//   - Consecutive failures eject (Envoy's consecutive_gateway_failure, Linkerd's
//     consecutive failure accrual), counted only for failures that say the endpoint is
//     unreachable (the proxy decides: dial, TLS, a 5xx CONNECT answer; never a policy
//     denial). The threshold is lower than theirs (3 against 5 and 7): an L4 connect
//     failure is never an application's answer, so it is a stronger signal than a 5xx.
//   - The ejection lasts Base × 2^(n-1) for the n-th ejection in a row, capped (Envoy
//     multiplies its base time by the ejection count; Linkerd backs off exponentially).
//   - After an ejection ends the endpoint is on probation: its next failure ejects it
//     again at once, longer (Linkerd's probe); any success forgets its history.
//   - An ejected endpoint is not removed, only picked last (state.Avoid.Ejected): when every
//     endpoint of a service is ejected they are all tried as before, which is Envoy's panic
//     threshold at its simplest, and the "at most a fraction ejected" rule the issue asks
//     for at its limit (all but none left is still served).
//   - Endpoints are keyed by the *state.Workload the pick returned, so a workload the
//     control plane changes or replaces comes back with a clean record.
package outlier

import (
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gozt/gozt/xds/state"
)

// Defaults of Config.
const (
	DefaultFailures = 3
	DefaultBase     = 5 * time.Second
	DefaultMax      = 2 * time.Minute
)

// Config tunes a Detector; zero fields take the defaults above.
type Config struct {
	Failures int           // consecutive failures that eject an endpoint
	Base     time.Duration // first ejection
	Max      time.Duration // longest ejection
}

// Detector tracks consecutive connect failures per endpoint. It is shared by every proxy
// of a node (all pods' in in-pod mode), so what one pod's connections learn spares the
// others. Safe for concurrent use.
type Detector struct {
	cfg Config
	now func() time.Time

	// tracked is len(endpoints), read without the lock: the common case, no endpoint with a
	// failure on record, costs a connect one atomic load.
	tracked atomic.Int32

	mu        sync.Mutex
	endpoints map[*state.Workload]*record // guarded by mu
	nextSweep time.Time                   // guarded by mu
}

// record is one endpoint's history since its last success.
type record struct {
	failures  int       // consecutive, since the last ejection
	ejections int       // in a row, without a success between
	until     time.Time // ejected before this instant
	last      time.Time // last failure
	service   string    // the service it was last picked for, for Dump
}

// New returns a Detector.
func New(cfg Config) *Detector {
	if cfg.Failures <= 0 {
		cfg.Failures = DefaultFailures
	}
	if cfg.Base <= 0 {
		cfg.Base = DefaultBase
	}
	if cfg.Max < cfg.Base {
		cfg.Max = max(DefaultMax, cfg.Base)
	}
	return &Detector{cfg: cfg, now: time.Now, endpoints: make(map[*state.Workload]*record)}
}

// Failed records a failed connect to w, picked for service (its "namespace/hostname"), and
// reports whether this failure ejected it.
func (d *Detector) Failed(w *state.Workload, service string) bool {
	now := d.now()
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sweepLocked(now)
	r := d.endpoints[w]
	if r == nil {
		r = &record{}
		d.endpoints[w] = r
		d.tracked.Store(int32(len(d.endpoints)))
	}
	r.last, r.service = now, service
	if now.Before(r.until) {
		return false // already ejected: picked because nothing else was left
	}
	r.failures++
	if r.failures < d.cfg.Failures && r.ejections == 0 {
		return false
	}
	r.failures = 0
	r.ejections++
	r.until = now.Add(d.ejection(r.ejections))
	return true
}

// ejection is how long the n-th ejection in a row lasts.
func (d *Detector) ejection(n int) time.Duration {
	t := d.cfg.Base
	for i := 1; i < n && t < d.cfg.Max; i++ {
		t *= 2
	}
	return min(t, d.cfg.Max)
}

// Succeeded records a connect to w that worked: its history is forgotten.
func (d *Detector) Succeeded(w *state.Workload) {
	if d.tracked.Load() == 0 {
		return
	}
	d.mu.Lock()
	if _, ok := d.endpoints[w]; ok {
		delete(d.endpoints, w)
		d.tracked.Store(int32(len(d.endpoints)))
	}
	d.mu.Unlock()
}

// Ejected reports whether w is ejected now. It is the pick's state.Avoid.Ejected.
func (d *Detector) Ejected(w *state.Workload) bool {
	if d.tracked.Load() == 0 {
		return false
	}
	now := d.now()
	d.mu.Lock()
	defer d.mu.Unlock()
	r := d.endpoints[w]
	return r != nil && now.Before(r.until)
}

// Any reports whether some endpoint has a failure on record, so a pick that would find
// nothing to avoid can skip asking.
func (d *Detector) Any() bool { return d.tracked.Load() > 0 }

// sweepLocked forgets, at most every Base, the endpoints whose last failure is older than
// the longest ejection and that are not ejected: a failure long past says nothing, and the
// map must not keep workloads the control plane has removed.
func (d *Detector) sweepLocked(now time.Time) {
	if now.Before(d.nextSweep) {
		return
	}
	d.nextSweep = now.Add(d.cfg.Base)
	for w, r := range d.endpoints {
		if !now.Before(r.until) && now.Sub(r.last) > d.cfg.Max {
			delete(d.endpoints, w)
		}
	}
	d.tracked.Store(int32(len(d.endpoints)))
}

// Ejection is one ejected endpoint, as /config_dump shows it.
type Ejection struct {
	Workload  string    `json:"workload"` // namespace/name
	UID       string    `json:"uid"`
	Service   string    `json:"service"` // the service it was picked for when it last failed
	Until     time.Time `json:"until"`
	Ejections int       `json:"ejections"` // in a row, without a success between
}

// Dump lists the endpoints ejected now.
func (d *Detector) Dump() []Ejection {
	now := d.now()
	d.mu.Lock()
	defer d.mu.Unlock()
	out := []Ejection{}
	for w, r := range d.endpoints {
		if now.Before(r.until) {
			out = append(out, Ejection{Workload: w.Namespace + "/" + w.Name, UID: w.UID, Service: r.service, Until: r.until, Ejections: r.ejections})
		}
	}
	slices.SortFunc(out, func(a, b Ejection) int { return strings.Compare(a.UID, b.UID) })
	return out
}
