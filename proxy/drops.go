package proxy

import (
	"sync"
	"time"

	"github.com/gozt/gozt/hbone"
)

// dropSummaryEvery is how often at most the node logs a summary of one reason's dropped
// HBONE streams or connections.
const dropSummaryEvery = 10 * time.Second

// dropLog counts HBONE streams dropped before they were answered, connections closed for
// abuse and connections refused or delayed by a per-source or per-identity budget, and
// logs one summary line per reason at most every dropSummaryEvery: a hostile peer makes
// tens of thousands a second, and an access-log record for each was most of what such a
// flood cost a node.
type dropLog struct {
	mu     sync.Mutex
	counts [hbone.NumDropReasons]int       // guarded by mu: since that reason's last summary
	last   [hbone.NumDropReasons]time.Time // guarded by mu: each reason's last summary
}

// onDrop is hbone's Config.OnDrop: it runs on a connection's frame reader (or its
// serving or handler goroutine), so it only counts, and logs when a summary is due.
func (p *Proxy) onDrop(r hbone.DropReason) {
	if p.metrics != nil {
		p.metrics.HBONEDrops.WithLabelValues(r.String()).Inc()
	}
	if r >= hbone.NumDropReasons {
		return
	}
	d := &p.drops
	d.mu.Lock()
	d.counts[r]++
	now := time.Now()
	if now.Sub(d.last[r]) < dropSummaryEvery {
		d.mu.Unlock()
		return
	}
	n, since := d.counts[r], d.last[r]
	d.counts[r], d.last[r] = 0, now
	d.mu.Unlock()
	attrs := []any{"reason", r.String(), "count", n}
	if !since.IsZero() {
		attrs = append(attrs, "since", since.Format(time.RFC3339))
	}
	p.log.Warn("proxy: dropped HBONE streams or connections of peers that reset, flood or pass a budget", attrs...)
}
