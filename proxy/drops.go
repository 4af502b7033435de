package proxy

import (
	"sync"
	"time"

	"github.com/gozt/gozt/hbone"
)

// dropSummaryEvery is how often at most the node logs a summary line of one kind (a drop
// reason, a handshake failure reason, a key limit event).
const dropSummaryEvery = 10 * time.Second

// summaryLog decides when a rate-limited WARN line of one kind is due: the first
// occurrence of a kind is logged, then at most one line a kind every dropSummaryEvery,
// carrying what accumulated since. A hostile peer makes tens of thousands of drops a
// second, and a node restarting with wrong roots makes every peer's handshake fail: a
// line each would drown the log (and was most of what such a flood cost a node).
type summaryLog struct {
	mu    sync.Mutex
	kinds map[string]*summary // guarded by mu; keys: a bounded set of reasons and events
}

// summary is one kind's counts since its last line.
type summary struct {
	n, extra int       // occurrences, and what add's callers sum beside them
	last     time.Time // the last line (zero: none yet)
}

// add counts one occurrence of kind carrying extra. If a line is due it returns the
// counts since the last line, this one included, and when that line was (zero the first
// time), and starts counting again.
func (l *summaryLog) add(kind string, extra int) (n, extraSum int, since time.Time, due bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.kinds == nil {
		l.kinds = make(map[string]*summary)
	}
	s := l.kinds[kind]
	if s == nil {
		s = &summary{}
		l.kinds[kind] = s
	}
	s.n++
	s.extra += extra
	now := time.Now()
	if !s.last.IsZero() && now.Sub(s.last) < dropSummaryEvery {
		return 0, 0, time.Time{}, false
	}
	n, extraSum, since = s.n, s.extra, s.last
	s.n, s.extra, s.last = 0, 0, now
	return n, extraSum, since, true
}

// OnDrop is hbone's Config.OnDrop: it runs on a connection's frame reader (or its
// serving or handler goroutine), so it only counts, and logs when a summary is due. The
// drops are HBONE streams dropped before they were answered, connections closed for
// abuse and connections refused or delayed by a per-source or per-identity budget.
func (e *HBONEEvents) OnDrop(r hbone.DropReason) {
	if e.metrics != nil {
		e.metrics.HBONEDrops.WithLabelValues(r.String()).Inc()
	}
	if r >= hbone.NumDropReasons {
		return
	}
	n, _, since, due := e.drops.add(r.String(), 0)
	if !due {
		return
	}
	attrs := []any{"reason", r.String(), "count", n}
	if !since.IsZero() {
		attrs = append(attrs, "since", since.Format(time.RFC3339))
	}
	e.log.Warn("proxy: dropped HBONE streams or connections of peers that reset, flood or pass a budget", attrs...)
}
