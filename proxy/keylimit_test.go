package proxy

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/internal/logtest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/prometheus/client_golang/prometheus"
)

// TestOnKeyLimit: every event is counted, the streams a close reset too; a close with
// streams open is a WARN, one per event and summary interval however many connections
// meet it, and a drain is never logged.
func TestOnKeyLimit(t *testing.T) {
	var rec logtest.Recorder
	reg := prometheus.NewRegistry()
	e := NewHBONEEvents(metrics.New(reg, "test"), rec.Logger())
	e.OnKeyLimit(hbone.KeyLimit{Event: "drain", Streams: 3, TX: 1 << 22})
	for range 3 {
		e.OnKeyLimit(hbone.KeyLimit{Event: "peer_key_update", Streams: 2, RX: 1 << 23, Kernel: true})
	}
	e.OnKeyLimit(hbone.KeyLimit{Event: "tx_limit", Streams: 1, TX: 23726566})
	m := testutil.Gather(t, reg)
	for _, c := range []struct {
		name, event string
		want        float64
	}{
		{"hbone_tls_key_limit_total", "drain", 1},
		{"hbone_tls_key_limit_total", "peer_key_update", 3},
		{"hbone_tls_key_limit_total", "tx_limit", 1},
		{"hbone_tls_key_limit_reset_streams_total", "peer_key_update", 6},
		{"hbone_tls_key_limit_reset_streams_total", "tx_limit", 1},
	} {
		if got, _ := m.Sum(c.name, map[string]string{"event": c.event}); got != c.want {
			t.Errorf("%s{event=%q} = %v; want %v", c.name, c.event, got, c.want)
		}
	}
	if got, n := m.Sum("hbone_tls_key_limit_reset_streams_total", map[string]string{"event": "drain"}); n != 0 {
		t.Errorf("a drain counted %v reset streams", got)
	}
	lines := rec.Lines(slog.LevelWarn)
	if len(lines) != 2 {
		t.Fatalf("WARN lines %q; want one for peer_key_update and one for tx_limit", lines)
	}
	if !strings.Contains(lines[0], "event=peer_key_update") || !strings.Contains(lines[0], "streams=2") {
		t.Errorf("first line %q; want the first peer_key_update, 2 streams", lines[0])
	}
}
