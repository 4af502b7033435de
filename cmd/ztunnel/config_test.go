package main

import (
	"bytes"
	"errors"
	"log/slog"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gozt/gozt/metrics"
)

func env(m map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) { v, ok := m[k]; return v, ok }
}

func TestConfigDefaults(t *testing.T) {
	c, err := loadConfig(env(nil), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, got, want string }{
		{"AdminAddr", c.AdminAddr, "localhost:15000"},
		{"StatsAddr", c.StatsAddr, "[::]:15020"},
		{"ReadinessAddr", c.ReadinessAddr, "[::]:15021"},
		{"OutboundAddr", c.OutboundAddr, "[::]:15001"},
		{"InboundPlaintextAddr", c.InboundPlaintextAddr, "[::]:15006"},
		{"InboundAddr", c.InboundAddr, "[::]:15008"},
		{"Socks5Addr (off by default)", c.Socks5Addr, ""},
		{"DNSProxyAddr", c.DNSProxyAddr, "localhost:15053"},
		{"ProxyMode", string(c.ProxyMode), "shared"},
		{"InpodUDS", c.InpodUDS, "/var/run/ztunnel/ztunnel.sock"},
		{"ClusterID", c.ClusterID, "Kubernetes"},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %q; want %q", tc.name, tc.got, tc.want)
		}
	}
	if c.StreamWindow != 4<<20 || c.ConnWindow != 16<<20 || c.FrameSize != 1<<20 {
		t.Errorf("windows = %d/%d/%d; want 4Mi/16Mi/1Mi", c.StreamWindow, c.ConnWindow, c.FrameSize)
	}
	if c.PoolMaxStreams != 100 || c.PoolUnusedRelease != 5*time.Minute || c.TerminationDeadline != 5*time.Second {
		t.Errorf("pool/drain defaults = %d %v %v", c.PoolMaxStreams, c.PoolUnusedRelease, c.TerminationDeadline)
	}
	if c.PacketMark != 1337 || c.SecretTTL != 24*time.Hour || !c.KeepaliveEnabled {
		t.Errorf("mark/ttl/keepalive = %d %v %v", c.PacketMark, c.SecretTTL, c.KeepaliveEnabled)
	}
	if !c.InpodPortReuse || !c.IPv6Enabled {
		t.Errorf("INPOD_PORT_REUSE/IPV6_ENABLED = %v/%v; want true/true", c.InpodPortReuse, c.IPv6Enabled)
	}
}

// TestPodAddr: a pod's listeners keep the setting's port on the wildcard address of the
// families IPV6_ENABLED allows.
func TestPodAddr(t *testing.T) {
	for _, tc := range []struct {
		setting string
		ipv6    bool
		want    string
	}{
		{"[::]:15001", true, "[::]:15001"},
		{"[::]:15001", false, "0.0.0.0:15001"},
		{"127.0.0.1:16008", true, "[::]:16008"},
		{"", true, ""},
	} {
		if got := podAddr(tc.setting, tc.ipv6); got != tc.want {
			t.Errorf("podAddr(%q, %v) = %q; want %q", tc.setting, tc.ipv6, got, tc.want)
		}
	}
}

func TestConfigOverrides(t *testing.T) {
	c, err := loadConfig(env(map[string]string{
		"ADMIN_ADDR":             "127.0.0.2:15000",
		"UNSTABLE_ENABLE_SOCKS5": "true",
		"HTTP2_FRAME_SIZE":       "64Ki",
		"PROXY_MODE":             "dedicated",
		"PROXY_WORKLOAD_INFO":    "default/local/default",
		"OUTBOUND_ADDR":          "off",
	}), []string{"XDS_HEADER_X_TEAM=blue", "CA_HEADER_FOO=bar", "PATH=/bin"}, []string{"--admin-addr=127.0.0.3:1"})
	if err != nil {
		t.Fatal(err)
	}
	if c.AdminAddr != "127.0.0.3:1" {
		t.Errorf("flag should win over env: AdminAddr = %q", c.AdminAddr)
	}
	if c.Socks5Addr != "127.0.0.1:15080" {
		t.Errorf("Socks5Addr = %q; want the default address once enabled", c.Socks5Addr)
	}
	if c.FrameSize != 64<<10 || c.OutboundAddr != "" {
		t.Errorf("FrameSize = %d, OutboundAddr = %q", c.FrameSize, c.OutboundAddr)
	}
	if c.XDSHeaders["X_TEAM"] != "blue" || c.CAHeaders["FOO"] != "bar" || len(c.XDSHeaders) != 1 {
		t.Errorf("headers = %v %v", c.XDSHeaders, c.CAHeaders)
	}
	// SOCKS5_ADDR alone turns SOCKS5 on.
	c, err = loadConfig(env(map[string]string{"SOCKS5_ADDR": "127.0.0.5:1080"}), nil, nil)
	if err != nil || c.Socks5Addr != "127.0.0.5:1080" {
		t.Errorf("SOCKS5_ADDR alone: %q, %v", c.Socks5Addr, err)
	}
}

// COMPLIANCE_POLICY=pqc reaches the certificate manager's TLS configurations.
func TestCompliancePolicy(t *testing.T) {
	c, err := loadConfig(env(map[string]string{"COMPLIANCE_POLICY": "pqc"}), nil, nil)
	if err != nil || c.Compliance != "pqc" {
		t.Fatalf("COMPLIANCE_POLICY=pqc: %q, %v", c.Compliance, err)
	}
}

// Bad config refuses to start with a message naming the variable and the accepted forms.
func TestConfigErrorsNameTheVariable(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		args []string
		want []string
	}{
		{env: map[string]string{"ADMIN_ADDR": "nope"}, want: []string{"ADMIN_ADDR", "host:port"}},
		{env: map[string]string{"INBOUND_ADDR": "1.2.3.4:99999"}, want: []string{"INBOUND_ADDR", "bad port"}},
		{env: map[string]string{"PROXY_MODE": "sidecar"}, want: []string{"PROXY_MODE", "shared, node, dedicated"}},
		{env: map[string]string{"SECRET_TTL": "tomorrow"}, want: []string{"SECRET_TTL", "duration"}},
		{env: map[string]string{"COMPLIANCE_POLICY": "fips-140-2"}, want: []string{"COMPLIANCE_POLICY", "pqc"}},
		{env: map[string]string{"SECRET_TTL": "-1h"}, want: []string{"SECRET_TTL", "positive"}},
		{env: map[string]string{"HTTP2_STREAM_WINDOW_SIZE": "4Gi"}, want: []string{"HTTP2_STREAM_WINDOW_SIZE", "Ki or Mi"}},
		{env: map[string]string{"HTTP2_STREAM_WINDOW_SIZE": "4096Mi"}, want: []string{"HTTP2_STREAM_WINDOW_SIZE", "out of range"}},
		{env: map[string]string{"POOL_MAX_STREAMS_PER_CONNECTION": "0"}, want: []string{"POOL_MAX_STREAMS_PER_CONNECTION", "positive"}},
		{env: map[string]string{"UNSTABLE_ENABLE_SOCKS5": "yes please"}, want: []string{"UNSTABLE_ENABLE_SOCKS5", "true or false"}},
		{env: map[string]string{"PROXY_MODE": "dedicated"}, want: []string{"PROXY_WORKLOAD_INFO", "namespace/name/serviceaccount"}},
		{env: map[string]string{"PROXY_WORKLOAD_INFO": "a//b"}, want: []string{"PROXY_WORKLOAD_INFO", "three"}},
		{env: map[string]string{"METRICS_DROP_LABELS": "source_principal,destination_wrkload"}, want: []string{"METRICS_DROP_LABELS", "destination_wrkload", "not an istio_tcp_* label"}},
		{env: map[string]string{"METRICS_DROP_LABELS": "reporter"}, want: []string{"METRICS_DROP_LABELS", "reporter cannot be dropped"}},
		{env: map[string]string{"ACCESS_LOG_FILTER": "errors"}, want: []string{"ACCESS_LOG_FILTER", "failed"}},
		{env: map[string]string{"ACCESS_LOG_SAMPLE": "1.5"}, want: []string{"ACCESS_LOG_SAMPLE", "fraction"}},
		{env: map[string]string{"ACCESS_LOG_OTLP_ENDPOINT": "http://collector:4317", "OTEL_EXPORTER_OTLP_TIMEOUT": "5s"}, want: []string{"OTEL_EXPORTER_OTLP_TIMEOUT", "milliseconds"}},
		{args: []string{"--no-such-flag"}, want: []string{"no-such-flag", "--help"}},
		{args: []string{"stray"}, want: []string{"stray"}},
	} {
		_, err := loadConfig(env(tc.env), nil, tc.args)
		if err == nil {
			t.Errorf("%v %v: no error", tc.env, tc.args)
			continue
		}
		for _, w := range tc.want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%v %v: error %q does not mention %q", tc.env, tc.args, err, w)
			}
		}
	}
}

// docs/CONFIGURATION.md's table is generated from the settings table; this keeps them
// from drifting. Regenerate with: go run ./cmd/ztunnel config-table
func TestReadmeConfigTable(t *testing.T) {
	readme, err := os.ReadFile("../../docs/CONFIGURATION.md")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(readme), markdownTable()) {
		t.Fatal("docs/CONFIGURATION.md's configuration table is stale: replace it with the output of `go run ./cmd/ztunnel config-table`")
	}
}

func TestHelpDocumentsEverySetting(t *testing.T) {
	h := usage()
	for _, s := range allSettings() {
		if !strings.Contains(h, s.env) || !strings.Contains(h, "--"+flagName(s.env)) {
			t.Errorf("--help does not document %s", s.env)
		}
	}
}

// ACCESS_LOG_SAMPLE is the fraction of successful connections recorded, as a sampling
// ratio reads: 0 records none of them (failed ones still), 1 and unset every one.
func TestAccessLogSample(t *testing.T) {
	for _, tc := range []struct {
		sample         string // "" unset
		successes, all int    // records of 10 successes, of 10 successes and 2 failures
	}{{"", 10, 12}, {"1", 10, 12}, {"0", 0, 2}} {
		m := map[string]string{}
		if tc.sample != "" {
			m["ACCESS_LOG_SAMPLE"] = tc.sample
		}
		c, err := loadConfig(env(m), nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		var out bytes.Buffer
		mt := metrics.New(prometheus.NewRegistry(), "test", metrics.WithAccessLog(slog.New(slog.NewJSONHandler(&out, nil))),
			metrics.WithAccessLogFilter(c.AccessLog))
		l := metrics.Labels{Reporter: metrics.ReporterSource}
		count := func() int { return strings.Count(out.String(), `"connection complete"`) }
		for range 10 {
			mt.Open(l, metrics.ConnLog{}).Close(1, 1, "", nil)
		}
		if got := count(); got != tc.successes {
			t.Errorf("ACCESS_LOG_SAMPLE=%q: %d records of 10 successful connections; want %d", tc.sample, got, tc.successes)
		}
		mt.Open(l, metrics.ConnLog{}).Close(0, 0, metrics.FlagConnect, errors.New("refused"))
		mt.Open(l, metrics.ConnLog{}).Close(0, 0, metrics.FlagDeny, nil)
		if got := count(); got != tc.all {
			t.Errorf("ACCESS_LOG_SAMPLE=%q: %d records after 2 failed connections; want %d", tc.sample, got, tc.all)
		}
	}
}
