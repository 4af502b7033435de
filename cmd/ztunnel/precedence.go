package main

import (
	"fmt"
	"strconv"
	"strings"
)

// resolveSources decides, in this one function, every setting more than one source can
// give: the variable itself (environment or flag), Istio's chart variables, the mesh config
// file's defaultConfig and PROXY_CONFIG over it (readProxyConfig), and the Rust ztunnel's
// own names. The variable itself always wins when it is set; then, first to give it wins:
//
//	setting                          after the variable itself
//	CLUSTER_ID                       ISTIO_META_CLUSTER_ID
//	LOG_LEVEL (and its scopes)       RUST_LOG
//	CONNECTION_TERMINATION_DEADLINE  TERMINATION_GRACE_PERIOD_SECONDS (drainDeadline)
//	(the CPU limit; no variable)     the lower of ZTUNNEL_CPU_LIMIT, ZTUNNEL_RESOURCE_CPU_LIMIT
//	ISTIO_META_<NAME>                proxyMetadata: PROXY_CONFIG's, the mesh config's
//	XDS_ADDRESS                      discoveryAddress: PROXY_CONFIG's, the mesh config's
//	ADMIN_ADDR, STATS_ADDR (port)    proxyAdminPort, statsPort: PROXY_CONFIG's, the mesh config's
//	ZTUNNEL_WORKER_THREADS           concurrency: PROXY_CONFIG's, the mesh config's
//	CA_PROVIDER                      FAKE_CA=true (builtin)
//	DNS_PROXY_ADDR                   ISTIO_META_DNS_PROXY_ADDR, then proxyMetadata's
//	                                 DNS_PROXY_ADDR; then ISTIO_META_DNS_CAPTURE=false (or
//	                                 proxyMetadata's DNS_CAPTURE) turns the DNS proxy off
//	SOCKS5_ADDR                      off unless UNSTABLE_ENABLE_SOCKS5=true
//
// and last the default. The Rust ztunnel decides the same way (construct_config); where
// it would exit on a bad value of a source that lost, this does too.
func resolveSources(c *config, explicit map[string]bool, meshPath string) error {
	// Istio's chart variables.
	if id := c.ProxyMeta["CLUSTER_ID"]; id != "" && !explicit["CLUSTER_ID"] {
		c.ClusterID = id
	}
	if v := c.chart.rustLog; v != "" && !explicit["LOG_LEVEL"] {
		level, scopes, ignored, err := parseRustLog(v)
		if err != nil {
			return fmt.Errorf("config: RUST_LOG=%q: %v; accepted: a level (trace, debug, info, warn, error, off) and target=level pairs", v, err)
		}
		c.LogLevel, c.LogScopes = level, scopes
		for _, t := range ignored {
			c.chart.unused = append(c.chart.unused, "RUST_LOG target "+t+" (no such gozt log scope)")
		}
	}
	if v := c.chart.gracePeriod; v != "" {
		secs, err := strconv.ParseUint(v, 10, 32)
		if err != nil {
			return fmt.Errorf("config: TERMINATION_GRACE_PERIOD_SECONDS=%q: %v; accepted: whole seconds", v, err)
		}
		if !explicit["CONNECTION_TERMINATION_DEADLINE"] {
			c.TerminationDeadline = drainDeadline(secs)
		}
	}
	for _, lim := range []struct{ env, v string }{{"ZTUNNEL_CPU_LIMIT", c.chart.cpuLimit}, {"ZTUNNEL_RESOURCE_CPU_LIMIT", c.chart.resourceCPULimit}} {
		if lim.v == "" {
			continue
		}
		n, err := cpuCores(lim.v)
		if err != nil {
			return fmt.Errorf("config: %s=%q: %v; accepted: a CPU quantity such as 2 or 500m", lim.env, lim.v, err)
		}
		if c.CPULimit == 0 || n < c.CPULimit {
			c.CPULimit = n
		}
	}

	// The mesh config file and PROXY_CONFIG. proxyMetadata joins the xDS node metadata
	// (its keys without ISTIO_META_) and, like ISTIO_META_*, can set DNS_CAPTURE and
	// DNS_PROXY_ADDR; discoveryAddress is the control plane; proxyAdminPort and statsPort
	// move the admin and stats listeners (their host stays); concurrency sizes the worker
	// threads as ZTUNNEL_WORKER_THREADS does (0: every core).
	pc, err := readProxyConfig(meshPath, c.rust.proxyConfig)
	if err != nil {
		return err
	}
	// Unprefixed keys first, so a source holding both FOO and ISTIO_META_FOO gives FOO's
	// value every time, not whichever the map yields first.
	for _, prefixed := range []bool{false, true} {
		for k, v := range pc.ProxyMetadata {
			name, cut := strings.CutPrefix(k, "ISTIO_META_")
			if _, set := c.ProxyMeta[name]; cut == prefixed && !set {
				c.ProxyMeta[name] = v
			}
		}
	}
	if v, ok := c.ProxyMeta["DNS_CAPTURE"]; ok && !explicit["ISTIO_META_DNS_CAPTURE"] {
		c.rust.dnsCapture = v
	}
	if v, ok := c.ProxyMeta["DNS_PROXY_ADDR"]; ok && !explicit["ISTIO_META_DNS_PROXY_ADDR"] {
		c.rust.dnsProxyAddr = v
	}
	if a := pc.DiscoveryAddress; a != nil && *a != "" && !explicit["XDS_ADDRESS"] {
		c.XDSAddress = *a
	}
	if p := pc.ProxyAdminPort; p != nil && !explicit["ADMIN_ADDR"] {
		c.AdminAddr = withPort(c.AdminAddr, *p)
	}
	if p := pc.StatsPort; p != nil && !explicit["STATS_ADDR"] {
		c.StatsAddr = withPort(c.StatsAddr, *p)
	}
	if n := pc.Concurrency; n != nil && !explicit["ZTUNNEL_WORKER_THREADS"] {
		c.WorkerThreads = workerThreads{set: true, n: int(*n)}
	}

	// The Rust ztunnel's own names.
	for name := range c.rust.metaJSON {
		c.chart.unused = append(c.chart.unused, "ISTIO_METAJSON_"+name+": JSON proxy metadata; not used (gozt sends ISTIO_META_* only)")
	}
	if c.rust.fakeCA && !explicit["CA_PROVIDER"] {
		c.CAProvider = "builtin"
	}
	if !explicit["DNS_PROXY_ADDR"] {
		if v := c.rust.dnsProxyAddr; v != "" {
			if _, err := strconv.ParseUint(v, 10, 16); err == nil {
				v = "localhost:" + v
			}
			// Parsed as DNS_PROXY_ADDR is, into its field.
			dns := addr("ISTIO_META_DNS_PROXY_ADDR", "", "", func(c *config) *string { return &c.DNSProxyAddr })
			if err := dns.set(c, v); err != nil {
				return fmt.Errorf("config: ISTIO_META_DNS_PROXY_ADDR=%q: %v; accepted: a port, or %s", c.rust.dnsProxyAddr, err, dns.form)
			}
		}
		if v := c.rust.dnsCapture; v != "" {
			on, err := strconv.ParseBool(v)
			if err != nil {
				return fmt.Errorf("config: ISTIO_META_DNS_CAPTURE=%q: %v; accepted: true or false", v, err)
			}
			if !on {
				c.DNSProxyAddr = ""
			}
		}
	}

	if !c.EnableSocks5 && !explicit["SOCKS5_ADDR"] {
		c.Socks5Addr = "" // SOCKS5 is opt-in
	}
	return nil
}
