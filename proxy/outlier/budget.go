package outlier

import (
	"sync"

	"github.com/gozt/gozt/xds/state"
)

// The retry budget, Envoy's defaults (its retry_budget's budget_percent and
// min_retry_concurrency).
const (
	RetryPercent = 20 // retries in flight to a service, in percent of its connects in flight
	MinRetries   = 3  // retries in flight to a service allowed however few connects are
)

// RetryBudget bounds the retries in flight to each service to RetryPercent of the connects
// in flight to it (being connected: from the first pick until the client is answered),
// and at least MinRetries, as Envoy's retry budget does. When every endpoint of a service
// fails, retries then add at most a fifth to the connects aimed at it, where two retries
// each would triple them; when a few fail, as in a rolling update, the floor retries them.
// One per node, shared by every proxy, like the Detector. Safe for concurrent use.
type RetryBudget struct {
	mu sync.Mutex
	// services holds the services with a connect in flight, by namespace and hostname; an
	// entry goes when its last connect ends, so the map is as large as the services being
	// connected to now. Guarded by mu.
	services map[serviceKey]flights
}

type serviceKey struct{ namespace, hostname string }

// flights is what is in flight to one service.
type flights struct {
	connects, retries int
}

// NewRetryBudget returns an empty budget.
func NewRetryBudget() *RetryBudget {
	return &RetryBudget{services: make(map[serviceKey]flights)}
}

// Flight is one connect's place in its service's budget, from Begin to End.
type Flight struct {
	b        *RetryBudget
	key      serviceKey
	retrying bool // it holds a retry
}

// Begin counts a connect to svc in flight until End. A nil budget counts nothing.
func (b *RetryBudget) Begin(svc *state.Service) Flight {
	if b == nil {
		return Flight{}
	}
	key := serviceKey{svc.Namespace, svc.Hostname}
	b.mu.Lock()
	n := b.services[key]
	n.connects++
	b.services[key] = n
	b.mu.Unlock()
	return Flight{b: b, key: key}
}

// Retry asks for one more attempt on another endpoint and reports whether the service's
// budget has room for it. The retry is in flight until the next Retry or End: a retry
// that fails again gives its place back before asking for the next.
func (f *Flight) Retry() bool {
	if f.b == nil {
		return true
	}
	f.b.mu.Lock()
	defer f.b.mu.Unlock()
	n := f.b.services[f.key]
	if f.retrying {
		n.retries--
	}
	f.retrying = n.retries < max(MinRetries, n.connects*RetryPercent/100)
	if f.retrying {
		n.retries++
	}
	f.b.services[f.key] = n
	return f.retrying
}

// End ends the connect: it and its retry, if any, are no longer in flight.
func (f *Flight) End() {
	if f.b == nil {
		return
	}
	f.b.mu.Lock()
	n := f.b.services[f.key]
	n.connects--
	if f.retrying {
		n.retries--
	}
	if n.connects == 0 {
		delete(f.b.services, f.key)
	} else {
		f.b.services[f.key] = n
	}
	f.b.mu.Unlock()
	f.b = nil
}
