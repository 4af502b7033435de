package metrics

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
)

// What an operator may shape (docs/CONFIGURATION.md): which traffic labels istio_tcp_*
// carry, and which connections the access log records. Both are off by default, and the
// default output is what it has always been.

// WithDroppedLabels leaves the named labels out of every istio_tcp_* family (a big mesh's
// series stay bounded by the labels kept); connections that differ only in dropped labels
// count in one series. The access log keeps every field. Names come from
// CheckDroppedLabels.
func WithDroppedLabels(names []string) Option {
	return func(m *Metrics) {
		if len(names) == 0 {
			return
		}
		m.kept = make([]bool, len(trafficLabelNames))
		for i, n := range trafficLabelNames {
			m.kept[i] = !slices.Contains(names, n)
		}
	}
}

// CheckDroppedLabels reports an error naming the first name that is not a droppable
// traffic label: every istio_tcp_* label but reporter and response_flags, which the
// families need.
func CheckDroppedLabels(names []string) error {
	for _, n := range names {
		if n == "reporter" || n == "response_flags" {
			return fmt.Errorf("%s cannot be dropped: istio_tcp_sockets_open and the failure counts need it", n)
		}
		if !slices.Contains(trafficLabelNames, n) {
			return fmt.Errorf("%q is not an istio_tcp_* label (%s)", n, strings.Join(trafficLabelNames, ", "))
		}
	}
	return nil
}

// keptNames is the families' label names: trafficLabelNames less the dropped ones.
func (m *Metrics) keptNames() []string {
	if m.kept == nil {
		return trafficLabelNames
	}
	var out []string
	for i, n := range trafficLabelNames {
		if m.kept[i] {
			out = append(out, n)
		}
	}
	return out
}

// keptValues filters vs (in trafficLabelNames order) to the kept labels.
func (m *Metrics) keptValues(vs []string) []string {
	if m.kept == nil {
		return vs
	}
	out := vs[:0]
	for i, v := range vs {
		if m.kept[i] {
			out = append(out, v)
		}
	}
	return out
}

// maskLabels blanks the dropped labels of l, so that connections differing only in them
// share a series key.
func (m *Metrics) maskLabels(l *Labels) {
	fields := l.fields()
	j := 0
	for i, n := range trafficLabelNames {
		if n == "response_flags" {
			continue // not a field of Labels
		}
		if !m.kept[i] {
			*fields[j] = Unknown
		}
		j++
	}
}

// AccessLogFilter says which connections get a "connection complete" access-log record.
// The zero value records every one.
type AccessLogFilter struct {
	// Only is "" (every connection), "failed" (an error or a response flag) or "denied"
	// (response flag DENY: refused by policy).
	Only string
	// SkipSuccesses is the fraction of the successful connections Only keeps that get no
	// record: 0 records every one, 1 none. Failed connections are always recorded.
	// ACCESS_LOG_SAMPLE is 1 minus it, so that the zero value records everything.
	SkipSuccesses float64
}

// WithAccessLogFilter records only the connections f keeps. With a filter, no "connection
// opened" records are written: whether a connection is kept is known only at its end.
func WithAccessLogFilter(f AccessLogFilter) Option {
	return func(m *Metrics) {
		if f != (AccessLogFilter{}) {
			m.logFilter = &f
		}
	}
}

// CheckAccessLogFilter reports an error for a filter WithAccessLogFilter cannot take.
func CheckAccessLogFilter(f AccessLogFilter) error {
	if f.Only != "" && f.Only != "failed" && f.Only != "denied" {
		return fmt.Errorf("%q: want failed, denied or empty (every connection)", f.Only)
	}
	if !(f.SkipSuccesses >= 0 && f.SkipSuccesses <= 1) {
		return fmt.Errorf("skipped successes %v: want a fraction from 0 to 1", f.SkipSuccesses)
	}
	return nil
}

// logs reports whether a connection that ended with flag (NoFlag or "" for none) and err
// gets an access-log record.
func (f *AccessLogFilter) logs(flag string, err error) bool {
	failed := err != nil || (flag != "" && flag != NoFlag)
	switch f.Only {
	case "failed":
		return failed
	case "denied":
		return flag == FlagDeny
	}
	switch {
	case failed || f.SkipSuccesses <= 0:
		return true
	case f.SkipSuccesses >= 1:
		return false
	}
	return rand.Float64() >= f.SkipSuccesses
}
