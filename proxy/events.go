package proxy

import (
	"log/slog"

	"github.com/gozt/gozt/metrics"
)

// HBONEEvents counts and logs what hbone reports of a proxy's HBONE connections: its
// methods are hbone.Config's hooks of the same names, which the caller building the
// proxy's Config sets (cmd/ztunnel, for both HBONEClient and HBONEServer). They run on
// hbone's goroutines (frame readers, dialing and serving goroutines), so they only count,
// and log a summary line when one is due.
type HBONEEvents struct {
	metrics   *metrics.Metrics // nil: nothing is counted
	log       *slog.Logger
	drops     summaryLog // by hbone.DropReason
	keyLimits summaryLog // by hbone.KeyLimit event
}

// NewHBONEEvents returns the hooks of a proxy counting into m and logging to log
// (slog.Default() if nil).
func NewHBONEEvents(m *metrics.Metrics, log *slog.Logger) *HBONEEvents {
	if log == nil {
		log = slog.Default()
	}
	return &HBONEEvents{metrics: m, log: log}
}
