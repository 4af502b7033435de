package proxy

import (
	"sync"
	"time"

	"github.com/gozt/gozt/hbone"
)

// dropSummaryEvery is how often at most the node logs a summary of dropped HBONE streams.
const dropSummaryEvery = 10 * time.Second

// dropLog counts HBONE streams dropped before they were answered (and connections closed
// for abuse) and logs one summary line at most every dropSummaryEvery: a hostile peer
// makes tens of thousands a second, and an access-log record for each was most of what
// such a flood cost a node.
type dropLog struct {
	mu     sync.Mutex
	counts [hbone.DropHandshakeEvicted + 1]int // guarded by mu, since last; indexed by reason, the last one last
	last   time.Time                           // guarded by mu: the last summary
}

// onDrop is hbone's Config.OnDrop: it runs on a connection's frame reader, so it only
// counts, and logs when a summary is due.
func (p *Proxy) onDrop(r hbone.DropReason) {
	if p.metrics != nil {
		p.metrics.HBONEDrops.WithLabelValues(r.String()).Inc()
	}
	d := &p.drops
	d.mu.Lock()
	if int(r) < len(d.counts) {
		d.counts[r]++
	}
	now := time.Now()
	if now.Sub(d.last) < dropSummaryEvery {
		d.mu.Unlock()
		return
	}
	counts, since := d.counts, d.last
	d.counts, d.last = [len(d.counts)]int{}, now
	d.mu.Unlock()
	attrs := []any{}
	if !since.IsZero() {
		attrs = append(attrs, "since", since.Format(time.RFC3339))
	}
	for i, n := range counts {
		attrs = append(attrs, hbone.DropReason(i).String(), n)
	}
	p.log.Warn("proxy: dropped HBONE streams or connections of peers that reset or flood them", attrs...)
}
