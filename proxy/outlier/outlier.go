// Package outlier is passive outlier detection for the endpoints outbound connections go
// to: an endpoint whose connects keep failing is ejected for a while, so new connections
// go elsewhere until it recovers or the control plane catches up. It also holds the retry
// budget (RetryBudget), which bounds the retries of those connects per service.
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
//     again at once, longer (Linkerd's probe); a success forgets its history.
//   - An ejected endpoint is not removed, only picked last (state.Avoid.Ejected): when every
//     endpoint of a service is ejected they are all tried as before, which is Envoy's panic
//     threshold at its simplest, and the "at most a fraction ejected" rule the issue asks
//     for at its limit (all but none left is still served).
//   - Endpoints are keyed by the *state.Workload the pick returned and the port it was
//     picked for (Endpoint), so a workload the control plane changes or replaces comes
//     back with a clean record, and a dead port of one service (its target port refused)
//     does not eject the pod for its other services and ports; a success on one port
//     says nothing of another, and clears only its own record.
//   - Only failures the endpoint caused count: the proxy leaves out its own (its
//     certificate, its file descriptors, its client gone; proxy/outbound.go).
//   - The pick asks about every endpoint it weighs (Ejected), so that question reads an
//     immutable snapshot of the records without a lock; the snapshot is rebuilt, under
//     the lock, only when an endpoint gets or loses a record or is ejected.
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

// Endpoint is what the detector keys on: a workload a pick returned and the port it was
// picked for (state.Route's Workload and EndpointPort).
type Endpoint struct {
	Workload *state.Workload
	Port     uint16
}

// Detector tracks consecutive connect failures per endpoint. It is shared by every proxy
// of a node (all pods' in in-pod mode), so what one pod's connections learn spares the
// others. Safe for concurrent use.
type Detector struct {
	cfg Config
	now func() time.Time

	// recorded maps every endpoint with a record to the end of its ejection (zero: not
	// ejected), or is nil when none has: an immutable copy of endpoints that Ejected and
	// Succeeded read without the lock, replaced under mu (publishLocked).
	recorded atomic.Pointer[map[Endpoint]time.Time]

	mu        sync.Mutex
	endpoints map[Endpoint]*record // guarded by mu
	nextSweep time.Time            // guarded by mu
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
	return &Detector{cfg: cfg, now: time.Now, endpoints: make(map[Endpoint]*record)}
}

// Failed records a failed connect to e, picked for service (its "namespace/hostname"), and
// reports whether this failure ejected it.
func (d *Detector) Failed(e Endpoint, service string) bool {
	now := d.now()
	d.mu.Lock()
	defer d.mu.Unlock()
	changed := d.sweepLocked(now)
	r := d.endpoints[e]
	if r == nil {
		r = &record{}
		d.endpoints[e] = r
		changed = true
	}
	r.last, r.service = now, service
	ejected := d.failLocked(r, now)
	if changed || ejected {
		d.publishLocked()
	}
	return ejected
}

// failLocked counts a failure on r and reports whether it ejects the endpoint.
func (d *Detector) failLocked(r *record, now time.Time) bool {
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

// Succeeded records a connect to e that worked: its history is forgotten (e's only: the
// workload's other ports keep theirs).
func (d *Detector) Succeeded(e Endpoint) {
	if m := d.recorded.Load(); m == nil {
		return
	} else if _, ok := (*m)[e]; !ok {
		return
	}
	d.mu.Lock()
	if _, ok := d.endpoints[e]; ok {
		delete(d.endpoints, e)
		d.publishLocked()
	}
	d.mu.Unlock()
}

// Ejected reports whether w, picked for port, is ejected now. It is the pick's
// state.Avoid.Ejected, asked for every endpoint a pick weighs: it takes no lock and
// allocates nothing.
func (d *Detector) Ejected(w *state.Workload, port uint16) bool {
	m := d.recorded.Load()
	if m == nil {
		return false
	}
	until, ok := (*m)[Endpoint{w, port}]
	return ok && !until.IsZero() && d.now().Before(until)
}

// Any reports whether some endpoint has a failure on record, so a pick that would find
// nothing to avoid can skip asking.
func (d *Detector) Any() bool { return d.recorded.Load() != nil }

// publishLocked replaces the snapshot Ejected and Succeeded read with the records now.
func (d *Detector) publishLocked() {
	if len(d.endpoints) == 0 {
		d.recorded.Store(nil)
		return
	}
	m := make(map[Endpoint]time.Time, len(d.endpoints))
	for e, r := range d.endpoints {
		m[e] = r.until
	}
	d.recorded.Store(&m)
}

// sweepLocked forgets, at most every Base, the endpoints whose last failure is older than
// the longest ejection and that are not ejected: a failure long past says nothing, and the
// map must not keep workloads the control plane has removed. It reports whether it forgot
// any.
func (d *Detector) sweepLocked(now time.Time) bool {
	if now.Before(d.nextSweep) {
		return false
	}
	d.nextSweep = now.Add(d.cfg.Base)
	n := len(d.endpoints)
	for e, r := range d.endpoints {
		if !now.Before(r.until) && now.Sub(r.last) > d.cfg.Max {
			delete(d.endpoints, e)
		}
	}
	return len(d.endpoints) != n
}

// Ejection is one ejected endpoint, as /config_dump shows it.
type Ejection struct {
	Workload  string    `json:"workload"` // namespace/name
	UID       string    `json:"uid"`
	Port      uint16    `json:"port"`    // the port it was picked for: its target port, a waypoint's HBONE port
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
	for e, r := range d.endpoints {
		if now.Before(r.until) {
			w := e.Workload
			out = append(out, Ejection{Workload: w.Namespace + "/" + w.Name, UID: w.UID, Port: e.Port, Service: r.service, Until: r.until, Ejections: r.ejections})
		}
	}
	slices.SortFunc(out, func(a, b Ejection) int {
		if c := strings.Compare(a.UID, b.UID); c != 0 {
			return c
		}
		return int(a.Port) - int(b.Port)
	})
	return out
}
