package otlp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/metrics/otlp"
	"github.com/gozt/gozt/metrics/otlp/otlptest"
)

// TestAccessLogOverOTLP: a connection's access record reaches the OpenTelemetry Collector's
// own OTLP receiver with the message, severity and every field of the JSON access log
// (scope included), the instrumentation scope and the resource; compared field by field.
func TestAccessLogOverOTLP(t *testing.T) {
	leaktest.Check(t)
	col := otlptest.Start(t, otlptest.Options{})
	exp, err := otlp.New(otlp.Config{Endpoint: col.Endpoint, Scope: "access", Resource: []otlp.KeyValue{{Key: "service.name", Value: "ztunnel"}}})
	if err != nil {
		t.Fatal(err)
	}
	var jsonOut bytes.Buffer
	jsonLog := slog.NewJSONHandler(&jsonOut, nil)
	accessLog := slog.New(slog.NewMultiHandler(jsonLog, exp.Handler())).With("scope", "access") // as cmd/ztunnel builds it
	m := metrics.New(prometheus.NewRegistry(), "test", metrics.WithAccessLog(accessLog))
	l := metrics.Labels{Reporter: metrics.ReporterSource, SourceWorkload: "client", SourceWorkloadNamespace: "default",
		DestinationService: "echo.default.svc.cluster.local", DestinationWorkload: "server", ConnectionSecurityPolicy: metrics.MutualTLS,
		SourcePrincipal: "spiffe://cluster.local/ns/default/sa/client", DestinationPrincipal: "spiffe://cluster.local/ns/default/sa/server"}
	m.Open(l, metrics.ConnLog{SrcAddr: "10.0.0.1:40000", DstAddr: "10.0.0.2:15008", HBONEAddr: "10.0.0.2:8080", Direction: "outbound"}).
		Close(100, 200, "", errors.New("connection reset"))

	ctx, cancel := context.WithTimeout(context.Background(), testutil.Timeout)
	defer cancel()
	if err := exp.Shutdown(ctx); err != nil { // flushes the batch
		t.Fatalf("shutdown: %v", err)
	}
	var want map[string]any
	if err := json.Unmarshal(jsonOut.Bytes(), &want); err != nil {
		t.Fatalf("JSON access log %q: %v", jsonOut.Bytes(), err)
	}
	recs := col.Records(t, 1)
	if len(recs) != 1 {
		t.Fatalf("collector received %d records; want 1: %+v", len(recs), recs)
	}
	rec := recs[0]
	if fmt.Sprint(rec.Resource) != fmt.Sprint(map[string]any{"service.name": "ztunnel"}) {
		t.Errorf("resource %v; want service.name=ztunnel", rec.Resource)
	}
	if rec.Scope != "access" {
		t.Errorf("instrumentation scope %q; want access", rec.Scope)
	}
	if rec.TimeUnixNano == 0 {
		t.Error("record has no time")
	}
	otlptest.CompareWithJSON(t, rec, want)
	if len(want) < 13 || want["scope"] != "access" {
		t.Errorf("JSON access log has only %d fields, or no scope: %v", len(want), want)
	}
}

func TestCheckEndpoint(t *testing.T) {
	for _, tc := range []struct {
		endpoint string
		ok       bool
	}{{"http://collector:4317", true}, {"https://collector.observability:4317", true}, {"collector:4317", false}, {"grpc://c:4317", false}, {"http://", false}} {
		if err := otlp.CheckEndpoint(tc.endpoint); (err == nil) != tc.ok {
			t.Errorf("CheckEndpoint(%q) = %v; want ok %v", tc.endpoint, err, tc.ok)
		}
	}
	if _, err := otlp.New(otlp.Config{Endpoint: "collector:4317", Scope: "access"}); err == nil {
		t.Error("New took an endpoint without a scheme")
	}
}

// Values of every slog kind reach the collector as the OpenTelemetry slog bridge converts
// them (durations as nanoseconds, an unsigned past int64 as a double), a handler's group
// prefixes its keys, DEBUG is not exported, and gzip (OTEL_EXPORTER_OTLP_COMPRESSION) is
// what the collector reads.
func TestValueKinds(t *testing.T) {
	col := otlptest.Start(t, otlptest.Options{})
	exp, err := otlp.New(otlp.Config{Endpoint: col.Endpoint, Scope: "test", Compression: "gzip"})
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(exp.Handler())
	log.Debug("not exported")
	log.With("scope", "access").WithGroup("g").Warn("kinds", "ok", true, "ratio", 0.5, "took", 1500*time.Millisecond,
		"huge", uint64(1<<63+1), "n", -3, "err", errors.New("boom"))
	ctx, cancel := context.WithTimeout(context.Background(), testutil.Timeout)
	defer cancel()
	if err := exp.Shutdown(ctx); err != nil {
		t.Fatal(err)
	}
	recs := col.Records(t, 1)
	if len(recs) != 1 {
		t.Fatalf("%d records; want 1 (DEBUG is not exported): %+v", len(recs), recs)
	}
	want := map[string]any{"scope": "access", "g.ok": true, "g.ratio": 0.5, "g.took": 1.5e9, "g.huge": float64(1<<63 + 1), "g.n": -3.0, "g.err": "boom"}
	if fmt.Sprint(recs[0].Attributes) != fmt.Sprint(want) || recs[0].Severity != "WARN" || recs[0].Body != "kinds" || recs[0].Scope != "test" {
		t.Errorf("record %+v; want WARN kinds in scope test with %v", recs[0], want)
	}
}

// A collector that accepts TCP and never answers costs the node neither a blocked
// connection nor an unbounded queue: logging past the queue drops, and Shutdown returns
// once its context ends, saying what was not sent.
func TestCollectorSilent(t *testing.T) {
	leaktest.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var held []net.Conn // accepted, never answered; closed when the test ends
	var mu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
		}
	}()
	defer func() {
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
	}()
	exp, err := otlp.New(otlp.Config{Endpoint: "http://" + ln.Addr().String(), Scope: "access", Timeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(exp.Handler())
	start := time.Now()
	for i := range 5000 { // more than the queue holds
		log.Info("connection complete", "i", i)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("5000 records took %v to log with the collector silent; want no waiting", d)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	start = time.Now()
	err = exp.Shutdown(ctx)
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Shutdown took %v with a 500ms context", d)
	}
	if err == nil || !strings.Contains(err.Error(), "records not sent") {
		t.Errorf("Shutdown: %v; want an error counting the records not sent", err)
	}
	if err := exp.Shutdown(context.Background()); err == nil {
		t.Error("a second Shutdown: no error")
	}
}

// Env reads the OTEL_EXPORTER_OTLP_* variables as the OTLP exporter specification defines
// them (the LOGS_ ones first), and names the variable it cannot read.
func TestEnv(t *testing.T) {
	env := map[string]string{
		"OTEL_EXPORTER_OTLP_HEADERS":      "Authorization=Bearer%20abc, x-tenant = t1",
		"OTEL_EXPORTER_OTLP_TIMEOUT":      "2500",
		"OTEL_EXPORTER_OTLP_LOGS_TIMEOUT": "1500",
		"OTEL_EXPORTER_OTLP_CERTIFICATE":  "/ca.pem",
		"OTEL_EXPORTER_OTLP_COMPRESSION":  "gzip",
	}
	var c otlp.Config
	if err := c.Env(func(k string) string { return env[k] }); err != nil {
		t.Fatal(err)
	}
	if fmt.Sprint(c.Headers) != "map[authorization:Bearer abc x-tenant:t1]" || c.Timeout != 1500*time.Millisecond || c.CertFile != "/ca.pem" || c.Compression != "gzip" {
		t.Errorf("Env: %+v", c)
	}
	for k, v := range map[string]string{"OTEL_EXPORTER_OTLP_TIMEOUT": "5s", "OTEL_EXPORTER_OTLP_LOGS_HEADERS": "novalue", "OTEL_EXPORTER_OTLP_COMPRESSION": "zstd"} {
		var c otlp.Config
		if err := c.Env(func(name string) string { return map[string]string{k: v}[name] }); err == nil || !strings.Contains(err.Error(), k) {
			t.Errorf("%s=%s: %v; want an error naming the variable", k, v, err)
		}
	}
}
