package proxy

import (
	"sync"
	"time"

	"github.com/gozt/gozt/hbone"
)

// keyLimitEvents are hbone.KeyLimit's events, in a fixed order for keyLimitLog.
var keyLimitEvents = [...]string{"drain", "tx_limit", "peer_key_update"}

// keyLimitLog logs HBONE connections that ended at a TLS key limit with streams on them,
// one line per event at most every dropSummaryEvery, with the streams lost since: under
// load every pooled connection of a node meets its limit within minutes of the others.
type keyLimitLog struct {
	mu      sync.Mutex
	conns   [len(keyLimitEvents)]int       // guarded by mu: since that event's last line
	streams [len(keyLimitEvents)]int       // guarded by mu
	last    [len(keyLimitEvents)]time.Time // guarded by mu
}

// onKeyLimit is hbone's Config.OnKeyLimit (on a frame reader: it only counts, and logs
// when a line is due). A drain is routine (the metric counts it); a close with streams
// open cost those streams a reset, which is worth a WARN.
func (p *Proxy) onKeyLimit(l hbone.KeyLimit) {
	if p.metrics != nil {
		p.metrics.HBONEKeyLimit.WithLabelValues(l.Event).Inc()
		if l.Event != "drain" {
			p.metrics.HBONEKeyLimitStreams.WithLabelValues(l.Event).Add(float64(l.Streams))
		}
	}
	if l.Event == "drain" || l.Streams == 0 {
		return
	}
	i := 0
	for i < len(keyLimitEvents) && keyLimitEvents[i] != l.Event {
		i++
	}
	if i == len(keyLimitEvents) {
		return
	}
	k := &p.keyLimits
	k.mu.Lock()
	k.conns[i]++
	k.streams[i] += l.Streams
	now := time.Now()
	if now.Sub(k.last[i]) < dropSummaryEvery {
		k.mu.Unlock()
		return
	}
	conns, streams := k.conns[i], k.streams[i]
	k.conns[i], k.streams[i], k.last[i] = 0, 0, now
	k.mu.Unlock()
	p.log.Warn("proxy: HBONE connections ended at a TLS key limit with streams still open; those streams were reset",
		"event", l.Event, "connections", conns, "streams", streams, "kernelTls", l.Kernel,
		"recordsSent", l.TX, "recordsReceived", l.RX)
}
