package main

import (
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPrecedence climbs, for each setting more than one source can give, its sources from
// the lowest to the highest (resolveSources' table): each step adds one source (variables,
// mesh config lines under defaultConfig) to those below it, and the setting must take the
// new source's value.
func TestPrecedence(t *testing.T) {
	type step struct {
		env  map[string]string
		mesh string // a line under the mesh config file's defaultConfig
		want string
	}
	for _, tc := range []struct {
		setting string
		get     func(c *config) string
		steps   []step // the first adds nothing: the default
	}{
		{"XDS_ADDRESS", func(c *config) string { return c.XDSAddress }, []step{
			{want: ""},
			{mesh: "discoveryAddress: mesh:15012", want: "mesh:15012"},
			{env: map[string]string{"PROXY_CONFIG": "discoveryAddress: pc:15012"}, want: "pc:15012"},
			{env: map[string]string{"XDS_ADDRESS": "env:15012"}, want: "env:15012"},
		}},
		{"ADMIN_ADDR", func(c *config) string { return c.AdminAddr }, []step{
			{want: "localhost:15000"},
			{mesh: "proxyAdminPort: 15091", want: "localhost:15091"},
			{env: map[string]string{"PROXY_CONFIG": "proxyAdminPort: 15092"}, want: "localhost:15092"},
			{env: map[string]string{"ADMIN_ADDR": "127.0.0.1:9000"}, want: "127.0.0.1:9000"},
		}},
		{"STATS_ADDR", func(c *config) string { return c.StatsAddr }, []step{
			{want: "[::]:15020"},
			{mesh: "statsPort: 15091", want: "[::]:15091"},
			{env: map[string]string{"PROXY_CONFIG": "statsPort: 15092"}, want: "[::]:15092"},
			{env: map[string]string{"STATS_ADDR": "off"}, want: ""},
		}},
		{"ZTUNNEL_WORKER_THREADS", func(c *config) string { return fmt.Sprint(c.WorkerThreads.threads(16, 0, 16, false)) }, []step{
			{want: "4"},
			{mesh: "concurrency: 3", want: "3"},
			{env: map[string]string{"PROXY_CONFIG": "concurrency: 6"}, want: "6"},
			{env: map[string]string{"ZTUNNEL_WORKER_THREADS": "5"}, want: "5"},
		}},
		{"ISTIO_META_FOO", func(c *config) string { return c.ProxyMeta["FOO"] }, []step{
			{want: ""},
			{mesh: "proxyMetadata: {FOO: mesh}", want: "mesh"},
			{env: map[string]string{"PROXY_CONFIG": "proxyMetadata: {FOO: pc}"}, want: "pc"},
			{env: map[string]string{"ISTIO_META_FOO": "env"}, want: "env"},
		}},
		{"CLUSTER_ID", func(c *config) string { return c.ClusterID }, []step{
			{want: "Kubernetes"},
			{mesh: "proxyMetadata: {CLUSTER_ID: mesh}", want: "Kubernetes"}, // metadata only, as in the Rust ztunnel
			{env: map[string]string{"ISTIO_META_CLUSTER_ID": "meta"}, want: "meta"},
			{env: map[string]string{"CLUSTER_ID": "env"}, want: "env"},
		}},
		{"LOG_LEVEL", func(c *config) string { return c.LogLevel }, []step{
			{want: "info"},
			{env: map[string]string{"RUST_LOG": "debug"}, want: "debug"},
			{env: map[string]string{"LOG_LEVEL": "warn"}, want: "warn"},
		}},
		{"CONNECTION_TERMINATION_DEADLINE", func(c *config) string { return c.TerminationDeadline.String() }, []step{
			{want: "5s"},
			{env: map[string]string{"TERMINATION_GRACE_PERIOD_SECONDS": "30"}, want: "25s"},
			{env: map[string]string{"CONNECTION_TERMINATION_DEADLINE": "7s"}, want: "7s"},
		}},
		{"CA_PROVIDER", func(c *config) string { return c.CAProvider }, []step{
			{want: ""},
			{env: map[string]string{"FAKE_CA": "true"}, want: "builtin"},
			{env: map[string]string{"CA_PROVIDER": "istio"}, want: "istio"},
		}},
		{"DNS_PROXY_ADDR", func(c *config) string { return c.DNSProxyAddr }, []step{
			{want: "localhost:15053"},
			{mesh: "proxyMetadata: {DNS_PROXY_ADDR: '15054'}", want: "localhost:15054"},
			{env: map[string]string{"ISTIO_META_DNS_PROXY_ADDR": "15055"}, want: "localhost:15055"},
			{env: map[string]string{"DNS_PROXY_ADDR": "127.0.0.1:15056"}, want: "127.0.0.1:15056"},
		}},
		{"DNS_PROXY_ADDR off by DNS_CAPTURE", func(c *config) string { return c.DNSProxyAddr }, []step{
			{want: "localhost:15053"},
			{mesh: "proxyMetadata: {DNS_CAPTURE: 'false'}", want: ""},
			{env: map[string]string{"ISTIO_META_DNS_CAPTURE": "true"}, want: "localhost:15053"},
			{env: map[string]string{"ISTIO_META_DNS_CAPTURE": "false", "DNS_PROXY_ADDR": "127.0.0.1:15056"}, want: "127.0.0.1:15056"},
		}},
		{"SOCKS5_ADDR", func(c *config) string { return c.Socks5Addr }, []step{
			{want: ""},
			{env: map[string]string{"UNSTABLE_ENABLE_SOCKS5": "true"}, want: "127.0.0.1:15080"},
			{env: map[string]string{"SOCKS5_ADDR": "127.0.0.1:1080"}, want: "127.0.0.1:1080"},
		}},
	} {
		t.Run(tc.setting, func(t *testing.T) {
			e := map[string]string{}
			var mesh []string
			for i, s := range tc.steps {
				maps.Copy(e, s.env)
				if s.mesh != "" {
					mesh = append(mesh, "  "+s.mesh)
				}
				path := filepath.Join(t.TempDir(), "mesh")
				if len(mesh) > 0 {
					if err := os.WriteFile(path, []byte("defaultConfig:\n"+strings.Join(mesh, "\n")+"\n"), 0o644); err != nil {
						t.Fatal(err)
					}
				}
				c, err := loadConfigMesh(env(e), environ(e), nil, path)
				if err != nil {
					t.Fatalf("step %d (%v, mesh %q): %v", i, e, mesh, err)
				}
				if got := tc.get(c); got != s.want {
					t.Errorf("step %d (%v, mesh %q): %s = %q; want %q", i, e, mesh, tc.setting, got, s.want)
				}
			}
		})
	}
}
