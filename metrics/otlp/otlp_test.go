package otlp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"

	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/metrics/otlp"
	"github.com/gozt/gozt/metrics/otlp/otlptest"
)

// TestAccessLogOverOTLP: a connection's access record reaches the OpenTelemetry Collector's
// own OTLP receiver with the message, severity and every field of the JSON access log
// (scope included), the instrumentation scope and the resource; compared field by field.
func TestAccessLogOverOTLP(t *testing.T) {
	col := otlptest.Start(t, otlptest.Options{})
	exp, err := otlp.New(context.Background(), col.Endpoint, "access", attribute.String("service.name", "ztunnel"))
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
	if _, err := otlp.New(context.Background(), "collector:4317", "access"); err == nil {
		t.Error("New took an endpoint without a scheme")
	}
}
