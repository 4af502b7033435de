package main

import (
	"bytes"
	"encoding/json"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// chartVars is the environment Istio's ztunnel chart gives the container (values at their
// defaults, downward-API fields filled in as the kubelet would).
var chartVars = map[string]string{
	"CA_ADDRESS":                       "istiod.istio-system.svc:15012",
	"XDS_ADDRESS":                      "istiod.istio-system.svc:15012",
	"RUST_LOG":                         "info",
	"RUST_BACKTRACE":                   "1",
	"ISTIO_META_CLUSTER_ID":            "east",
	"INPOD_ENABLED":                    "true",
	"TERMINATION_GRACE_PERIOD_SECONDS": "30",
	"POD_NAME":                         "ztunnel-abcde",
	"POD_NAMESPACE":                    "istio-system",
	"NODE_NAME":                        "node-1",
	"INSTANCE_IP":                      "10.244.0.7",
	"SERVICE_ACCOUNT":                  "ztunnel",
	"ISTIO_META_ENABLE_HBONE":          "true",
	"ZTUNNEL_CPU_LIMIT":                "16",
	"ZTUNNEL_RESOURCE_CPU_LIMIT":       "1500m",
	"ZTUNNEL_RESOURCE_CPU_REQUEST":     "200m",
	"LOG_FORMAT":                       "json",
}

func environ(m map[string]string) []string {
	var out []string
	for k, v := range m {
		out = append(out, k+"="+v)
	}
	return out
}

func TestChartEnvironment(t *testing.T) {
	c, err := loadConfig(env(chartVars), environ(chartVars), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ name, got, want string }{
		{"ClusterID (from ISTIO_META_CLUSTER_ID)", c.ClusterID, "east"},
		{"LogLevel (from RUST_LOG)", c.LogLevel, "info"},
		{"LogFormat", c.LogFormat, "json"},
		{"NodeName", c.NodeName, "node-1"},
		{"PodName", c.PodName, "ztunnel-abcde"},
		{"PodNamespace", c.PodNamespace, "istio-system"},
		{"ServiceAccount (the self-proxy's workload)", c.ServiceAccount, "ztunnel"},
		{"InstanceIP", c.InstanceIP, "10.244.0.7"},
		{"ProxyMeta[ENABLE_HBONE]", c.ProxyMeta["ENABLE_HBONE"], "true"},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %q; want %q", tc.name, tc.got, tc.want)
		}
	}
	if c.TerminationDeadline != 25*time.Second {
		t.Errorf("TerminationDeadline = %v; want 25s (grace period 30s less 5s)", c.TerminationDeadline)
	}
	if c.CPULimit != 2 {
		t.Errorf("CPULimit = %d; want 2 (the smaller of 16 and 1500m rounded up)", c.CPULimit)
	}
	unused := strings.Join(c.chart.unused, "\n")
	for _, v := range []string{"INPOD_ENABLED", "RUST_BACKTRACE", "ZTUNNEL_RESOURCE_CPU_REQUEST"} {
		if !strings.Contains(unused, v+": ") {
			t.Errorf("%s is not reported as not acted on; reported:\n%s", v, unused)
		}
	}
	if len(c.chart.unused) != 3 {
		t.Errorf("reported %d variables as not acted on; want 3:\n%s", len(c.chart.unused), unused)
	}
}

// gozt's own variables win over the chart's.
func TestChartVariablesYieldToGozt(t *testing.T) {
	vars := map[string]string{
		"CLUSTER_ID": "west", "ISTIO_META_CLUSTER_ID": "east",
		"LOG_LEVEL": "warn", "RUST_LOG": "debug",
		"CONNECTION_TERMINATION_DEADLINE": "7s", "TERMINATION_GRACE_PERIOD_SECONDS": "30",
	}
	c, err := loadConfig(env(vars), environ(vars), nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.ClusterID != "west" || c.LogLevel != "warn" || c.TerminationDeadline != 7*time.Second {
		t.Errorf("ClusterID %q, LogLevel %q, TerminationDeadline %v; want west, warn, 7s", c.ClusterID, c.LogLevel, c.TerminationDeadline)
	}
	if len(c.chart.unused) != 0 {
		t.Errorf("unused = %q; want none", c.chart.unused)
	}
}

func TestDrainDeadline(t *testing.T) {
	for _, tc := range []struct {
		grace uint64
		want  time.Duration
	}{{30, 25 * time.Second}, {11, 6 * time.Second}, {10, 9 * time.Second}, {2, time.Second}, {1, time.Second}, {0, time.Second}, {300, 295 * time.Second}} {
		if got := drainDeadline(tc.grace); got != tc.want {
			t.Errorf("drainDeadline(%d) = %v; want %v", tc.grace, got, tc.want)
		}
	}
}

func TestParseRustLog(t *testing.T) {
	for _, tc := range []struct {
		in, level string
		scopes    map[string]string
		ignored   []string
	}{
		{"info", "info", nil, nil},
		{"trace", "debug", nil, nil},
		{"WARN", "warn", nil, nil},
		{"info,access=debug", "info", map[string]string{"access": "debug"}, nil},
		{"error, dns=off ,hickory_server=off", "error", map[string]string{"dns": "error+8"}, []string{"hickory_server"}},
		{"access=warn", "info", map[string]string{"access": "warn"}, nil},
	} {
		level, scopes, ignored, err := parseRustLog(tc.in)
		if err != nil || level != tc.level || !equalMaps(scopes, tc.scopes) || strings.Join(ignored, ",") != strings.Join(tc.ignored, ",") {
			t.Errorf("parseRustLog(%q) = %q %v %v %v; want %q %v %v", tc.in, level, scopes, ignored, err, tc.level, tc.scopes, tc.ignored)
		}
	}
	for _, bad := range []string{"loud", "access=chatty"} {
		if _, err := loadConfig(env(map[string]string{"RUST_LOG": bad}), nil, nil); err == nil || !strings.Contains(err.Error(), "RUST_LOG") {
			t.Errorf("RUST_LOG=%q: err = %v; want one naming RUST_LOG", bad, err)
		}
	}
	c, err := loadConfig(env(map[string]string{"RUST_LOG": "info,ztunnel::proxy=debug"}), nil, nil)
	if err != nil || len(c.chart.unused) != 1 || !strings.Contains(c.chart.unused[0], "ztunnel::proxy") {
		t.Errorf("unknown target: unused = %q, err %v; want it reported", c.chart.unused, err)
	}
}

func equalMaps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestCPUQuantity(t *testing.T) {
	for in, want := range map[string]int{"1": 1, "2": 2, "500m": 1, "1500m": 2, "2.5": 3, "100000": 1 << 16} {
		if got, err := cpuCores(in); err != nil || got != want {
			t.Errorf("cpuCores(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, bad := range []string{"", "0", "-1", "m", "two", "Inf"} {
		if _, err := cpuCores(bad); err == nil {
			t.Errorf("cpuCores(%q): no error", bad)
		}
	}
	if _, err := loadConfig(env(map[string]string{"ZTUNNEL_CPU_LIMIT": "lots"}), nil, nil); err == nil || !strings.Contains(err.Error(), "ZTUNNEL_CPU_LIMIT") {
		t.Errorf("ZTUNNEL_CPU_LIMIT=lots: err = %v", err)
	}
}

// RUST_LOG=info,access=debug: debug lines of the access scope are written, other debug
// lines are not, and POST /logging's level still moves the default.
func TestLogScopes(t *testing.T) {
	c, err := loadConfig(env(map[string]string{"RUST_LOG": "info,access=debug", "LOG_FORMAT": "json"}), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	var buf bytes.Buffer
	levels, err := newLogLevels(c.LogLevel, c.LogScopes)
	if err != nil {
		t.Fatal(err)
	}
	log := newLogger(c, levels, &buf)
	log.Debug("hidden")
	log.With("scope", "access").Debug("conn")
	log.With("scope", "dns").Debug("hidden too")
	if err := levels.apply("debug", false); err != nil {
		t.Fatal(err)
	}
	log.Debug("shown now")
	var msgs []string
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var rec struct{ Msg string }
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Fatalf("not JSON: %q", line)
		}
		msgs = append(msgs, rec.Msg)
	}
	if got := strings.Join(msgs, ","); got != "conn,shown now" {
		t.Errorf("logged %q; want conn,shown now", got)
	}
}

// The chart's command line and environment start the binary: `proxy ztunnel` is accepted
// and the variables gozt does not act on are reported at INFO, not refused.
func TestChartCommandLine(t *testing.T) {
	bin := buildZtunnel(t)
	out, err := exec.Command(bin, "proxy", "ztunnel", "version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "gozt") {
		t.Fatalf("ztunnel proxy ztunnel version: %v, %q", err, out)
	}
	vars := map[string]string{
		"PROXY_MODE": "dedicated", "PROXY_WORKLOAD_INFO": "default/local/default",
		"LOCAL_XDS_PATH": "../../examples/localhost.yaml", "XDS_ADDRESS": "", "CA_ADDRESS": "",
		"CA_PROVIDER": "builtin", "CA_DIR": t.TempDir(),
	}
	for _, a := range []string{"ADMIN_ADDR", "STATS_ADDR", "READINESS_ADDR", "OUTBOUND_ADDR", "INBOUND_PLAINTEXT_ADDR", "INBOUND_ADDR", "DNS_PROXY_ADDR"} {
		vars[a] = "127.0.0.1:0"
	}
	for k, v := range chartVars {
		if _, set := vars[k]; !set {
			vars[k] = v
		}
	}
	p := startProc(t, "ztunnel", environ(vars), bin, "proxy", "ztunnel")
	p.waitOutput(t, `"msg":"ztunnel started"`, 20*time.Second)
	logs := p.Output()
	for _, v := range []string{"INPOD_ENABLED", "RUST_BACKTRACE"} {
		if !strings.Contains(logs, `"level":"INFO","msg":"chart variable accepted, not acted on","variable":"`+v) {
			t.Errorf("no INFO line for %s:\n%s", v, logs)
		}
	}
	if err := p.stop(); err != nil {
		t.Errorf("exit after SIGTERM: %v", err)
	}
}
