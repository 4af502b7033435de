package metrics

import (
	"errors"
	"log/slog"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Dropped labels are gone from every istio_tcp_* family, and connections that differ
// only in them count in one series; the access log still names each connection's.
func TestDroppedLabels(t *testing.T) {
	drop := []string{"source_principal", "source_workload"}
	if err := CheckDroppedLabels(drop); err != nil {
		t.Fatal(err)
	}
	rec := &recorder{min: slog.LevelInfo}
	m := New(prometheus.NewRegistry(), "test", WithAccessLog(slog.New(rec)), WithDroppedLabels(drop))
	for _, who := range []string{"sleep", "curl"} {
		l := inboundLabels
		l.SourceWorkload, l.SourcePrincipal = who, "spiffe://cluster.local/ns/default/sa/"+who
		m.Open(l, ConnLog{}).Close(10, 20, NoFlag, nil)
	}
	fams := scrape(t, m, "/metrics")
	for _, name := range []string{"istio_tcp_connections_opened_total", "istio_tcp_connections_closed_total", "istio_tcp_sent_bytes_total", "istio_tcp_received_bytes_total"} {
		f := fams[name]
		if f == nil || len(f.Metric) != 1 {
			t.Fatalf("%s: %v; want one series for both connections", name, f)
		}
		for _, l := range f.Metric[0].Label {
			if slices.Contains(drop, l.GetName()) {
				t.Errorf("%s still has label %s", name, l.GetName())
			}
		}
		if got, want := len(f.Metric[0].Label), len(trafficLabelNames)-len(drop); got != want {
			t.Errorf("%s has %d labels; want %d", name, got, want)
		}
	}
	if v, n := fams.Sum("istio_tcp_connections_closed_total", map[string]string{"destination_workload": "echo"}); v != 2 || n != 1 {
		t.Errorf("closed: %d series, value %v; want 1 series, value 2", n, v)
	}
	var ids []string
	for _, r := range rec.records() {
		ids = append(ids, attrs(r)["src.identity"])
	}
	if want := []string{"spiffe://cluster.local/ns/default/sa/sleep", "spiffe://cluster.local/ns/default/sa/curl"}; !slices.Equal(ids, want) {
		t.Errorf("access log src.identity %v; want %v", ids, want)
	}
	for _, bad := range [][]string{{"reporter"}, {"response_flags"}, {"source_wrkload"}} {
		if CheckDroppedLabels(bad) == nil {
			t.Errorf("CheckDroppedLabels(%v) = nil; want an error", bad)
		}
	}
}

// An access-log filter records only the connections it keeps, and no "connection opened"
// records; the metrics count every connection.
func TestAccessLogFilter(t *testing.T) {
	ends := []struct {
		flag string
		err  error
	}{
		{NoFlag, nil}, {NoFlag, nil}, {FlagDeny, nil}, {FlagConnect, errors.New("refused")}, {NoFlag, errors.New("reset")},
	}
	for _, tt := range []struct {
		f    AccessLogFilter
		want int
	}{
		{AccessLogFilter{}, 5},
		{AccessLogFilter{Only: "failed"}, 3},
		{AccessLogFilter{Only: "denied"}, 1},
		{AccessLogFilter{SkipSuccesses: 1}, 3},         // the successes are sampled away, failures kept
		{AccessLogFilter{SkipSuccesses: 1 - 1e-12}, 3}, // as good as all of them
	} {
		if err := CheckAccessLogFilter(tt.f); err != nil {
			t.Fatal(err)
		}
		rec := &recorder{min: slog.LevelDebug}
		m := New(prometheus.NewRegistry(), "test", WithAccessLog(slog.New(rec)), WithAccessLogFilter(tt.f))
		for _, e := range ends {
			m.Open(inboundLabels, ConnLog{}).Close(1, 1, e.flag, e.err)
		}
		opened, complete := 0, 0
		for _, r := range rec.records() {
			switch r.Message {
			case "connection opened":
				opened++
			case "connection complete":
				complete++
			}
		}
		wantOpened := 0
		if tt.f == (AccessLogFilter{}) {
			wantOpened = len(ends)
		}
		if complete != tt.want || opened != wantOpened {
			t.Errorf("filter %+v: %d complete, %d opened records; want %d and %d", tt.f, complete, opened, tt.want, wantOpened)
		}
		if v, _ := scrape(t, m, "/metrics").Sum("istio_tcp_connections_closed_total", nil); v != float64(len(ends)) {
			t.Errorf("filter %+v: closed counted %v; want %d", tt.f, v, len(ends))
		}
	}
	for _, bad := range []AccessLogFilter{{Only: "errors"}, {SkipSuccesses: 2}, {SkipSuccesses: -1}} {
		if CheckAccessLogFilter(bad) == nil {
			t.Errorf("CheckAccessLogFilter(%+v) = nil; want an error", bad)
		}
	}
}
