// Package otlp exports the access log over OpenTelemetry (OTLP/gRPC), for meshes whose
// logs go to a collector rather than being scraped from stdout (istio#57639).
//
// It is a slog.Handler, so the access log's records reach it exactly as they reach the
// JSON handler: the same message, level and fields (src.addr, dst.service, bytes_sent, ...)
// as log attributes, with the process's identity as the resource. The exporting is the
// OpenTelemetry SDK's (batched, off the connection's path, dropping rather than blocking
// when the collector is slow); the SDK also honours the standard OTEL_EXPORTER_OTLP_*
// variables for what is not set here (headers, timeout, TLS certificates).
package otlp

import (
	"context"
	"fmt"
	"log/slog"
	"net/url"

	"go.opentelemetry.io/contrib/bridges/otelslog"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/exporters/otlp/otlplog/otlploggrpc"
	sdklog "go.opentelemetry.io/otel/sdk/log"
	"go.opentelemetry.io/otel/sdk/resource"
)

// Exporter sends slog records to an OTLP/gRPC endpoint.
type Exporter struct {
	provider *sdklog.LoggerProvider
	handler  slog.Handler
}

// CheckEndpoint reports whether endpoint is a URL New takes: http://host:port (plaintext)
// or https://host:port (TLS with the system's roots).
func CheckEndpoint(endpoint string) error {
	u, err := url.Parse(endpoint)
	if err != nil {
		return err
	}
	if (u.Scheme != "http" && u.Scheme != "https") || u.Host == "" {
		return fmt.Errorf("%q is not http://host:port or https://host:port", endpoint)
	}
	return nil
}

// New returns an exporter to endpoint (see CheckEndpoint) whose records carry scope as
// their instrumentation scope and attrs as their resource (service.name and the like).
// It connects lazily: a collector that is down costs the records it would have taken.
func New(ctx context.Context, endpoint, scope string, attrs ...attribute.KeyValue) (*Exporter, error) {
	if err := CheckEndpoint(endpoint); err != nil {
		return nil, err
	}
	exp, err := otlploggrpc.New(ctx, otlploggrpc.WithEndpointURL(endpoint))
	if err != nil {
		return nil, err
	}
	provider := sdklog.NewLoggerProvider(
		sdklog.WithResource(resource.NewSchemaless(attrs...)),
		sdklog.WithProcessor(sdklog.NewBatchProcessor(exp)),
	)
	h := otelslog.NewHandler(scope, otelslog.WithLoggerProvider(provider))
	return &Exporter{provider: provider, handler: atLeast{h, slog.LevelInfo}}, nil
}

// atLeast passes on records of level min and above: the access log's "connection opened"
// lines (DEBUG, for following a connection live on one node) are not exported.
type atLeast struct {
	slog.Handler
	min slog.Level
}

func (h atLeast) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= h.min && h.Handler.Enabled(ctx, l)
}

func (h atLeast) WithAttrs(as []slog.Attr) slog.Handler {
	return atLeast{h.Handler.WithAttrs(as), h.min}
}
func (h atLeast) WithGroup(g string) slog.Handler { return atLeast{h.Handler.WithGroup(g), h.min} }

// Handler is the slog.Handler whose records are exported: INFO and above.
func (e *Exporter) Handler() slog.Handler { return e.handler }

// Shutdown sends what is queued, until ctx ends, and stops the exporter.
func (e *Exporter) Shutdown(ctx context.Context) error { return e.provider.Shutdown(ctx) }
