package proxy

import "github.com/gozt/gozt/hbone"

// OnKeyLimit is hbone's Config.OnKeyLimit (on a frame reader: it only counts, and logs
// when a line is due). A drain is routine (the metric counts it); a close with streams
// open cost those streams a reset, which is worth a WARN.
func (e *HBONEEvents) OnKeyLimit(l hbone.KeyLimit) {
	if e.metrics != nil {
		e.metrics.HBONEKeyLimit.WithLabelValues(l.Event).Inc()
		if l.Event != "drain" {
			e.metrics.HBONEKeyLimitStreams.WithLabelValues(l.Event).Add(float64(l.Streams))
		}
	}
	if l.Event == "drain" || l.Streams == 0 {
		return
	}
	// One line per event at most every dropSummaryEvery, with the connections and streams
	// since: under load every pooled connection of a node meets its limit within minutes
	// of the others.
	conns, streams, _, due := e.keyLimits.add(l.Event, l.Streams)
	if !due {
		return
	}
	e.log.Warn("proxy: HBONE connections ended at a TLS key limit with streams still open; those streams were reset",
		"event", l.Event, "connections", conns, "streams", streams, "kernelTls", l.Kernel,
		"recordsSent", l.TX, "recordsReceived", l.RX)
}
