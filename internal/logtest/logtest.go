// Package logtest records log/slog records for tests that count or read log lines.
package logtest

import (
	"context"
	"log/slog"
	"sync"
)

// Recorder is a slog.Handler keeping every record; it is safe for concurrent use.
type Recorder struct {
	mu      sync.Mutex
	records []slog.Record // guarded by mu
}

var _ slog.Handler = (*Recorder)(nil)

// Logger returns a logger writing to r.
func (r *Recorder) Logger() *slog.Logger { return slog.New(r) }

// Enabled records every level.
func (r *Recorder) Enabled(context.Context, slog.Level) bool { return true }

// WithAttrs drops attrs: tests read a record's own attributes.
func (r *Recorder) WithAttrs([]slog.Attr) slog.Handler { return r }

// WithGroup ignores the group.
func (r *Recorder) WithGroup(string) slog.Handler { return r }

// Handle keeps rec.
func (r *Recorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	r.records = append(r.records, rec.Clone())
	r.mu.Unlock()
	return nil
}

// Lines returns the records at level as "message key=value ..." strings.
func (r *Recorder) Lines(level slog.Level) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, rec := range r.records {
		if rec.Level != level {
			continue
		}
		s := rec.Message
		rec.Attrs(func(a slog.Attr) bool {
			s += " " + a.String()
			return true
		})
		out = append(out, s)
	}
	return out
}
