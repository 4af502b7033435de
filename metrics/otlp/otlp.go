// Package otlp exports the access log over OpenTelemetry's OTLP/gRPC logs protocol, for
// meshes whose logs go to a collector rather than being scraped from stdout (istio#57639).
//
// It is a slog.Handler, so the access log's records reach it exactly as they reach the
// JSON handler: the same message, level and fields (src.addr, dst.service, bytes_sent, ...)
// as log attributes, with the process's identity as the resource. Records are encoded as
// they are logged and sent in batches by one goroutine, off the connection's path, dropped
// rather than queued without bound when the collector is slow or down.
//
// It writes the OTLP protobuf messages itself (google.golang.org/protobuf's protowire) and
// sends them with the gRPC client the node links anyway, rather than with the OpenTelemetry
// Go SDK: Go runs the package initialisers of everything linked, exporter configured or
// not, and the SDK cost every node 1.4 MB of binary and about 0.5 MiB of resident memory
// with the export off (docs/CONFIGURATION.md, "Access log over OpenTelemetry"). Its
// behaviour follows the SDK's (the otelslog bridge's record mapping, the batch processor's
// limits, the OTEL_EXPORTER_OTLP_* variables of Env), checked against the OpenTelemetry
// Collector's own receiver (otlptest).
package otlp

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/encoding/gzip"
	"google.golang.org/grpc/metadata"
)

// Batching, as the OpenTelemetry SDK's batch log processor's defaults.
const (
	queueSize     = 2048        // records waiting; past it a record is dropped
	maxBatch      = 512         // records per export
	batchInterval = time.Second // the longest a record waits for its batch
)

// exportMethod is the OTLP logs service's one method.
const exportMethod = "/opentelemetry.proto.collector.logs.v1.LogsService/Export"

// Config is where and how to export. The zero value of each optional field is the OTLP
// exporter's default.
type Config struct {
	// Endpoint is http://host:port (plaintext) or https://host:port (TLS); see CheckEndpoint.
	Endpoint string
	// Scope is the records' instrumentation scope name.
	Scope string
	// Resource names this process (service.name and the like), in order.
	Resource []KeyValue
	// Headers are sent with every export (OTEL_EXPORTER_OTLP_HEADERS).
	Headers map[string]string
	// Timeout bounds one export [10s] (OTEL_EXPORTER_OTLP_TIMEOUT).
	Timeout time.Duration
	// CertFile is the PEM roots that verify the collector over https; empty: the
	// system's (OTEL_EXPORTER_OTLP_CERTIFICATE).
	CertFile string
	// ClientCertFile and ClientKeyFile are a PEM certificate and key presented to the
	// collector (OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE, _CLIENT_KEY).
	ClientCertFile, ClientKeyFile string
	// Compression is "" or "none" (none) or "gzip" (OTEL_EXPORTER_OTLP_COMPRESSION).
	Compression string
}

// KeyValue is one string attribute of the resource.
type KeyValue struct{ Key, Value string }

// Env reads the OpenTelemetry exporter variables into c from getenv, as the OTLP exporter
// specification defines them: each OTEL_EXPORTER_OTLP_LOGS_<X> wins over
// OTEL_EXPORTER_OTLP_<X>. It reads HEADERS (key=value pairs, comma-separated, values
// percent-encoded), TIMEOUT (milliseconds), CERTIFICATE, CLIENT_CERTIFICATE, CLIENT_KEY and
// COMPRESSION; a value it cannot read is an error naming the variable.
func (c *Config) Env(getenv func(string) string) error {
	get := func(x string) (string, string) {
		if v := getenv("OTEL_EXPORTER_OTLP_LOGS_" + x); v != "" {
			return "OTEL_EXPORTER_OTLP_LOGS_" + x, v
		}
		return "OTEL_EXPORTER_OTLP_" + x, getenv("OTEL_EXPORTER_OTLP_" + x)
	}
	if name, v := get("HEADERS"); v != "" {
		c.Headers = map[string]string{}
		for _, kv := range strings.Split(v, ",") {
			k, val, ok := strings.Cut(kv, "=")
			k = strings.TrimSpace(k)
			if !ok || k == "" {
				return fmt.Errorf("%s: %q is not key=value", name, kv)
			}
			dec, err := url.PathUnescape(strings.TrimSpace(val))
			if err != nil {
				return fmt.Errorf("%s: %s: %w", name, k, err)
			}
			c.Headers[strings.ToLower(k)] = dec
		}
	}
	if name, v := get("TIMEOUT"); v != "" {
		ms, err := strconv.ParseUint(v, 10, 32)
		if err != nil {
			return fmt.Errorf("%s: %q is not a whole number of milliseconds", name, v)
		}
		c.Timeout = time.Duration(ms) * time.Millisecond
	}
	_, c.CertFile = get("CERTIFICATE")
	_, c.ClientCertFile = get("CLIENT_CERTIFICATE")
	_, c.ClientKeyFile = get("CLIENT_KEY")
	name, v := get("COMPRESSION")
	if v != "" && v != "none" && v != "gzip" {
		return fmt.Errorf("%s: %q: want gzip or none", name, v)
	}
	c.Compression = v
	return nil
}

// CheckEndpoint reports whether endpoint is a URL New takes: http://host:port (plaintext)
// or https://host:port (TLS).
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

// Exporter sends slog records to an OTLP/gRPC endpoint. Its worker goroutine runs from New
// until Shutdown.
type Exporter struct {
	conn     *grpc.ClientConn
	calls    []grpc.CallOption
	md       metadata.MD
	timeout  time.Duration
	resource []byte // ResourceLogs.resource, encoded once
	scope    string
	handler  slog.Handler

	queue chan []byte // encoded LogRecords; Handle drops rather than waits
	stop  chan struct{}
	done  chan struct{} // closed when the worker has sent what it could and exited
	once  sync.Once
	final context.Context // Shutdown's, for the last exports; set before stop is closed

	dropped atomic.Uint64 // records not queued (queue full or shut down) since the last warning
}

// New returns an exporter to c.Endpoint. It connects lazily: a collector that is down costs
// the records it would have taken, never a connection's time.
func New(c Config) (*Exporter, error) {
	if err := CheckEndpoint(c.Endpoint); err != nil {
		return nil, err
	}
	u, _ := url.Parse(c.Endpoint)
	creds := insecure.NewCredentials()
	if u.Scheme == "https" {
		tc, err := tlsConfig(c)
		if err != nil {
			return nil, err
		}
		creds = credentials.NewTLS(tc)
	}
	conn, err := grpc.NewClient(u.Host, grpc.WithTransportCredentials(creds))
	if err != nil {
		return nil, err
	}
	e := &Exporter{
		conn:    conn,
		calls:   []grpc.CallOption{grpc.ForceCodec(rawCodec{})},
		md:      metadata.New(c.Headers),
		timeout: c.Timeout,
		queue:   make(chan []byte, queueSize),
		stop:    make(chan struct{}),
		done:    make(chan struct{}),
	}
	if c.Compression == "gzip" {
		e.calls = append(e.calls, grpc.UseCompressor(gzip.Name))
	}
	if e.timeout <= 0 {
		e.timeout = 10 * time.Second
	}
	e.resource, e.scope = encodeResource(c.Resource), c.Scope
	e.handler = &handler{exp: e}
	go e.run()
	return e, nil
}

// tlsConfig verifies the collector with c.CertFile's roots (or the system's) and presents
// c's client certificate, if any.
func tlsConfig(c Config) (*tls.Config, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if c.CertFile != "" {
		pem, err := os.ReadFile(c.CertFile)
		if err != nil {
			return nil, fmt.Errorf("otlp: certificate: %w", err)
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("otlp: certificate %s: no PEM certificate in it", c.CertFile)
		}
	}
	if c.ClientCertFile != "" || c.ClientKeyFile != "" {
		cert, err := tls.LoadX509KeyPair(c.ClientCertFile, c.ClientKeyFile)
		if err != nil {
			return nil, fmt.Errorf("otlp: client certificate: %w", err)
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// Handler is the slog.Handler whose records are exported: INFO and above (the access
// log's "connection opened" lines, DEBUG, are for following a connection on one node).
func (e *Exporter) Handler() slog.Handler { return e.handler }

// enqueue hands one encoded record to the worker, or drops it.
func (e *Exporter) enqueue(rec []byte) {
	select {
	case <-e.stop:
		e.dropped.Add(1)
		return
	default:
	}
	select {
	case e.queue <- rec:
	default:
		e.dropped.Add(1)
	}
}

// run is the worker: it sends a batch when it has maxBatch records or its oldest has waited
// batchInterval, and at Shutdown what is queued, within Shutdown's context.
func (e *Exporter) run() {
	defer close(e.done)
	tick := time.NewTicker(batchInterval)
	defer tick.Stop()
	batch := make([][]byte, 0, maxBatch)
	var warned time.Time
	var lastErr error
	send := func(ctx context.Context) {
		if len(batch) == 0 {
			return
		}
		if err := e.export(ctx, batch); err != nil {
			e.dropped.Add(uint64(len(batch)))
			lastErr = err
		}
		if n := e.dropped.Load(); n > 0 && time.Since(warned) >= 10*time.Second {
			e.dropped.Add(-n)
			warned = time.Now()
			slog.Warn("access log: OTLP records dropped since the last such warning (queue full or export failed)", "records", n, "err", lastErr)
		}
		clear(batch)
		batch = batch[:0]
	}
	for {
		select {
		case r := <-e.queue:
			if batch = append(batch, r); len(batch) == maxBatch {
				send(context.Background())
			}
		case <-tick.C:
			send(context.Background())
		case <-e.stop:
			for {
				select {
				case r := <-e.queue:
					if batch = append(batch, r); len(batch) == maxBatch {
						send(e.final)
					}
					continue
				default:
				}
				send(e.final)
				return
			}
		}
	}
}

// export sends one batch, within the exporter's timeout and ctx.
func (e *Exporter) export(ctx context.Context, batch [][]byte) error {
	ctx, cancel := context.WithTimeout(ctx, e.timeout)
	defer cancel()
	if len(e.md) > 0 {
		ctx = metadata.NewOutgoingContext(ctx, e.md)
	}
	var reply []byte
	err := e.conn.Invoke(ctx, exportMethod, encodeRequest(e.resource, e.scope, batch), &reply, e.calls...)
	if err != nil {
		return fmt.Errorf("otlp: export %d records: %w", len(batch), err)
	}
	return nil
}

// Shutdown sends what is queued, until ctx ends, and stops the exporter. Records logged
// after it are dropped.
func (e *Exporter) Shutdown(ctx context.Context) error {
	first := false
	e.once.Do(func() {
		first = true
		e.final = ctx
		close(e.stop)
	})
	if !first {
		return errors.New("otlp: exporter already shut down")
	}
	<-e.done // the worker's exports end with ctx
	err := e.conn.Close()
	if n := e.dropped.Load(); n > 0 {
		err = errors.Join(err, fmt.Errorf("otlp: %d records not sent", n))
	}
	if ctx.Err() != nil {
		err = errors.Join(err, ctx.Err())
	}
	return err
}

// rawCodec hands gRPC the request already encoded and the reply as bytes (the reply, a
// partial-success report, is not read).
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return v.([]byte), nil }
func (rawCodec) Unmarshal(data []byte, v any) error {
	*v.(*[]byte) = append((*v.(*[]byte))[:0], data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }
