package main

import (
	"errors"
	"strconv"
	"strings"
)

// rustSettings are the variables the Rust ztunnel reads (its src/config.rs and lib.rs) that
// have no gozt setting of the same name elsewhere in the table: each is implemented here with
// the Rust meaning, accepted and reported once at start as not used (with why), or refused
// at start with an error naming it, never silently different. cmd/ztunnel's
// TestRustVariables holds the Rust ztunnel's list against the table.
func rustSettings() []setting {
	return []setting{
		boolean("FAKE_CA", "false", "the Rust ztunnel's self-signed CA for local runs: true means CA_PROVIDER=builtin when CA_PROVIDER is unset", func(c *config) *bool { return &c.rust.fakeCA }),
		str("PREFERED_SERVICE_NAMESPACE", "", "when several services share a VIP or hostname, the one in this namespace wins (the Rust ztunnel's spelling)", func(c *config) *string { return &c.PreferredServiceNamespace }),
		str("ISTIO_META_DNS_CAPTURE", "", "false turns the DNS proxy off (DNS_PROXY_ADDR=off) unless DNS_PROXY_ADDR is set; the Rust ztunnel reads it from the proxy metadata", func(c *config) *string { return &c.rust.dnsCapture }),
		str("ISTIO_META_DNS_PROXY_ADDR", "", "the DNS proxy's address when DNS_PROXY_ADDR is unset (a port alone means localhost:PORT)", func(c *config) *string { return &c.rust.dnsProxyAddr }),
		str("ISTIO_META_CLUSTER_ID", "", "the cluster id when CLUSTER_ID is unset (the chart sets it)", func(c *config) *string { return new(string) }),
		only("ENABLE_PROXY", "true", "the Rust ztunnel's switch to run only DNS and admin", "true", "gozt always runs the proxy"),
		boolean("TLS12_ENABLED", "false", "accept TLS 1.2 (ECDHE with AES-GCM, the Rust ztunnel's suites) beside 1.3 on HBONE, for peers limited to it (FIPS); between two ztunnels 1.3 is still chosen, and a 1.2 connection keeps its records in user space (no kernel TLS)", func(c *config) *bool { return &c.TLS12Enabled }),
		only("LOCALHOST_APP_TUNNEL", "true", "send application-tunnel traffic to the pod over localhost", "true", "gozt always dials an application tunnel on 127.0.0.1, the Rust default"),
		str("CRL_PATH", "", "the peer CA's certificate revocation list (the chart's peerCaCrl): PEM X509 CRL blocks or one DER list; HBONE peers whose chain it revokes are refused; re-read when it changes (polled every 2 s), and live HBONE connections whose peer it now revokes are closed, each logged with the peer and the serial; missing or empty revokes nothing; malformed refuses to start, and on a reload keeps the lists before, logged once as an error and shown in /config_dump crl.refused; a list past its nextUpdate stays in force, reported. /config_dump `crl` and the crl_* gauges show each list", func(c *config) *string { return &c.CRLPath }),
		refusedIfSet("LOCAL_XDS", "the local config inline", "inline config is not supported: write it to a file and set LOCAL_XDS_PATH"),
		str("PROXY_CONFIG", "", "Istio's ProxyConfig in YAML or JSON, over the mesh config file's defaultConfig (./etc/istio/config/mesh from the working directory, read if present), field by field as the Rust ztunnel reads them: proxyMetadata (xDS node metadata, ISTIO_META_ prefix dropped; DNS_CAPTURE and DNS_PROXY_ADDR act as ISTIO_META_*), discoveryAddress (XDS_ADDRESS), proxyAdminPort (ADMIN_ADDR's port), statsPort (STATS_ADDR's port), concurrency (ZTUNNEL_WORKER_THREADS); each variable wins over its field; other fields are ignored; a file or value that does not parse stops the start", func(c *config) *string { return &c.rust.proxyConfig }),
		boolean("ENABLE_RESPONSE_BAGGAGE", "true", "inbound HBONE answers a CONNECT with baggage describing the destination workload, and labels a client the cache does not know from the client's baggage; false: neither. Outbound reads the baggage a destination behind a network gateway answers with (double HBONE) into the destination labels and access log either way, as the Rust ztunnel does", func(c *config) *bool { return &c.ResponseBaggage }),
		chartOnly("AUTHZ_POLICY_INFO_LOGGING", "policy decisions at info level; not used: gozt logs a denial in the access record at error level"),
		boolean("USER_TIMEOUT_ENABLED", "false", "TCP_USER_TIMEOUT on proxied sockets, KEEPALIVE_TIME + KEEPALIVE_RETRIES × KEEPALIVE_INTERVAL: unacknowledged data drops a connection as soon as keepalive would", func(c *config) *bool { return &c.rust.userTimeout }),
		chartOnly("KUBERNETES_SERVICE_HOST", "set in every pod; not used: gozt's defaults do not depend on running in Kubernetes"),
		chartOnly("ISTIO_META_ISTIO_VERSION", "Istio's version, which the Rust ztunnel reports in /config_dump; not used: gozt reports its own build"),
	}
}

// rustEnv holds the raw Rust-only variables until resolveSources maps them.
type rustEnv struct {
	fakeCA, userTimeout      bool
	dnsCapture, dnsProxyAddr string
	proxyConfig              string            // PROXY_CONFIG
	metaJSON                 map[string]string // ISTIO_METAJSON_<NAME>
}

// only accepts one value, the one gozt implements, and refuses any other with why.
func only(env, def, help, want, why string) setting {
	return setting{env: env, def: def, form: want, help: help + "; only " + want + ": " + why, set: func(_ *config, v string) error {
		if v == "" || strings.EqualFold(v, want) {
			return nil
		}
		if b, err := strconv.ParseBool(v); err == nil && strconv.FormatBool(b) == want {
			return nil
		}
		return errors.New(why)
	}}
}

// refusedIfSet refuses any non-empty value with why.
func refusedIfSet(env, help, why string) setting {
	return setting{env: env, form: "unset", help: help + "; refused when set: " + why, set: func(_ *config, v string) error {
		if v != "" {
			return errors.New(why)
		}
		return nil
	}}
}
