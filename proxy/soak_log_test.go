package proxy_test

// The soak's view of node A's access log (soak_test.go reads it): which connections the
// node flagged, by error class.

import (
	"context"
	"log/slog"
	"regexp"
	"strings"
	"sync"
	"time"
)

// accessLog is a slog.Handler that keeps, per source address, when its last ERROR
// "connection complete" record was written, and counts ERROR records by the start of their
// error text. INFO records are not even built (Enabled says no).
type accessLog struct {
	mu      sync.Mutex
	last    map[string]time.Time
	byCause map[string]int64
}

func newAccessLog() *accessLog {
	return &accessLog{last: map[string]time.Time{}, byCause: map[string]int64{}}
}

func (l *accessLog) Enabled(_ context.Context, lv slog.Level) bool { return lv >= slog.LevelError }

func (l *accessLog) WithAttrs([]slog.Attr) slog.Handler { return l }

func (l *accessLog) WithGroup(string) slog.Handler { return l }

func (l *accessLog) Handle(_ context.Context, r slog.Record) error {
	var src, cause string
	r.Attrs(func(a slog.Attr) bool {
		switch a.Key {
		case "src.addr":
			src = a.Value.String()
		case "error":
			cause = errorClass(a.Value.String())
		}
		return true
	})
	l.mu.Lock()
	defer l.mu.Unlock()
	l.last[src] = r.Time
	l.byCause[cause]++
	return nil
}

// forget drops the per-address times (the counts by cause stay).
func (l *accessLog) forget() {
	l.mu.Lock()
	defer l.mu.Unlock()
	clear(l.last)
	l.last = map[string]time.Time{}
}

// errorClass shortens an error to its kind: a known cause, else the text without addresses.
func errorClass(s string) string {
	for _, c := range []string{"certs:", "connection refused", "connection reset", "broken pipe", "GOAWAY", "EOF", "503", "401", "tls:"} {
		if strings.Contains(s, c) {
			return c
		}
	}
	s = addrRE.ReplaceAllString(s, "ADDR")
	if len(s) > 80 {
		s = s[:80]
	}
	return s
}

var addrRE = regexp.MustCompile(`\d+\.\d+\.\d+\.\d+:\d+`)

// flagged reports whether src had an ERROR record written at or after start. Records are
// written just after a connection ends: call it once traffic has stopped and settled.
func (l *accessLog) flagged(src string, start time.Time) bool {
	if src == "" {
		return true // address unknown (a refused SOCKS5 handshake): not checkable
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	at, ok := l.last[src]
	return ok && !at.Before(start)
}

func (l *accessLog) summary() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return formatCounts(l.byCause)
}

// --- resources ---
