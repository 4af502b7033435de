package main

import (
	"os"
	"strings"
	"testing"
	"time"
)

// Every variable the Rust ztunnel reads (testdata/rust-ztunnel-env.txt, with the commit it was
// read from) has a row in gozt's configuration table, implemented, reported as not used or
// refused, and the table's "Rust ztunnel" column is true both ways.
func TestRustVariables(t *testing.T) {
	b, err := os.ReadFile("testdata/rust-ztunnel-env.txt")
	if err != nil {
		t.Fatal(err)
	}
	rust := map[string]bool{}
	for line := range strings.SplitSeq(string(b), "\n") {
		if line = strings.TrimSpace(line); line != "" && !strings.HasPrefix(line, "#") {
			rust[line] = true
		}
	}
	rows := map[string]bool{}     // every row of the table
	goztOnly := map[string]bool{} // the rows marked as not read by the Rust ztunnel
	for _, s := range allSettings() {
		rows[s.env], goztOnly[s.env] = true, s.goztOnly
	}
	for _, p := range prefixed {
		rows[p.prefix+"<NAME>"] = true
	}
	for name := range rust {
		if !rows[name] {
			t.Errorf("the Rust ztunnel reads %s; gozt's table has no row for it (implement it, or accept it as not used, or refuse it, in rustenv.go)", name)
		}
		if goztOnly[name] {
			t.Errorf("%s is marked as not read by the Rust ztunnel, but it is", name)
		}
	}
	for name := range rows {
		if !rust[name] && !goztOnly[name] {
			t.Errorf("%s is not in the Rust ztunnel's list; mark it goztOnly so the table says so", name)
		}
	}
}

// The Rust ztunnel's variables mean the same here: FAKE_CA picks the built-in CA,
// ISTIO_META_DNS_CAPTURE=false turns the DNS proxy off, ISTIO_META_DNS_PROXY_ADDR moves it,
// PREFERED_SERVICE_NAMESPACE reaches the store, and what gozt cannot do is refused by name.
func TestRustVariablesMeaning(t *testing.T) {
	for _, tc := range []struct {
		name string
		env  map[string]string
		err  string
		ok   func(c *config) bool
	}{
		{"fake ca", map[string]string{"FAKE_CA": "true"}, "", func(c *config) bool { return c.CAProvider == "builtin" }},
		{"fake ca, provider wins", map[string]string{"FAKE_CA": "true", "CA_PROVIDER": "istio"}, "", func(c *config) bool { return c.CAProvider == "istio" }},
		{"dns capture off", map[string]string{"ISTIO_META_DNS_CAPTURE": "false"}, "", func(c *config) bool { return c.DNSProxyAddr == "" }},
		{"dns capture off, addr wins", map[string]string{"ISTIO_META_DNS_CAPTURE": "false", "DNS_PROXY_ADDR": "127.0.0.1:5353"}, "", func(c *config) bool { return c.DNSProxyAddr == "127.0.0.1:5353" }},
		{"dns proxy port", map[string]string{"ISTIO_META_DNS_PROXY_ADDR": "15054"}, "", func(c *config) bool { return c.DNSProxyAddr == "localhost:15054" }},
		{"dns proxy addr", map[string]string{"ISTIO_META_DNS_PROXY_ADDR": "127.0.0.1:15054"}, "", func(c *config) bool { return c.DNSProxyAddr == "127.0.0.1:15054" }},
		{"bad dns capture", map[string]string{"ISTIO_META_DNS_CAPTURE": "maybe"}, "ISTIO_META_DNS_CAPTURE", nil},
		{"user timeout", map[string]string{"USER_TIMEOUT_ENABLED": "true", "KEEPALIVE_TIME": "60s", "KEEPALIVE_INTERVAL": "10s", "KEEPALIVE_RETRIES": "3"}, "", func(c *config) bool { return nodeProxyConfig(c).UserTimeout == 90*time.Second }},
		{"user timeout off", map[string]string{}, "", func(c *config) bool { return nodeProxyConfig(c).UserTimeout == 0 }},
		{"preferred namespace", map[string]string{"PREFERED_SERVICE_NAMESPACE": "istio-system"}, "", func(c *config) bool { return c.PreferredServiceNamespace == "istio-system" }},
		{"proxy off", map[string]string{"ENABLE_PROXY": "false"}, "ENABLE_PROXY", nil},
		{"proxy on", map[string]string{"ENABLE_PROXY": "true"}, "", func(*config) bool { return true }},
		{"tls 1.2", map[string]string{"TLS12_ENABLED": "true"}, "", func(c *config) bool { return c.TLS12Enabled }},
		{"crl", map[string]string{"CRL_PATH": "/var/run/secrets/istio/crl/ca-crl.pem"}, "", func(c *config) bool { return c.CRLPath == "/var/run/secrets/istio/crl/ca-crl.pem" }},
		{"inline config", map[string]string{"LOCAL_XDS": "workloads: []"}, "LOCAL_XDS", nil},
		{"localhost app tunnel off", map[string]string{"LOCALHOST_APP_TUNNEL": "false"}, "LOCALHOST_APP_TUNNEL", nil},
		{"response baggage on", map[string]string{}, "", func(c *config) bool { return !nodeProxyConfig(c).DisableBaggage }},
		{"response baggage off", map[string]string{"ENABLE_RESPONSE_BAGGAGE": "false"}, "", func(c *config) bool { return nodeProxyConfig(c).DisableBaggage }},
		{"not used", map[string]string{"AUTHZ_POLICY_INFO_LOGGING": "true", "ISTIO_METAJSON_LABELS": "{}"}, "", func(c *config) bool {
			return strings.Contains(strings.Join(c.chart.unused, "\n"), "AUTHZ_POLICY_INFO_LOGGING") && strings.Contains(strings.Join(c.chart.unused, "\n"), "ISTIO_METAJSON_LABELS")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var environ []string
			for k, v := range tc.env {
				environ = append(environ, k+"="+v)
			}
			c, err := loadConfig(env(tc.env), environ, nil)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v; want one naming %s", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !tc.ok(c) {
				t.Errorf("config %+v", c)
			}
		})
	}
}
