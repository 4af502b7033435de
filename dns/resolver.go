package dns

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// Resolver resolves hostnames on demand for the data plane: a workload known only by its
// hostname (a ServiceEntry with DNS resolution) is dialed at an address its name resolves
// to when a connection picks it, as the Rust ztunnel does (state.rs,
// resolve_on_demand_dns). It asks the nameservers of ztunnel's own resolv.conf (the system
// resolver's, never a pod's) for A and AAAA of the name as given (no search list: a
// ServiceEntry's hosts are fully qualified), and keeps each answer for its TTL (the smallest
// of its records', at most MaxTTL) in a cache of at most MaxEntries names. Concurrent
// lookups of one name share one query; failures are not kept.
type Resolver struct {
	fwd        *Server // its upstreams and exchange; it never listens
	maxEntries int
	maxTTL     time.Duration
	now        func() time.Time // a variable for tests

	mu    sync.Mutex
	cache map[string]*answer // guarded by mu; an entry is final once its done is closed
}

// answer is one name's lookup: in flight until done is closed, then its fields are fixed.
type answer struct {
	done    chan struct{}
	addrs   []netip.Addr
	err     error
	expires time.Time
}

// ResolverConfig configures a Resolver; the zero value means the defaults.
type ResolverConfig struct {
	// Upstreams are nameservers as host[:port]; empty means ResolvConf's [/etc/resolv.conf].
	Upstreams  []string
	ResolvConf string
	// Timeout bounds one exchange with one nameserver [5s].
	Timeout time.Duration
	// MaxEntries bounds the names cached [1024]; MaxTTL how long an answer is kept [1h].
	MaxEntries int
	MaxTTL     time.Duration
}

// NewResolver reads the nameservers now: a node without one cannot resolve anything.
func NewResolver(cfg ResolverConfig) (*Resolver, error) {
	if cfg.MaxEntries <= 0 {
		cfg.MaxEntries = 1024
	}
	if cfg.MaxTTL <= 0 {
		cfg.MaxTTL = time.Hour
	}
	fwd := New(Config{Upstreams: cfg.Upstreams, ResolvConf: cfg.ResolvConf, UpstreamTimeout: cfg.Timeout}, nil, nil)
	if err := fwd.loadResolvConf(); err != nil {
		return nil, err
	}
	return &Resolver{fwd: fwd, maxEntries: cfg.MaxEntries, maxTTL: cfg.MaxTTL, now: time.Now, cache: map[string]*answer{}}, nil
}

// LookupHost returns host's addresses, from the cache while its TTL lasts. The slice is
// shared with other callers: read it, never write it.
func (r *Resolver) LookupHost(ctx context.Context, host string) ([]netip.Addr, error) {
	name := normalize(host)
	if name == "" {
		return nil, errors.New("dns: on-demand lookup of an empty hostname")
	}
	r.mu.Lock()
	a := r.cache[name]
	if a != nil {
		select {
		case <-a.done:
			if a.err != nil || !r.now().Before(a.expires) {
				delete(r.cache, name)
				a = nil
			}
		default:
		}
	}
	if a != nil {
		r.mu.Unlock()
		select {
		case <-a.done:
			return a.addrs, a.err
		case <-ctx.Done():
			return nil, fmt.Errorf("dns: on-demand lookup of %s: %w", name, ctx.Err())
		}
	}
	a = &answer{done: make(chan struct{})}
	if r.makeRoomLocked() {
		r.cache[name] = a
	}
	r.mu.Unlock()
	// Waiters share this query, so the caller leaving early does not cut it short; the
	// forwarder's per-exchange timeout bounds it.
	a.addrs, a.expires, a.err = r.query(context.WithoutCancel(ctx), name)
	close(a.done)
	return a.addrs, a.err
}

// makeRoomLocked drops expired and failed answers when the cache is full, then the one
// expiring first; false if every entry is still in flight (the new one goes uncached).
func (r *Resolver) makeRoomLocked() bool {
	if len(r.cache) < r.maxEntries {
		return true
	}
	now := r.now()
	var first string
	var firstAt time.Time
	for name, a := range r.cache {
		select {
		case <-a.done:
		default:
			continue
		}
		if a.err != nil || !now.Before(a.expires) {
			delete(r.cache, name)
			continue
		}
		if first == "" || a.expires.Before(firstAt) {
			first, firstAt = name, a.expires
		}
	}
	if len(r.cache) < r.maxEntries {
		return true
	}
	if first == "" {
		return false
	}
	delete(r.cache, first)
	return true
}

// query asks for A and AAAA and returns every address and when the answer expires.
func (r *Resolver) query(ctx context.Context, name string) ([]netip.Addr, time.Time, error) {
	var addrs []netip.Addr
	ttl := uint32(r.maxTTL / time.Second)
	var errs []error
	for _, qtype := range []uint16{dns.TypeA, dns.TypeAAAA} {
		req := new(dns.Msg)
		req.SetQuestion(dns.Fqdn(name), qtype)
		resp, err := r.fwd.forwardAll(ctx, req)
		if err == nil && resp.Rcode != dns.RcodeSuccess {
			err = fmt.Errorf("answer %s", dns.RcodeToString[resp.Rcode])
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", dns.TypeToString[qtype], err))
			continue
		}
		for _, rr := range resp.Answer {
			var ip netip.Addr
			switch rr := rr.(type) {
			case *dns.A:
				ip, _ = netip.AddrFromSlice(rr.A.To4())
			case *dns.AAAA:
				ip, _ = netip.AddrFromSlice(rr.AAAA)
			case *dns.CNAME:
				ttl = min(ttl, rr.Hdr.Ttl) // the chain to the addresses lasts as long as its links
				continue
			default:
				continue
			}
			if ip.IsValid() {
				addrs = append(addrs, ip)
				ttl = min(ttl, rr.Header().Ttl)
			}
		}
	}
	if len(addrs) == 0 {
		if len(errs) == 0 {
			errs = append(errs, errors.New("no A or AAAA record"))
		}
		return nil, time.Time{}, fmt.Errorf("dns: on-demand lookup of %s: %w", name, errors.Join(errs...))
	}
	return addrs, r.now().Add(time.Duration(ttl) * time.Second), nil
}
