package otlp_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"go.opentelemetry.io/otel/attribute"
	collogspb "go.opentelemetry.io/proto/otlp/collector/logs/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	"google.golang.org/grpc"

	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/metrics/otlp"
)

// receiver is an OTLP/gRPC logs endpoint, the service a collector serves on 4317.
type receiver struct {
	collogspb.UnimplementedLogsServiceServer
	mu   sync.Mutex
	reqs []*collogspb.ExportLogsServiceRequest
}

func (r *receiver) Export(_ context.Context, req *collogspb.ExportLogsServiceRequest) (*collogspb.ExportLogsServiceResponse, error) {
	r.mu.Lock()
	r.reqs = append(r.reqs, req)
	r.mu.Unlock()
	return &collogspb.ExportLogsServiceResponse{}, nil
}

func startReceiver(t *testing.T) (*receiver, string) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	r := &receiver{}
	s := grpc.NewServer()
	collogspb.RegisterLogsServiceServer(s, r)
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Serve(ln) }()
	t.Cleanup(func() { s.Stop(); <-done })
	return r, "http://" + ln.Addr().String()
}

func anyValue(v *commonpb.AnyValue) any {
	switch x := v.GetValue().(type) {
	case *commonpb.AnyValue_StringValue:
		return x.StringValue
	case *commonpb.AnyValue_IntValue:
		return float64(x.IntValue) // as JSON reads numbers
	}
	return fmt.Sprint(v)
}

// TestAccessLogOverOTLP: a connection's access record reaches a real OTLP/gRPC receiver
// with the message, severity and every field of the JSON access log, and the resource.
func TestAccessLogOverOTLP(t *testing.T) {
	r, endpoint := startReceiver(t)
	exp, err := otlp.New(context.Background(), endpoint, "access", attribute.String("service.name", "ztunnel"))
	if err != nil {
		t.Fatal(err)
	}
	var jsonOut bytes.Buffer
	jsonLog := slog.NewJSONHandler(&jsonOut, nil)
	m := metrics.New(prometheus.NewRegistry(), "test", metrics.WithAccessLog(slog.New(slog.NewMultiHandler(jsonLog, exp.Handler()))))
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
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.reqs) != 1 || len(r.reqs[0].ResourceLogs) != 1 || len(r.reqs[0].ResourceLogs[0].ScopeLogs) != 1 ||
		len(r.reqs[0].ResourceLogs[0].ScopeLogs[0].LogRecords) != 1 {
		t.Fatalf("received %v; want one record", r.reqs)
	}
	rl := r.reqs[0].ResourceLogs[0]
	if res := rl.Resource.GetAttributes(); len(res) != 1 || res[0].Key != "service.name" || anyValue(res[0].Value) != "ztunnel" {
		t.Errorf("resource %v; want service.name=ztunnel", res)
	}
	if scope := rl.ScopeLogs[0].Scope.GetName(); scope != "access" {
		t.Errorf("scope %q; want access", scope)
	}
	rec := rl.ScopeLogs[0].LogRecords[0]
	got := map[string]any{"msg": anyValue(rec.Body), "level": rec.SeverityText}
	for _, kv := range rec.Attributes {
		got[kv.Key] = anyValue(kv.Value)
	}
	delete(want, "time")
	if rec.TimeUnixNano == 0 {
		t.Error("record has no time")
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("OTLP record\n %v\nJSON access log\n %v", got, want)
	}
	if len(want) < 12 {
		t.Errorf("JSON access log has only %d fields: %v", len(want), want)
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
