// Package otlptest runs the OpenTelemetry Collector as a test's OTLP/gRPC receiver: the
// collector's own OTLP receiver (optionally behind TLS and a bearer token) with its file
// exporter, so a test reads back exactly what the collector received. The binary is
// tools/otelcol, built by `make otelcol` into .tools/otelcol (or named by $OTELCOL); without
// it tests skip, saying so (under CI=true they fail: make check builds it).
package otlptest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/testutil"
)

// Binary returns the collector's path: $OTELCOL, or .tools/otelcol in the first directory
// at or above the working directory that has one. The error says how to build it.
func Binary() (string, error) {
	if p := os.Getenv("OTELCOL"); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("OTELCOL=%s: %w", p, err)
		}
		return p, nil
	}
	dir, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for {
		p := filepath.Join(dir, ".tools", "otelcol")
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "", errors.New("the OpenTelemetry Collector is not built: run `make otelcol` (tools/otelcol into .tools/otelcol), or set OTELCOL to its path")
		}
		dir = parent
	}
}

// Options shape the receiver.
type Options struct {
	// Token, when set, makes the receiver refuse requests without the header
	// "authorization: Bearer <Token>" (the collector's bearertokenauth extension).
	Token string
	// CertFile and KeyFile, when set, make the receiver serve TLS with them (PEM paths).
	CertFile, KeyFile string
}

// Collector is a running collector; it stops when the test ends.
type Collector struct {
	Endpoint string // http://127.0.0.1:port, or https:// with TLS
	out      string // the file exporter's JSON lines
	cmd      *exec.Cmd
	log      testutil.SyncBuffer
	done     chan struct{}
}

// Start runs a collector with opts, skipping t if the binary is not built (failing it
// under CI=true), and returns once its receiver accepts connections.
func Start(t testing.TB, opts Options) *Collector {
	t.Helper()
	bin, err := Binary()
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	dir := t.TempDir()
	for attempt := 1; ; attempt++ {
		c, err := start(t, bin, dir, opts)
		if err == nil {
			return c
		}
		if attempt == 3 || !strings.Contains(err.Error(), "address already in use") {
			t.Fatal(err)
		}
	}
}

// start picks a free port for the receiver and starts the collector on it; another
// process may take the port in between, which start reports so Start tries another.
func start(t testing.TB, bin, dir string, opts Options) (*Collector, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	addr := ln.Addr().String()
	ln.Close()
	c := &Collector{Endpoint: "http://" + addr, out: filepath.Join(dir, "logs.json"), done: make(chan struct{})}
	grpc := "        endpoint: " + addr + "\n"
	var extensions, service string
	if opts.Token != "" {
		grpc += "        auth:\n          authenticator: bearertokenauth\n"
		extensions = "extensions:\n  bearertokenauth:\n    token: " + strconv.Quote(opts.Token) + "\n"
		service = "  extensions: [bearertokenauth]\n"
	}
	if opts.CertFile != "" {
		grpc += "        tls:\n          cert_file: " + strconv.Quote(opts.CertFile) + "\n          key_file: " + strconv.Quote(opts.KeyFile) + "\n"
		c.Endpoint = "https://" + addr
	}
	config := "receivers:\n  otlp:\n    protocols:\n      grpc:\n" + grpc + extensions +
		"exporters:\n  file:\n    path: " + strconv.Quote(c.out) + "\n    flush_interval: 50ms\n" +
		"service:\n" + service +
		"  telemetry:\n    metrics:\n      level: none\n    logs:\n      level: warn\n" + // no :8888 of its own
		"  pipelines:\n    logs:\n      receivers: [otlp]\n      exporters: [file]\n"
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, []byte(config), 0o600); err != nil {
		return nil, err
	}
	c.cmd = exec.Command(bin, "--config", path)
	c.cmd.Stdout, c.cmd.Stderr = &c.log, &c.log
	if err := c.cmd.Start(); err != nil {
		return nil, err
	}
	go func() { _ = c.cmd.Wait(); close(c.done) }()
	err = testutil.Poll(30*time.Second, func() error {
		select {
		case <-c.done:
			return nil
		default:
		}
		conn, err := net.Dial("tcp", addr)
		if err == nil {
			conn.Close()
		}
		return err
	})
	select {
	case <-c.done:
		return nil, fmt.Errorf("otelcol exited at start: %s", c.log.String())
	default:
	}
	if err != nil {
		c.stop()
		return nil, fmt.Errorf("otelcol's receiver did not open %s: %v\n%s", addr, err, c.log.String())
	}
	t.Cleanup(func() {
		c.stop()
		if t.Failed() {
			t.Logf("otelcol's output:\n%s", c.log.String())
		}
	})
	return c, nil
}

// stop ends the collector: SIGTERM, then SIGKILL if it has not exited within 10 s.
func (c *Collector) stop() {
	_ = c.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-c.done:
	case <-time.After(10 * time.Second):
		_ = c.cmd.Process.Kill()
		<-c.done
	}
}

// Output is what the collector logged (WARN and up): a refused request, say.
func (c *Collector) Output() string { return c.log.String() }

// Record is one log record as the collector received it.
type Record struct {
	Resource     map[string]any // resource attributes
	Scope        string         // instrumentation scope name
	Severity     string         // severityText
	Body         any
	Attributes   map[string]any // values as JSON decodes them: string, float64 (ints too), bool
	TimeUnixNano uint64
}

// Records waits until the collector has written at least n records, and returns them all.
func (c *Collector) Records(t testing.TB, n int) []Record {
	t.Helper()
	var recs []Record
	err := testutil.Poll(testutil.Timeout, func() error {
		var err error
		if recs, err = c.read(); err == nil && len(recs) < n {
			err = fmt.Errorf("%d records; want %d", len(recs), n)
		}
		return err
	})
	if err != nil {
		t.Fatalf("otelcol: %v", err)
	}
	return recs
}

// The file exporter writes one OTLP/JSON LogsData per line.
type logsData struct {
	ResourceLogs []struct {
		Resource struct {
			Attributes []keyValue `json:"attributes"`
		} `json:"resource"`
		ScopeLogs []struct {
			Scope struct {
				Name string `json:"name"`
			} `json:"scope"`
			LogRecords []struct {
				TimeUnixNano string          `json:"timeUnixNano"`
				SeverityText string          `json:"severityText"`
				Body         json.RawMessage `json:"body"`
				Attributes   []keyValue      `json:"attributes"`
			} `json:"logRecords"`
		} `json:"scopeLogs"`
	} `json:"resourceLogs"`
}

type keyValue struct {
	Key   string          `json:"key"`
	Value json.RawMessage `json:"value"`
}

func (c *Collector) read() ([]Record, error) {
	data, err := os.ReadFile(c.out)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var recs []Record
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if len(bytes.TrimSpace(line)) == 0 {
			continue
		}
		var ld logsData
		if err := json.Unmarshal(line, &ld); err != nil {
			return nil, fmt.Errorf("file exporter line %q: %w", line, err)
		}
		for _, rl := range ld.ResourceLogs {
			res, err := attributes(rl.Resource.Attributes)
			if err != nil {
				return nil, err
			}
			for _, sl := range rl.ScopeLogs {
				for _, lr := range sl.LogRecords {
					r := Record{Resource: res, Scope: sl.Scope.Name, Severity: lr.SeverityText}
					if r.Body, err = anyValue(lr.Body); err != nil {
						return nil, err
					}
					if r.Attributes, err = attributes(lr.Attributes); err != nil {
						return nil, err
					}
					r.TimeUnixNano, _ = strconv.ParseUint(lr.TimeUnixNano, 10, 64)
					recs = append(recs, r)
				}
			}
		}
	}
	return recs, sc.Err()
}

func attributes(kvs []keyValue) (map[string]any, error) {
	m := make(map[string]any, len(kvs))
	for _, kv := range kvs {
		v, err := anyValue(kv.Value)
		if err != nil {
			return nil, fmt.Errorf("attribute %s: %w", kv.Key, err)
		}
		m[kv.Key] = v
	}
	return m, nil
}

// anyValue decodes an OTLP/JSON AnyValue of a scalar kind as encoding/json decodes the JSON
// log's values: int64s (strings in OTLP/JSON) and doubles as float64.
func anyValue(raw json.RawMessage) (any, error) {
	var v struct {
		String *string  `json:"stringValue"`
		Int    *string  `json:"intValue"`
		Double *float64 `json:"doubleValue"`
		Bool   *bool    `json:"boolValue"`
	}
	if err := json.Unmarshal(raw, &v); err != nil {
		return nil, err
	}
	switch {
	case v.String != nil:
		return *v.String, nil
	case v.Int != nil:
		return strconv.ParseFloat(*v.Int, 64)
	case v.Double != nil:
		return *v.Double, nil
	case v.Bool != nil:
		return *v.Bool, nil
	}
	return nil, fmt.Errorf("AnyValue %s: not a scalar", raw)
}

// CompareWithJSON checks an exported record field by field against the JSON log's line:
// msg is the body, level the severity, time is the record's own, every other field an
// attribute of the same value; and no attribute the JSON line lacks.
func CompareWithJSON(t *testing.T, rec Record, line map[string]any) {
	t.Helper()
	for k, v := range line {
		var got any
		var ok bool
		switch k {
		case "time":
			continue
		case "msg":
			got, ok = rec.Body, true
		case "level":
			got, ok = rec.Severity, true
		default:
			got, ok = rec.Attributes[k]
		}
		if !ok || got != v {
			t.Errorf("field %s: exported %v (%T, present %v); the JSON log has %v (%T)", k, got, got, ok, v, v)
		}
	}
	for k := range rec.Attributes {
		if _, ok := line[k]; !ok {
			t.Errorf("exported attribute %s=%v is not in the JSON log", k, rec.Attributes[k])
		}
	}
}
