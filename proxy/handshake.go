package proxy

import "net"

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
	// The first failure of a reason is logged with its peer and error; the next of that
	// reason not before dropSummaryEvery, with how many were left unlogged since.
	n, _, _, due := p.handshakes.add(reason, 0)
	if !due {
		return
	}
	suppressed := n - 1
	attrs := []any{"peer", peer, "reason", reason, "err", err}
	if suppressed > 0 {
		attrs = append(attrs, "alsoSince", suppressed) // failures of this reason not logged since its last line
	}
	p.log.Warn("proxy: inbound TLS handshake failed", attrs...)
}
