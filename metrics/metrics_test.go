package metrics

import (
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"sync"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/prometheus/client_golang/prometheus"
)

// recorder is a slog.Handler that keeps every record, for checking the access log field by field.
type recorder struct {
	mu   sync.Mutex
	recs []slog.Record
	min  slog.Level
}

func (r *recorder) Enabled(_ context.Context, l slog.Level) bool { return l >= r.min }
func (r *recorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, rec.Clone())
	return nil
}
func (r *recorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *recorder) WithGroup(string) slog.Handler      { return r }

func (r *recorder) records() []slog.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]slog.Record(nil), r.recs...)
}

func attrs(rec slog.Record) map[string]string {
	m := make(map[string]string)
	rec.Attrs(func(a slog.Attr) bool {
		m[a.Key] = a.Value.String()
		return true
	})
	return m
}

func newTestMetrics(t testing.TB, min slog.Level) (*Metrics, *recorder) {
	rec := &recorder{min: min}
	return New(prometheus.NewRegistry(), "1.26.0-test", WithAccessLog(slog.New(rec))), rec
}

// scrape fetches path from a real loopback HTTP server and parses the text exposition.
func scrape(t *testing.T, m *Metrics, path string) testutil.Metrics {
	t.Helper()
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Get(srv.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: status %d", path, resp.StatusCode)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/plain") {
		t.Fatalf("GET %s: Content-Type %q; want text/plain", path, ct)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return testutil.ParseMetrics(t, string(body))
}

var inboundLabels = Labels{
	Reporter:                     ReporterDest,
	SourceWorkload:               "sleep",
	SourceWorkloadNamespace:      "default",
	SourcePrincipal:              "spiffe://cluster.local/ns/default/sa/sleep",
	DestinationService:           "echo.default.svc.cluster.local",
	DestinationWorkload:          "echo",
	DestinationWorkloadNamespace: "default",
	DestinationPrincipal:         "spiffe://cluster.local/ns/default/sa/echo",
	ConnectionSecurityPolicy:     MutualTLS,
}

func TestScrape(t *testing.T) {
	leaktest.Check(t)
	m, _ := newTestMetrics(t, slog.LevelError+1)

	ok := m.Open(inboundLabels, ConnLog{SrcAddr: "10.0.0.1:40000", DstAddr: "10.0.0.2:15008"})
	denied := m.Open(inboundLabels, ConnLog{})
	live := m.Open(Labels{Reporter: ReporterSource}, ConnLog{})
	ok.Close(1000, 25, "", nil)
	denied.Close(0, 7, FlagDeny, errors.New("rbac: denied"))

	for _, path := range []string{"/metrics", "/stats/prometheus"} {
		t.Run(path, func(t *testing.T) {
			fams := scrape(t, m, path)

			if v, n := fams.Sum("istio_build", map[string]string{"component": "ztunnel", "tag": "1.26.0-test"}); n != 1 || v != 1 {
				t.Errorf("istio_build: %d series, value %v; want 1 series = 1", n, v)
			}
			base := map[string]string{
				"reporter": "destination", "source_workload": "sleep", "source_principal": inboundLabels.SourcePrincipal,
				"destination_service": "echo.default.svc.cluster.local", "connection_security_policy": "mutual_tls",
				"request_protocol": "tcp", "source_app": "unknown", "destination_cluster": "unknown",
			}
			with := func(flag string) map[string]string {
				w := map[string]string{"response_flags": flag}
				for k, v := range base {
					w[k] = v
				}
				return w
			}
			checks := []struct {
				name string
				want map[string]string
				v    float64
				n    int
			}{
				{"istio_tcp_connections_opened_total", with("-"), 2, 1},
				{"istio_tcp_connections_closed_total", with("-"), 1, 1},
				{"istio_tcp_connections_closed_total", with("DENY"), 1, 1},
				{"istio_tcp_sent_bytes_total", with("-"), 1000, 1},
				{"istio_tcp_received_bytes_total", with("-"), 25, 1},
				{"istio_tcp_received_bytes_total", with("DENY"), 7, 1},
				{"istio_tcp_connections_failed_total", with("DENY"), 1, 1},
				{"istio_tcp_connections_failed_total", with("-"), 0, 0},
				{"istio_tcp_sockets_open", map[string]string{"reporter": "destination"}, 0, 1},
				{"istio_tcp_sockets_open", map[string]string{"reporter": "source"}, 1, 1},
				{"istio_tcp_connections_opened_total", map[string]string{"reporter": "source", "source_workload": "unknown", "response_flags": "-", "connection_security_policy": "unknown"}, 1, 1},
			}
			for _, c := range checks {
				if v, n := fams.Sum(c.name, c.want); v != c.v || n != c.n {
					t.Errorf("%s%v: %d series, value %v; want %d series, value %v", c.name, c.want, n, v, c.n, c.v)
				}
			}
			// Every traffic series carries the full label set of §8.
			for _, m := range fams["istio_tcp_connections_closed_total"].Metric {
				if len(m.Label) != len(trafficLabelNames) {
					t.Errorf("closed series has %d labels; want %d", len(m.Label), len(trafficLabelNames))
				}
			}
			for _, name := range []string{"process_open_fds", "process_max_fds"} {
				if fams[name] == nil {
					t.Errorf("family %s missing", name)
				}
			}
			// Families without samples are omitted.
			if f := fams["istio_dns_requests_total"]; f != nil {
				t.Errorf("empty family istio_dns_requests_total exposed: %v", f)
			}
			if h := fams["istio_tcp_connections_failed_total"].GetHelp(); !strings.Contains(h, "(unstable)") {
				t.Errorf("failed HELP %q lacks (unstable)", h)
			}
		})
	}
	live.Close(0, 0, "", nil)
}

func TestHandlerFormats(t *testing.T) {
	leaktest.Check(t)
	m, _ := newTestMetrics(t, slog.LevelError+1)
	m.Open(inboundLabels, ConnLog{}).Close(1, 2, "", nil)
	srv := httptest.NewServer(m.Handler())
	defer srv.Close()
	tr := &http.Transport{DisableCompression: true} // see the raw Content-Encoding
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}

	get := func(path string, hdr map[string]string) (*http.Response, []byte) {
		t.Helper()
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		for k, v := range hdr {
			req.Header.Set(k, v)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		var r io.Reader = resp.Body
		if resp.Header.Get("Content-Encoding") == "gzip" {
			zr, err := gzip.NewReader(resp.Body)
			if err != nil {
				t.Fatal(err)
			}
			r = zr
		}
		body, err := io.ReadAll(r)
		if err != nil {
			t.Fatal(err)
		}
		return resp, body
	}

	t.Run("openmetrics", func(t *testing.T) {
		resp, body := get("/stats/prometheus", map[string]string{"Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"})
		if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "application/openmetrics-text") {
			t.Fatalf("Content-Type %q; want application/openmetrics-text", ct)
		}
		s := string(body)
		for _, want := range []string{
			"# TYPE istio_tcp_connections_opened counter\n",
			"istio_tcp_connections_opened_total{",
			`istio_build{component="ztunnel",tag="1.26.0-test"} 1`,
		} {
			if !strings.Contains(s, want) {
				t.Errorf("OpenMetrics body lacks %q", want)
			}
		}
		if !strings.HasSuffix(s, "# EOF\n") {
			t.Errorf("OpenMetrics body does not end with # EOF")
		}
	})
	t.Run("gzip", func(t *testing.T) {
		resp, body := get("/metrics", map[string]string{"Accept-Encoding": "gzip"})
		if ce := resp.Header.Get("Content-Encoding"); ce != "gzip" {
			t.Fatalf("Content-Encoding %q; want gzip", ce)
		}
		if !strings.Contains(string(body), "istio_tcp_sent_bytes_total{") {
			t.Errorf("gzip body lacks istio_tcp_sent_bytes_total")
		}
	})
	t.Run("not found", func(t *testing.T) {
		if resp, _ := get("/other", nil); resp.StatusCode != http.StatusNotFound {
			t.Errorf("GET /other: status %d; want 404", resp.StatusCode)
		}
	})
}

var durationRE = regexp.MustCompile(`^[0-9]+ms$`)

func TestAccessLog(t *testing.T) {
	m, rec := newTestMetrics(t, slog.LevelDebug)

	outbound := Labels{
		Reporter:                     ReporterSource,
		SourceWorkload:               "sleep",
		SourceWorkloadNamespace:      "default",
		SourcePrincipal:              "spiffe://cluster.local/ns/default/sa/sleep",
		SourceCluster:                "Kubernetes",
		DestinationService:           "echo.default.svc.cluster.local",
		DestinationWorkload:          "echo",
		DestinationWorkloadNamespace: "prod",
		DestinationPrincipal:         "spiffe://cluster.local/ns/prod/sa/echo",
		ConnectionSecurityPolicy:     MutualTLS,
	}
	c := m.Open(outbound, ConnLog{SrcAddr: "10.0.0.1:40000", DstAddr: "10.0.0.2:15008", HBONEAddr: "10.0.0.2:8080"})
	c.Close(300, 100, "", nil)
	c.Close(999, 999, FlagDeny, errors.New("late")) // ignored

	plain := outbound
	plain.ConnectionSecurityPolicy = ""
	plain.Reporter = ReporterDest
	d := m.Open(plain, ConnLog{SrcAddr: "10.0.0.1:40001", DstAddr: "10.0.0.2:8080"})
	d.Close(300, 100, FlagDeny, errors.New("rbac: explicitly denied by: ns/deny"))

	recs := rec.records()
	if len(recs) != 4 {
		for _, r := range recs {
			t.Logf("%v %s %v", r.Level, r.Message, attrs(r))
		}
		t.Fatalf("got %d records; want 4 (open, complete, open, complete)", len(recs))
	}
	wantRecs := []struct {
		level slog.Level
		msg   string
		attrs map[string]string
	}{
		{slog.LevelDebug, "connection opened", map[string]string{
			"src.addr": "10.0.0.1:40000", "src.workload": "sleep", "src.namespace": "default",
			"src.identity": "spiffe://cluster.local/ns/default/sa/sleep", "src.cluster": "Kubernetes",
			"dst.addr": "10.0.0.2:15008", "dst.hbone_addr": "10.0.0.2:8080", "dst.service": "echo.default.svc.cluster.local",
			"dst.workload": "echo", "dst.namespace": "prod", "dst.identity": "spiffe://cluster.local/ns/prod/sa/echo",
			"direction": "outbound",
		}},
		{slog.LevelInfo, "connection complete", map[string]string{
			"src.addr": "10.0.0.1:40000", "src.workload": "sleep", "src.namespace": "default",
			"src.identity": "spiffe://cluster.local/ns/default/sa/sleep", "src.cluster": "Kubernetes",
			"dst.addr": "10.0.0.2:15008", "dst.hbone_addr": "10.0.0.2:8080", "dst.service": "echo.default.svc.cluster.local",
			"dst.workload": "echo", "dst.namespace": "prod", "dst.identity": "spiffe://cluster.local/ns/prod/sa/echo",
			"direction": "outbound",
			// outbound: the local app is the client, so it sent what the server received.
			"bytes_sent": "100", "bytes_recv": "300", "duration": "",
		}},
		{slog.LevelDebug, "connection opened", map[string]string{
			"src.addr": "10.0.0.1:40001", "src.workload": "sleep", "src.namespace": "default", "src.cluster": "Kubernetes",
			"dst.addr": "10.0.0.2:8080", "dst.service": "echo.default.svc.cluster.local",
			"dst.workload": "echo", "dst.namespace": "prod", "direction": "inbound",
		}},
		{slog.LevelError, "connection complete", map[string]string{
			"src.addr": "10.0.0.1:40001", "src.workload": "sleep", "src.namespace": "default", "src.cluster": "Kubernetes",
			"dst.addr": "10.0.0.2:8080", "dst.service": "echo.default.svc.cluster.local",
			"dst.workload": "echo", "dst.namespace": "prod", "direction": "inbound",
			"bytes_sent": "300", "bytes_recv": "100", "duration": "",
			"error": "rbac: explicitly denied by: ns/deny",
		}},
	}
	for i, w := range wantRecs {
		r := recs[i]
		if r.Level != w.level || r.Message != w.msg {
			t.Errorf("record %d: %v %q; want %v %q", i, r.Level, r.Message, w.level, w.msg)
		}
		got := attrs(r)
		for k, wv := range w.attrs {
			gv, ok := got[k]
			switch {
			case !ok:
				t.Errorf("record %d: field %s missing", i, k)
			case k == "duration":
				if !durationRE.MatchString(gv) {
					t.Errorf("record %d: duration %q; want like 13ms", i, gv)
				}
			case gv != wv:
				t.Errorf("record %d: %s = %q; want %q", i, k, gv, wv)
			}
		}
		for k := range got {
			if _, ok := w.attrs[k]; !ok {
				t.Errorf("record %d: unexpected field %s=%q", i, k, got[k])
			}
		}
	}
}

func TestCloseIdempotentCounts(t *testing.T) {
	leaktest.Check(t)
	m, _ := newTestMetrics(t, slog.LevelError+1)
	c := m.Open(inboundLabels, ConnLog{})
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() { c.Close(10, 10, "", nil) })
	}
	wg.Wait()
	fams := scrape(t, m, "/metrics")
	if v, _ := fams.Sum("istio_tcp_connections_closed_total", nil); v != 1 {
		t.Errorf("closed = %v after 8 concurrent Close calls; want 1", v)
	}
	if v, _ := fams.Sum("istio_tcp_sent_bytes_total", nil); v != 10 {
		t.Errorf("sent bytes = %v; want 10", v)
	}
	if v, _ := fams.Sum("istio_tcp_sockets_open", nil); v != 0 {
		t.Errorf("sockets open = %v; want 0", v)
	}
}

func TestConcurrentConnections(t *testing.T) {
	leaktest.Check(t)
	m, _ := newTestMetrics(t, slog.LevelError+1)
	const workers, each = 8, 200
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			l := inboundLabels
			l.SourceWorkload = fmt.Sprint("w", w%4)
			for range each {
				m.Open(l, ConnLog{}).Close(3, 5, "", nil)
			}
		})
	}
	wg.Wait()
	fams := scrape(t, m, "/metrics")
	if v, n := fams.Sum("istio_tcp_connections_opened_total", nil); v != workers*each || n != 4 {
		t.Errorf("opened: %d series, total %v; want 4 series, %d", n, v, workers*each)
	}
	if v, _ := fams.Sum("istio_tcp_received_bytes_total", nil); v != 5*workers*each {
		t.Errorf("received bytes = %v; want %d", v, 5*workers*each)
	}
}

func TestNilMetrics(t *testing.T) {
	var m *Metrics
	c := m.Open(Labels{}, ConnLog{})
	c.Close(1, 1, FlagDeny, errors.New("x")) // must not panic
}

func TestNewTwicePanics(t *testing.T) {
	reg := prometheus.NewRegistry()
	New(reg, "v")
	defer func() {
		if recover() == nil {
			t.Error("second New on one registry did not panic")
		}
	}()
	New(reg, "v")
}

func TestCloseAllocs(t *testing.T) {
	m, _ := newTestMetrics(t, slog.LevelError+1) // access log off
	for _, flag := range []string{"", FlagDeny} {
		m.Open(inboundLabels, ConnLog{}).Close(1, 1, flag, nil) // create the series
		conns := make([]*Conn, 200)
		for i := range conns {
			conns[i] = m.Open(inboundLabels, ConnLog{})
		}
		i := 0
		if n := testing.AllocsPerRun(len(conns)-1, func() { conns[i].Close(100, 200, flag, nil); i++ }); n != 0 {
			t.Errorf("Close(flag %q) allocates %v times; want 0", flag, n)
		}
	}
	if n := testing.AllocsPerRun(100, func() { m.Open(inboundLabels, ConnLog{}).Close(1, 1, "", nil) }); n > 1 {
		t.Errorf("Open+Close allocates %v times; want at most 1 (the Conn)", n)
	}
}

// BenchmarkOpenClose measures one connection's recording. Baseline: resolving the five
// families with CounterVec.WithLabelValues per connection, the naive approach Open avoids.
func BenchmarkOpenClose(b *testing.B) {
	b.Run("baseline-WithLabelValues", func(b *testing.B) {
		m, _ := newTestMetrics(b, slog.LevelError+1)
		l := inboundLabels.withDefaults()
		b.ReportAllocs()
		for b.Loop() {
			vs := l.values(NoFlag)
			m.opened.WithLabelValues(vs...).Inc()
			m.closed.WithLabelValues(vs...).Inc()
			m.sent.WithLabelValues(vs...).Add(100)
			m.received.WithLabelValues(vs...).Add(200)
			m.socketsOpen.WithLabelValues(vs[0]).Inc()
			m.socketsOpen.WithLabelValues(vs[0]).Dec()
		}
	})
	b.Run("log-off", func(b *testing.B) {
		m, _ := newTestMetrics(b, slog.LevelError+1)
		b.ReportAllocs()
		for b.Loop() {
			m.Open(inboundLabels, ConnLog{}).Close(100, 200, "", nil)
		}
	})
	b.Run("log-json", func(b *testing.B) {
		m := New(prometheus.NewRegistry(), "v", WithAccessLog(slog.New(slog.NewJSONHandler(io.Discard, nil))))
		b.ReportAllocs()
		for b.Loop() {
			m.Open(inboundLabels, ConnLog{SrcAddr: "10.0.0.1:4000", DstAddr: "10.0.0.2:15008"}).Close(100, 200, "", nil)
		}
	})
	b.Run("close-only", func(b *testing.B) {
		m, _ := newTestMetrics(b, slog.LevelError+1)
		conns := make([]*Conn, 0, 1<<16)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			if i == len(conns) {
				b.StopTimer()
				conns = conns[:0]
				for range cap(conns) {
					conns = append(conns, m.Open(inboundLabels, ConnLog{}))
				}
				i = 0
				b.StartTimer()
			}
			conns[i].Close(100, 200, "", nil)
			i++
		}
	})
}

func TestAccessLogWorkloadFallback(t *testing.T) {
	m, rec := newTestMetrics(t, slog.LevelInfo)
	m.Open(Labels{Reporter: ReporterDest, SourceCanonicalService: "sleep-svc", DestinationWorkload: "echo-7f9"}, ConnLog{}).Close(0, 0, "", nil)
	recs := rec.records()
	if len(recs) != 1 {
		t.Fatalf("got %d records; want 1 (DEBUG open is filtered)", len(recs))
	}
	a := attrs(recs[0])
	if a["src.workload"] != "sleep-svc" || a["dst.workload"] != "echo-7f9" {
		t.Errorf("src.workload=%q dst.workload=%q; want sleep-svc, echo-7f9", a["src.workload"], a["dst.workload"])
	}
	if _, ok := a["src.identity"]; ok {
		t.Errorf("src.identity logged without mTLS")
	}
}

// Series of workloads that have left are dropped: 10,000 short-lived source workloads
// (a job's runs, each a new name) leave /metrics the size it had before them, except for
// the one whose connection is still open.
func TestForgetChurnedWorkloads(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := New(reg, "test", WithAccessLog(slog.New(slog.DiscardHandler)))
	size := func() int {
		rec := httptest.NewRecorder()
		m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
		return rec.Body.Len()
	}
	labels := func(src string) Labels {
		return Labels{Reporter: ReporterDest, SourceWorkload: src, SourceWorkloadNamespace: "batch",
			DestinationWorkload: "server", DestinationWorkloadNamespace: "default"}
	}
	m.Open(labels("server-client"), ConnLog{}).Close(10, 10, "", nil) // a workload that stays
	base := size()
	for i := range 10000 {
		flag := ""
		if i%10 == 0 {
			flag = FlagDeny
		}
		m.Open(labels(fmt.Sprintf("job-%d", i)), ConnLog{}).Close(1, 2, flag, nil)
	}
	live := m.Open(labels("job-live"), ConnLog{})
	grown := size()
	gone := func(ns, w string) bool { return ns == "batch" && strings.HasPrefix(w, "job-") }
	if n := m.Forget(gone); n != 10000 {
		t.Errorf("Forget dropped %d label sets, want 10000 (not the one with an open connection)", n)
	}
	after := size()
	t.Logf("/metrics: %d bytes before the churn, %d after it, %d after Forget", base, grown, after)
	if grown < base*10 {
		t.Fatalf("the churn grew /metrics from %d to only %d bytes: the test measures nothing", base, grown)
	}
	// What is left beyond the baseline: job-live's four series (opened, closed, sent,
	// received: ~750 bytes of labels each); server-client's are kept.
	if after > base+4096 {
		t.Errorf("/metrics is %d bytes after Forget, want about its %d before the churn", after, base)
	}
	live.Close(0, 0, "", nil)
	if n := m.Forget(gone); n != 1 {
		t.Errorf("Forget after the last connection closed dropped %d, want 1", n)
	}
	if got := size(); got > base+512 {
		t.Errorf("/metrics is %d bytes once every churned series is gone, want about %d", got, base)
	}
}

// workload_manager_* are exported in in-pod mode only, as the Rust ztunnel does.
func TestWorkloadManagerFamiliesInPodOnly(t *testing.T) {
	for _, inPod := range []bool{false, true} {
		reg := prometheus.NewRegistry()
		var opts []Option
		if inPod {
			opts = append(opts, WithWorkloadManager())
		}
		m := New(reg, "test", opts...)
		m.ActiveProxies.Set(2) // usable either way
		fams, err := reg.Gather()
		if err != nil {
			t.Fatal(err)
		}
		found := false
		for _, f := range fams {
			if f.GetName() == "workload_manager_active_proxy_count" {
				found = true
			}
		}
		if found != inPod {
			t.Errorf("in-pod %v: workload_manager_active_proxy_count exported = %v", inPod, found)
		}
	}
}

// The Go runtime's families stand where the Rust ztunnel's tokio_* do.
func TestRuntimeFamilies(t *testing.T) {
	reg := prometheus.NewRegistry()
	New(reg, "test")
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	have := map[string]bool{}
	for _, f := range fams {
		have[f.GetName()] = true
	}
	for _, name := range []string{"go_goroutines", "go_sched_gomaxprocs_threads", "go_sched_latencies_seconds", "process_open_fds", "process_cpu_seconds_total"} {
		if !have[name] {
			t.Errorf("%s not exported", name)
		}
	}
}
