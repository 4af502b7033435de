package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// meshFile is a mesh config as Istio's istio ConfigMap holds it, with fields the Rust
// ztunnel ignores around the ones it reads.
const meshFile = `
accessLogFile: /dev/stdout
defaultConfig:
  discoveryAddress: istiod.istio-system.svc:15012
  proxyAdminPort: 15099
  statsPort: 15888
  concurrency: 3
  terminationDrainDuration: 5s
  tracing: {zipkin: {address: zipkin:9411}}
  proxyMetadata:
    ISTIO_META_FOO: foo
    FOOBAR: from-file
    CLUSTER_ID: from-file
`

// Each field of the mesh config file and PROXY_CONFIG the Rust ztunnel reads changes the
// same setting here, PROXY_CONFIG over the file, and the variable of the same meaning over
// both (its construct_config and config_from_proxyconfig test).
func TestProxyConfigFields(t *testing.T) {
	dir := t.TempDir()
	mesh := filepath.Join(dir, "mesh")
	if err := os.WriteFile(mesh, []byte(meshFile), 0o644); err != nil {
		t.Fatal(err)
	}
	missing := filepath.Join(dir, "none")
	for _, tc := range []struct {
		name string
		path string
		env  map[string]string
		ok   func(c *config) bool
	}{
		{"file: ports", mesh, nil, func(c *config) bool { return c.AdminAddr == "localhost:15099" && c.StatsAddr == "[::]:15888" }},
		{"file: discoveryAddress", mesh, nil, func(c *config) bool { return c.XDSAddress == "istiod.istio-system.svc:15012" }},
		{"file: concurrency", mesh, nil, func(c *config) bool { return c.WorkerThreads.threads(16, 0, 16, false) == 3 }},
		{"file: metadata, prefix dropped", mesh, nil, func(c *config) bool {
			return c.ProxyMeta["FOO"] == "foo" && c.ProxyMeta["FOOBAR"] == "from-file"
		}},
		{"file: metadata CLUSTER_ID is metadata only", mesh, nil, func(c *config) bool { return c.ClusterID == "Kubernetes" }},
		{"no file: defaults", missing, nil, func(c *config) bool {
			return c.AdminAddr == "localhost:15000" && c.StatsAddr == "[::]:15020" && c.XDSAddress == "" && !c.WorkerThreads.set
		}},
		{"PROXY_CONFIG JSON alone", missing, map[string]string{"PROXY_CONFIG": `{"discoveryAddress": "istiod-rev0.istio-system-2:15012", "proxyAdminPort": 15999, "proxyMetadata": {"ISTIO_META_BAR": "bar", "NO_PREFIX": "no-prefix"}}`}, func(c *config) bool {
			return c.XDSAddress == "istiod-rev0.istio-system-2:15012" && c.AdminAddr == "localhost:15999" && c.StatsAddr == "[::]:15020" &&
				c.ProxyMeta["BAR"] == "bar" && c.ProxyMeta["NO_PREFIX"] == "no-prefix"
		}},
		{"PROXY_CONFIG over the file, field by field", mesh, map[string]string{"PROXY_CONFIG": "proxyAdminPort: 15999\nproxyMetadata: {FOOBAR: overwritten}"}, func(c *config) bool {
			return c.AdminAddr == "localhost:15999" && c.StatsAddr == "[::]:15888" && c.ProxyMeta["FOOBAR"] == "overwritten" && c.ProxyMeta["FOO"] == "foo"
		}},
		{"PROXY_CONFIG over the file in the other spelling", mesh, map[string]string{"PROXY_CONFIG": "proxyMetadata: {FOO: unprefixed, ISTIO_META_FOOBAR: prefixed}"}, func(c *config) bool {
			return c.ProxyMeta["FOO"] == "unprefixed" && c.ProxyMeta["FOOBAR"] == "prefixed"
		}},
		{"both spellings in one source: the unprefixed one", missing, map[string]string{"PROXY_CONFIG": "proxyMetadata: {ISTIO_META_X: prefixed, X: plain}"}, func(c *config) bool {
			return c.ProxyMeta["X"] == "plain"
		}},
		{"empty PROXY_CONFIG: the file", mesh, map[string]string{"PROXY_CONFIG": ""}, func(c *config) bool { return c.AdminAddr == "localhost:15099" }},
		{"ADMIN_ADDR and STATS_ADDR win", mesh, map[string]string{"ADMIN_ADDR": "127.0.0.1:9000", "STATS_ADDR": "off"}, func(c *config) bool {
			return c.AdminAddr == "127.0.0.1:9000" && c.StatsAddr == ""
		}},
		{"XDS_ADDRESS wins", mesh, map[string]string{"XDS_ADDRESS": "http://127.0.0.1:15010"}, func(c *config) bool { return c.XDSAddress == "http://127.0.0.1:15010" }},
		{"ZTUNNEL_WORKER_THREADS wins", mesh, map[string]string{"ZTUNNEL_WORKER_THREADS": "5"}, func(c *config) bool { return c.WorkerThreads.threads(16, 0, 16, false) == 5 }},
		{"concurrency 0: every core", missing, map[string]string{"PROXY_CONFIG": "concurrency: 0"}, func(c *config) bool { return c.WorkerThreads.threads(16, 0, 16, false) == 16 }},
		{"ISTIO_META_ variable wins over metadata", mesh, map[string]string{"ISTIO_META_FOO": "env"}, func(c *config) bool { return c.ProxyMeta["FOO"] == "env" }},
		{"metadata DNS_CAPTURE false: no DNS proxy", missing, map[string]string{"PROXY_CONFIG": `{"proxyMetadata": {"ISTIO_META_DNS_CAPTURE": "false"}}`}, func(c *config) bool { return c.DNSProxyAddr == "" }},
		{"metadata DNS_PROXY_ADDR moves it", missing, map[string]string{"PROXY_CONFIG": `{"proxyMetadata": {"DNS_PROXY_ADDR": "15054"}}`}, func(c *config) bool { return c.DNSProxyAddr == "localhost:15054" }},
		{"ISTIO_META_DNS_CAPTURE wins over metadata", missing, map[string]string{"PROXY_CONFIG": `{"proxyMetadata": {"DNS_CAPTURE": "false"}}`, "ISTIO_META_DNS_CAPTURE": "true"}, func(c *config) bool { return c.DNSProxyAddr == "localhost:15053" }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := loadConfigMesh(env(tc.env), environ(tc.env), nil, tc.path)
			if err != nil {
				t.Fatal(err)
			}
			if !tc.ok(c) {
				t.Errorf("admin %q stats %q xds %q threads %+v meta %v dns %q cluster %q", c.AdminAddr, c.StatsAddr, c.XDSAddress, c.WorkerThreads, c.ProxyMeta, c.DNSProxyAddr, c.ClusterID)
			}
		})
	}
}

// A mesh config file or PROXY_CONFIG that does not parse stops the start, naming which.
func TestProxyConfigErrors(t *testing.T) {
	dir := t.TempDir()
	bad := filepath.Join(dir, "bad")
	if err := os.WriteFile(bad, []byte("defaultConfig:\n  proxyAdminPort: [15099\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, "good")
	if err := os.WriteFile(good, []byte(meshFile), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path, proxyConfig, want string
	}{
		{"bad YAML in the file", bad, "", "mesh config file " + bad},
		{"the file is a directory", dir, "", "mesh config file " + dir},
		{"bad YAML in PROXY_CONFIG", good, "{proxyAdminPort: ", "PROXY_CONFIG"},
		{"port out of range", good, `{"statsPort": 70000}`, "PROXY_CONFIG"},
		{"port not a number", good, "proxyAdminPort: admin", "PROXY_CONFIG"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := map[string]string{"PROXY_CONFIG": tc.proxyConfig}
			_, err := loadConfigMesh(env(e), environ(e), nil, tc.path)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v; want one naming %q", err, tc.want)
			}
		})
	}
}
