package proxy

import (
	"net"
	"sync"
	"time"
)

// handshakeLog rate-limits the WARN lines of failed inbound TLS handshakes: the first of a
// reason is logged with its peer and error, the next of that reason not before
// dropSummaryEvery, with how many were left unlogged since. A client with a bad
// certificate retries, and a node restarting with wrong roots makes every peer fail at
// once; a line each would drown the log.
type handshakeLog struct {
	mu   sync.Mutex
	seen map[string]*handshakeReason // guarded by mu; keys: a bounded set of reasons
}

type handshakeReason struct {
	last       time.Time
	suppressed int
}

// Reasons logged at DEBUG only: a peer that goes away or stalls mid-handshake is a port
// probe, a load balancer's health check or a client giving up, not a misconfiguration.
var quietHandshakeFailures = map[string]bool{"peer_closed": true, "timeout": true}

// handshakeFailed counts and logs a failed inbound TLS handshake with peer.
func (p *Proxy) handshakeFailed(peer net.Addr, err error) {
	reason := "other"
	if p.cfg.HandshakeFailure != nil {
		reason = p.cfg.HandshakeFailure(err)
	}
	if reason == "" {
		return // we closed it: shutdown, or an eviction hbone counted as a drop
	}
	if p.metrics != nil {
		p.metrics.HBONEHandshakeFailures.WithLabelValues(reason).Inc()
	}
	if quietHandshakeFailures[reason] {
		p.log.Debug("proxy: inbound TLS handshake failed", "peer", peer, "reason", reason, "err", err)
		return
	}
	h := &p.handshakes
	h.mu.Lock()
	if h.seen == nil {
		h.seen = make(map[string]*handshakeReason)
	}
	r := h.seen[reason]
	if r == nil {
		r = &handshakeReason{}
		h.seen[reason] = r
	}
	now := time.Now()
	if !r.last.IsZero() && now.Sub(r.last) < dropSummaryEvery {
		r.suppressed++
		h.mu.Unlock()
		return
	}
	suppressed := r.suppressed
	r.last, r.suppressed = now, 0
	h.mu.Unlock()
	attrs := []any{"peer", peer, "reason", reason, "err", err}
	if suppressed > 0 {
		attrs = append(attrs, "alsoSince", suppressed) // failures of this reason not logged since its last line
	}
	p.log.Warn("proxy: inbound TLS handshake failed", attrs...)
}
