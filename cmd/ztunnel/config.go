package main

import (
	"crypto/fips140"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/internal/sockopt"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/metrics/otlp"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds"
	"github.com/gozt/gozt/xds/state"
)

// config is every setting of the binary, read once at start from the environment (Istio
// ztunnel's variable names where one exists) and flags. main turns it into each package's
// own Config; no package reads the environment itself.
type config struct {
	AdminAddr, StatsAddr, ReadinessAddr                         string
	OutboundAddr, InboundPlaintextAddr, InboundAddr, Socks5Addr string
	DNSProxyAddr                                                string
	DNSAllFamilies                                              bool

	AccessLog     metrics.AccessLogFilter // ACCESS_LOG_FILTER, ACCESS_LOG_SAMPLE
	AccessLogOTLP otlp.Config             // ACCESS_LOG_OTLP_ENDPOINT and the OTEL_EXPORTER_OTLP_* variables
	DropLabels    []string                // METRICS_DROP_LABELS
	EnableSocks5  bool

	ProxyMode         state.Mode // shared (in-pod) | node | dedicated
	InpodUDS          string
	InpodPortReuse    bool
	IPv6Enabled       bool
	ProxyWorkloadInfo state.WorkloadRef // namespace/name/serviceaccount
	NodeName          string
	Network           string
	ClusterID         string
	ClusterDomain     string
	TrustDomain       string
	PodName           string
	PodNamespace      string
	ServiceAccount    string // with PodName and PodNamespace: ztunnel's own workload (the self-proxy)
	InstanceIP        string

	XDSAddress     string
	XDSRootCA      string
	AltXDSHostname string
	AuthToken      string
	XDSOnDemand    bool
	LocalXDSPath   string

	CAProvider    string
	CAAddress     string
	CARootCA      string
	AltCAHostname string
	CADir         string
	SpiffeSocket  string
	SpireSocket   string // SPIRE_ADMIN_ENDPOINT_SOCKET
	SecretTTL     time.Duration
	Compliance    string // COMPLIANCE_POLICY: "" or pqc

	PoolMaxStreams      int
	PoolUnusedRelease   time.Duration
	StreamWindow        uint32
	ConnWindow          uint32
	FrameSize           uint32
	KernelTLS           bool
	ResetPropagation    bool
	ConnectRetries      int  // ENDPOINT_CONNECT_RETRIES
	EjectionFailures    int  // ENDPOINT_EJECTION_FAILURES (0: off)
	UnhealthyFallback   bool // ENDPOINT_UNHEALTHY_FALLBACK
	TerminationDeadline time.Duration
	PacketMark          uint32
	EnableOrigSrc       string // true | false | "" (best effort)
	KeepaliveEnabled    bool
	KeepaliveTime       time.Duration
	KeepaliveInterval   time.Duration
	KeepaliveRetries    int
	budgets             // HBONE_* per-node budgets (budgets.go)

	LogLevel      string
	LogScopes     map[string]string // level per log scope (access, dns), from RUST_LOG
	LogFormat     string
	WorkerThreads workerThreads
	CPULimit      int // whole cores, from the chart's CPU limit variables; 0 = none given

	chart chartEnv // Istio chart variables, mapped by resolveSources

	XDSHeaders map[string]string // XDS_HEADER_<NAME>
	CAHeaders  map[string]string // CA_HEADER_<NAME>
	ProxyMeta  map[string]string // ISTIO_META_<NAME>

	PreferredServiceNamespace string  // PREFERED_SERVICE_NAMESPACE
	TLS12Enabled              bool    // TLS12_ENABLED
	ResponseBaggage           bool    // ENABLE_RESPONSE_BAGGAGE
	CRLPath                   string  // CRL_PATH
	rust                      rustEnv // the Rust ztunnel's own variables, until resolveSources
	maxHandshakes             int     // hbone.ServerConfig.MaxHandshakes; no variable, set by tests
}

// setting is one row of the configuration table: it drives parsing, --help and
// docs/CONFIGURATION.md (a test checks that file against it, so they cannot drift).
type setting struct {
	env  string
	def  string
	form string // accepted forms, shown in errors and docs
	help string
	set  func(c *config, v string) error
	// unused: accepted so Istio's chart runs gozt unchanged, reported once at start, not
	// acted on.
	unused bool
	// goztOnly: the Rust ztunnel does not read it (its listeners' addresses are fixed; the
	// rest are gozt's own features, or, as INPOD_ENABLED, set by the chart for nobody). The
	// configuration table says so in its "Rust ztunnel" column.
	goztOnly bool
}

// goztOnly marks s as a variable the Rust ztunnel does not read.
func goztOnly(s setting) setting {
	s.goztOnly = true
	return s
}

func settings() []setting {
	return []setting{
		goztOnly(addr("ADMIN_ADDR", "localhost:15000", "admin server: /config_dump, /logging, /quitquitquit, /debug/pprof", func(c *config) *string { return &c.AdminAddr })),
		goztOnly(addr("STATS_ADDR", "[::]:15020", "Prometheus metrics (/metrics, /stats/prometheus)", func(c *config) *string { return &c.StatsAddr })),
		goztOnly(addr("READINESS_ADDR", "[::]:15021", "readiness (/healthz/ready)", func(c *config) *string { return &c.ReadinessAddr })),
		goztOnly(addr("OUTBOUND_ADDR", "[::]:15001", "outbound capture (original destination from SO_ORIGINAL_DST); in shared mode only the port counts for the 15001/15006/15008 listeners, opened in each pod on the wildcard address", func(c *config) *string { return &c.OutboundAddr })),
		goztOnly(addr("INBOUND_PLAINTEXT_ADDR", "[::]:15006", "inbound plaintext capture", func(c *config) *string { return &c.InboundPlaintextAddr })),
		goztOnly(addr("INBOUND_ADDR", "[::]:15008", "inbound HBONE (mTLS HTTP/2 CONNECT); peers always dial port 15008 of a pod IP", func(c *config) *string { return &c.InboundAddr })),
		goztOnly(addr("SOCKS5_ADDR", "127.0.0.1:15080", "SOCKS5 outbound; on when UNSTABLE_ENABLE_SOCKS5=true or this is set", func(c *config) *string { return &c.Socks5Addr })),
		goztOnly(addr("DNS_PROXY_ADDR", "localhost:15053", "DNS proxy (UDP and TCP)", func(c *config) *string { return &c.DNSProxyAddr })),
		goztOnly(boolean("DNS_PROXY_ALL_FAMILIES", "true", "gozt only. The DNS proxy answers a mesh name with addresses of every family the service has, as the Rust ztunnel does; false: only families the asking workload has an address of (an IPv4-only pod gets an empty AAAA answer for a dual-stack service)", func(c *config) *bool { return &c.DNSAllFamilies })),
		boolean("UNSTABLE_ENABLE_SOCKS5", "false", "start the SOCKS5 listener", func(c *config) *bool { return &c.EnableSocks5 }),

		{env: "PROXY_MODE", def: string(state.ModeShared), form: modesForm(), help: "shared: in-pod mode, as in Istio: istio-cni hands over each pod's network namespace on INPOD_UDS and the pod's listeners open inside it; node: every workload on NODE_NAME, captured by node-level redirection into ztunnel's own namespace (hosts without istio-cni); dedicated: the one workload of PROXY_WORKLOAD_INFO", set: func(c *config, v string) (err error) {
			c.ProxyMode, err = state.ParseMode(v)
			return err
		}},
		str("INPOD_UDS", "/var/run/ztunnel/ztunnel.sock", "in-pod mode: the istio-cni node agent's ZDS socket (SOCK_SEQPACKET)", func(c *config) *string { return &c.InpodUDS }),
		boolean("INPOD_PORT_REUSE", "true", "in-pod mode: SO_REUSEPORT on each pod's listeners, so an old and a new ztunnel can serve a pod at once during an upgrade", func(c *config) *bool { return &c.InpodPortReuse }),
		boolean("IPV6_ENABLED", "true", "in-pod mode: pod listeners bind [::] (false: 0.0.0.0); false also drops AAAA answers for mesh services", func(c *config) *bool { return &c.IPv6Enabled }),
		{env: "PROXY_WORKLOAD_INFO", form: "namespace/name/serviceaccount", help: "the workload a dedicated proxy serves (required when PROXY_MODE=dedicated)", set: func(c *config, v string) (err error) {
			c.ProxyWorkloadInfo, err = state.ParseWorkloadRef(v)
			return err
		}},
		str("NODE_NAME", "", "this node's name; in shared and node mode the workloads on it are served (and their certificates prefetched)", func(c *config) *string { return &c.NodeName }),
		str("NETWORK", "", "this node's network; service endpoints on other networks are reached with double HBONE through their network gateway (docs/MULTINETWORK.md)", func(c *config) *string { return &c.Network }),
		str("CLUSTER_ID", istiogrpc.DefaultClusterID, "cluster id sent to the control plane and CA; unset, ISTIO_META_CLUSTER_ID if that is set (the chart sets it)", func(c *config) *string { return &c.ClusterID }),
		str("CLUSTER_DOMAIN", "cluster.local", "Kubernetes cluster DNS domain", func(c *config) *string { return &c.ClusterDomain }),
		str("TRUST_DOMAIN", "cluster.local", "trust domain of ztunnel's own identity", func(c *config) *string { return &c.TrustDomain }),
		str("POD_NAME", "", "ztunnel's pod name (node id; with POD_NAMESPACE and SERVICE_ACCOUNT, its own workload for the self-proxy)", func(c *config) *string { return &c.PodName }),
		str("POD_NAMESPACE", "", "ztunnel's namespace (node id; see POD_NAME)", func(c *config) *string { return &c.PodNamespace }),
		str("INSTANCE_IP", "", "ztunnel's IP (node id)", func(c *config) *string { return &c.InstanceIP }),

		str("XDS_ADDRESS", "", "xDS control plane (https://istiod.istio-system.svc:15012; http:// = plaintext); empty = no control plane", func(c *config) *string { return &c.XDSAddress }),
		str("XDS_ROOT_CA", istiogrpc.DefaultRootCA, "root for the xDS server's certificate: path (re-read at each connection), SYSTEM or inline PEM", func(c *config) *string { return &c.XDSRootCA }),
		str("ALT_XDS_HOSTNAME", "", "extra accepted xDS server name", func(c *config) *string { return &c.AltXDSHostname }),
		str("AUTH_TOKEN", "./var/run/secrets/tokens/istio-token", "bearer token file for xDS and the CA (re-read on every call; ignored if missing)", func(c *config) *string { return &c.AuthToken }),
		boolean("XDS_ON_DEMAND", "false", "ask the control plane for addresses on demand", func(c *config) *bool { return &c.XDSOnDemand }),
		str("LOCAL_XDS_PATH", "", "local YAML config (workloads, services, policies), reloaded on change", func(c *config) *string { return &c.LocalXDSPath }),

		goztOnly(enum("CA_PROVIDER", "", "istio | spiffe | spire | builtin; empty: spire if SPIRE_ADMIN_ENDPOINT_SOCKET is set, spiffe if SPIFFE_ENDPOINT_SOCKET is, builtin if LOCAL_XDS_PATH is set and CA_ADDRESS is not, else istio", []string{"", "istio", "spiffe", "spire", "builtin"}, func(c *config) *string { return &c.CAProvider })),
		str("CA_ADDRESS", "", "Istio CA (IstioCertificateService) address; default https://localhost:15012 for the istio provider", func(c *config) *string { return &c.CAAddress }),
		str("CA_ROOT_CA", istiogrpc.DefaultRootCA, "root for the CA's certificate: path (re-read at each connection), SYSTEM or inline PEM", func(c *config) *string { return &c.CARootCA }),
		str("ALT_CA_HOSTNAME", "", "extra accepted CA server name", func(c *config) *string { return &c.AltCAHostname }),
		goztOnly(str("CA_DIR", "./var/lib/gozt/ca", "built-in CA directory (Istio cacerts layout; a root is generated on first start)", func(c *config) *string { return &c.CADir })),
		goztOnly(str("SPIFFE_ENDPOINT_SOCKET", "", "SPIFFE Workload API socket (unix:///path), for the spiffe provider", func(c *config) *string { return &c.SpiffeSocket })),
		goztOnly(str("SPIRE_ADMIN_ENDPOINT_SOCKET", "", "the SPIRE agent's admin socket (path or unix:///path), for the spire provider: an SVID per workload through SPIRE's Delegated Identity API, subscribed by the selectors SPIRE's k8s workload attestor gives the pod (k8s:ns, k8s:sa, k8s:pod-name, k8s:pod-uid in in-pod mode, k8s:node-name); ztunnel's SPIFFE ID must be in the agent's authorized_delegates (docs/CONFIGURATION.md, SPIRE)", func(c *config) *string { return &c.SpireSocket })),
		duration("SECRET_TTL", "24h", "requested workload certificate lifetime", func(c *config) *time.Duration { return &c.SecretTTL }),
		enum("COMPLIANCE_POLICY", "", "pqc: HBONE key exchange X25519MLKEM768 only, no classical fallback (Istio's post-quantum policy); empty: Go's defaults", []string{"", "pqc"}, func(c *config) *string { return &c.Compliance }),

		integer("POOL_MAX_STREAMS_PER_CONNECTION", "100", "HBONE streams per pooled connection", func(c *config) *int { return &c.PoolMaxStreams }),
		duration("POOL_UNUSED_RELEASE_TIMEOUT", "5m", "an HBONE connection with no streams for this long is closed", func(c *config) *time.Duration { return &c.PoolUnusedRelease }),
		size("HTTP2_STREAM_WINDOW_SIZE", "4Mi", "HTTP/2 stream flow-control window", func(c *config) *uint32 { return &c.StreamWindow }),
		size("HTTP2_CONNECTION_WINDOW_SIZE", "16Mi", "HTTP/2 connection flow-control window", func(c *config) *uint32 { return &c.ConnWindow }),
		size("HTTP2_FRAME_SIZE", "1Mi", "HTTP/2 max frame size", func(c *config) *uint32 { return &c.FrameSize }),
		goztOnly(boolean("KERNEL_TLS", "true", "after the TLS 1.3 handshake, hand HBONE connections' TLS records to the Linux kernel (kernel TLS, tls.ko) and splice DATA payloads, where the kernel offers it; connections it cannot take stay in user space (one INFO line per reason, metric hbone_kernel_tls_connections_total). false: always user space. Off in FIPS 140-3 mode, where true is refused (docs/CONFIGURATION.md, FIPS 140-3)", func(c *config) *bool { return &c.KernelTLS })),
		goztOnly(boolean("ENABLE_RESET_PROPAGATION", "true", "carry a TCP reset as a reset (RFC 9113 §8.5): a peer's RST becomes RST_STREAM(CONNECT_ERROR) and back, and a connection refused after it was accepted (no route, dial failure, policy) gets a RST. false: a FIN in each case, as the Rust ztunnel does", func(c *config) *bool { return &c.ResetPropagation })),
		goztOnly(count("ENDPOINT_CONNECT_RETRIES", "2", "gozt only. An outbound connection to a service whose endpoint fails before any byte has moved (dial, TLS, a 5xx CONNECT answer such as the backend refusing) is tried on up to this many other endpoints, all within the connect's one dial timeout (10s), of which an attempt that can still be retried gets an equal share (an endpoint that never answers leaves time to try another), and after an attempt that got no answer, on endpoints of other nodes first; never once bytes have flowed, nor after a failure of the node's own (its certificate, its file descriptors). Retries in flight to a service are held to 20% of the connects in flight to it, at least 3 (Envoy's retry budget). 0: fail at once, as the Rust ztunnel does (metrics outbound_connect_retries_total, outbound_connect_retries_over_budget_total)", func(c *config) *int { return &c.ConnectRetries })),
		goztOnly(count("ENDPOINT_EJECTION_FAILURES", "3", "gozt only. A service endpoint (a workload and port) this many outbound connects in a row failed on is picked only when no other is left, for 5s, doubling with each ejection in a row up to 2m; its next success on that port ends it. Only failures the endpoint caused count, not the node's own (passive outlier detection; metric outbound_endpoint_ejections_total, ejected endpoints in /config_dump). 0: off, as the Rust ztunnel", func(c *config) *int { return &c.EjectionFailures })),
		goztOnly(boolean("ENDPOINT_UNHEALTHY_FALLBACK", "false", "gozt only. true: a service with no healthy endpoint left uses its unhealthy ones, which are its not-ready and terminating pods (istiod marks both UNHEALTHY), where Kubernetes sends only to terminating pods that still pass readiness; false: the connection fails, as in the Rust ztunnel", func(c *config) *bool { return &c.UnhealthyFallback })),
		duration("CONNECTION_TERMINATION_DEADLINE", "5s", "on shutdown, how long live connections may finish before they are closed", func(c *config) *time.Duration { return &c.TerminationDeadline }),
		{env: "PACKET_MARK", def: "1337", form: "integer", help: "SO_MARK on every dialed socket so redirection rules skip it (0 = none)", set: func(c *config, v string) error {
			n, err := strconv.ParseUint(v, 0, 32)
			c.PacketMark = uint32(n)
			return err
		}},
		enum("ENABLE_ORIG_SRC", "", "true: inbound dials keep the client's source IP (IP_TRANSPARENT; needs CAP_NET_ADMIN and istio-cni-style routing for remote clients). Empty or false: the node's address (unlike Rust ztunnel, empty does not try, since spoofing without that routing breaks replies)", []string{"", "true", "false"}, func(c *config) *string { return &c.EnableOrigSrc }),
		boolean("KEEPALIVE_ENABLED", "true", "TCP keepalive on proxied sockets", func(c *config) *bool { return &c.KeepaliveEnabled }),
		duration("KEEPALIVE_TIME", "180s", "TCP keepalive idle time", func(c *config) *time.Duration { return &c.KeepaliveTime }),
		duration("KEEPALIVE_INTERVAL", "180s", "TCP keepalive probe interval", func(c *config) *time.Duration { return &c.KeepaliveInterval }),
		integer("KEEPALIVE_RETRIES", "9", "TCP keepalive probes before the connection is dropped", func(c *config) *int { return &c.KeepaliveRetries }),

		goztOnly(enum("LOG_LEVEL", "info", "log level (also settable at run time: POST /logging?level=)", []string{"debug", "info", "warn", "error"}, func(c *config) *string { return &c.LogLevel })),
		enum("LOG_FORMAT", "plain", "log format", []string{"plain", "json"}, func(c *config) *string { return &c.LogFormat }),
		goztOnly(enum("ACCESS_LOG_FILTER", "", "gozt only. Which connections get an access-log record: empty every one (and \"connection opened\" at debug), failed (an error or a response flag), denied (response flag DENY)", []string{"", "failed", "denied"}, func(c *config) *string { return &c.AccessLog.Only })),
		{env: "ACCESS_LOG_OTLP_ENDPOINT", goztOnly: true, form: "http://host:port or https://host:port", help: "gozt only. Also export the access log (INFO and up, after ACCESS_LOG_FILTER and ACCESS_LOG_SAMPLE) over OpenTelemetry OTLP/gRPC to this collector: the same fields as log attributes, resource service.name=ztunnel and the node and pod; the standard OTEL_EXPORTER_OTLP_* variables (and _LOGS_ ones) set headers, timeout, certificates and compression", set: func(c *config, v string) error {
			if c.AccessLogOTLP.Endpoint = v; v == "" {
				return nil // off
			}
			return otlp.CheckEndpoint(v)
		}},
		{env: "ACCESS_LOG_SAMPLE", goztOnly: true, def: "1", form: "a fraction from 0 to 1", help: "gozt only. The fraction of successful connections that get an access-log record (failed ones always do): 1 every one, 0 none, as a sampling ratio reads; below 1, no \"connection opened\" records", set: func(c *config, v string) error {
			f, err := strconv.ParseFloat(v, 64)
			if err == nil && !(f >= 0 && f <= 1) {
				err = errors.New("not a fraction from 0 to 1")
			}
			c.AccessLog.SkipSuccesses = 1 - f
			return err
		}},
		{env: "METRICS_DROP_LABELS", goztOnly: true, form: "comma-separated istio_tcp_* label names", help: "gozt only. Labels left out of every istio_tcp_* family, so a big mesh's series stay bounded (connections that differ only in them share a series); the access log keeps every field. Not reporter or response_flags", set: func(c *config, v string) error {
			c.DropLabels = nil
			for _, n := range strings.Split(v, ",") {
				if n = strings.TrimSpace(n); n != "" {
					c.DropLabels = append(c.DropLabels, n)
				}
			}
			return metrics.CheckDroppedLabels(c.DropLabels)
		}},
		{env: "ZTUNNEL_WORKER_THREADS", form: "N, N% of the cores, 0 for every core, or empty", help: "threads running Go code at once (GOMAXPROCS); empty: the container's CPU limit or GOMAXPROCS if set, else a quarter of the cores, at least 2", set: func(c *config, v string) (err error) {
			c.WorkerThreads, err = parseWorkerThreads(v)
			return err
		}},
	}
}

// allSettings is every variable gozt reads: its own, then the chart's.
func allSettings() []setting {
	return append(append(append(settings(), budgetSettings()...), chartSettings()...), rustSettings()...)
}

// prefixed are the variable families collected by prefix.
var prefixed = []struct {
	prefix, help string
	field        func(c *config) *map[string]string
}{
	{"XDS_HEADER_", "extra gRPC metadata sent to the xDS server (XDS_HEADER_X_FOO=v sends x-foo: v)", func(c *config) *map[string]string { return &c.XDSHeaders }},
	{"CA_HEADER_", "extra gRPC metadata sent to the CA", func(c *config) *map[string]string { return &c.CAHeaders }},
	{"ISTIO_META_", "proxy metadata sent in the xDS node metadata", func(c *config) *map[string]string { return &c.ProxyMeta }},
	{"ISTIO_METAJSON_", "JSON proxy metadata; not used: reported at start (gozt sends ISTIO_META_* only)", func(c *config) *map[string]string { return &c.rust.metaJSON }},
}

// loadConfig reads the environment (getenv) and then args (flags named after each variable,
// lowercase with dashes: --admin-addr). It returns an error naming the variable at fault.
func loadConfig(getenv func(string) (string, bool), environ []string, args []string) (*config, error) {
	return loadConfigMesh(getenv, environ, args, meshConfigPath)
}

// loadConfigMesh is loadConfig with the mesh config file at meshPath.
func loadConfigMesh(getenv func(string) (string, bool), environ []string, args []string, meshPath string) (*config, error) {
	c := &config{}
	values := map[string]string{}
	explicit := map[string]bool{}
	table := allSettings()
	for _, s := range table {
		values[s.env] = s.def
		if v, ok := getenv(s.env); ok {
			values[s.env], explicit[s.env] = v, true
		}
	}
	fs := flag.NewFlagSet("ztunnel", flag.ContinueOnError)
	fs.SetOutput(new(strings.Builder))
	for _, s := range table {
		name := s.env
		fs.Func(flagName(name), s.help, func(v string) error { values[name], explicit[name] = v, true; return nil })
	}
	if err := fs.Parse(args); err != nil {
		return nil, fmt.Errorf("config: %w (see ztunnel --help)", err)
	}
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("config: unexpected argument %q (see ztunnel --help)", fs.Arg(0))
	}
	for _, s := range table {
		v := strings.TrimSpace(values[s.env])
		if err := s.set(c, v); err != nil {
			return nil, fmt.Errorf("config: %s=%q: %v; accepted: %s", s.env, v, err, s.form)
		}
	}
	if c.AccessLogOTLP.Endpoint != "" {
		if err := c.AccessLogOTLP.Env(func(k string) string { v, _ := getenv(k); return v }); err != nil {
			return nil, fmt.Errorf("config: ACCESS_LOG_OTLP_ENDPOINT is set, and %w", err)
		}
	}
	for _, p := range prefixed {
		m := map[string]string{}
		for _, kv := range environ {
			k, v, _ := strings.Cut(kv, "=")
			if name, ok := strings.CutPrefix(k, p.prefix); ok && name != "" {
				m[name] = v
			}
		}
		*p.field(c) = m
	}
	for _, s := range table {
		if s.unused && explicit[s.env] {
			c.chart.unused = append(c.chart.unused, s.env+": "+s.help)
		}
	}
	if err := resolveSources(c, explicit, meshPath); err != nil {
		return nil, err
	}
	if err := fipsKernelTLS(c, explicit, fips140.Enabled()); err != nil {
		return nil, err
	}
	if c.local().Dedicated() && c.ProxyWorkloadInfo.IsZero() {
		return nil, errors.New("config: PROXY_WORKLOAD_INFO is required when PROXY_MODE=dedicated; accepted: namespace/name/serviceaccount")
	}
	return c, nil
}

// local is what this ztunnel serves, from PROXY_MODE, NODE_NAME, NETWORK and
// PROXY_WORKLOAD_INFO. NODE_NAME does not restrict a dedicated ztunnel; in shared mode it
// is the node whose pods are served, each by a proxy of Local.Pod.
func (c *config) local() state.Local {
	l := state.Local{Mode: c.ProxyMode, Node: c.NodeName, Network: c.Network, Workload: c.ProxyWorkloadInfo}
	if l.Dedicated() {
		l.Node = ""
	}
	return l
}

// modesForm is PROXY_MODE's accepted forms.
func modesForm() string {
	var s []string
	for _, m := range state.Modes {
		s = append(s, string(m))
	}
	return strings.Join(s, ", ")
}

func flagName(env string) string { return strings.ToLower(strings.ReplaceAll(env, "_", "-")) }

func str(env, def, help string, f func(*config) *string) setting {
	return setting{env: env, def: def, form: "any string", help: help, set: func(c *config, v string) error { *f(c) = v; return nil }}
}

// addr accepts host:port, or "off" to disable the listener.
func addr(env, def, help string, f func(*config) *string) setting {
	return setting{env: env, def: def, form: "host:port, [v6]:port, or off", help: help, set: func(c *config, v string) error {
		if v == "off" || v == "" {
			*f(c) = ""
			return nil
		}
		_, port, err := net.SplitHostPort(v)
		if err != nil {
			return err
		}
		if n, err := strconv.ParseUint(port, 10, 16); err != nil || (n == 0 && port != "0") {
			return fmt.Errorf("bad port %q", port)
		}
		*f(c) = v
		return nil
	}}
}

func boolean(env, def, help string, f func(*config) *bool) setting {
	return setting{env: env, def: def, form: "true or false", help: help, set: func(c *config, v string) error {
		b, err := strconv.ParseBool(v)
		*f(c) = b
		return err
	}}
}

func integer(env, def, help string, f func(*config) *int) setting {
	return setting{env: env, def: def, form: "a positive integer", help: help, set: func(c *config, v string) error {
		n, err := strconv.Atoi(v)
		if err == nil && n <= 0 {
			err = errors.New("must be positive")
		}
		*f(c) = n
		return err
	}}
}

// count is an integer setting where 0 turns a feature off.
func count(env, def, help string, f func(*config) *int) setting {
	return setting{env: env, def: def, form: "0 or a positive integer", help: help, set: func(c *config, v string) error {
		n, err := strconv.Atoi(v)
		if err == nil && (n < 0 || n > 1<<20) {
			err = errors.New("out of range")
		}
		*f(c) = n
		return err
	}}
}

func duration(env, def, help string, f func(*config) *time.Duration) setting {
	return setting{env: env, def: def, form: "a Go duration such as 5s, 10m, 24h", help: help, set: func(c *config, v string) error {
		d, err := time.ParseDuration(v)
		if err == nil && d <= 0 {
			err = errors.New("must be positive")
		}
		*f(c) = d
		return err
	}}
}

// size accepts bytes with an optional Ki/Mi suffix, as Kubernetes quantities write them.
func size(env, def, help string, f func(*config) *uint32) setting {
	return setting{env: env, def: def, form: "bytes, optionally with Ki or Mi (e.g. 4Mi), at most 2^31-1", help: help, set: func(c *config, v string) error {
		mult := uint64(1)
		num := v
		if n, ok := strings.CutSuffix(v, "Mi"); ok {
			num, mult = n, 1<<20
		} else if n, ok := strings.CutSuffix(v, "Ki"); ok {
			num, mult = n, 1<<10
		}
		n, err := strconv.ParseUint(num, 10, 32)
		if err != nil {
			return err
		}
		if n*mult == 0 || n*mult > 1<<31-1 {
			return errors.New("out of range")
		}
		*f(c) = uint32(n * mult)
		return nil
	}}
}

func enum(env, def, help string, allowed []string, f func(*config) *string) setting {
	var shown []string
	for _, a := range allowed {
		if a == "" {
			a = `"" (unset)`
		}
		shown = append(shown, a)
	}
	return setting{env: env, def: def, form: strings.Join(shown, ", "), help: help, set: func(c *config, v string) error {
		for _, a := range allowed {
			if v == a {
				*f(c) = v
				return nil
			}
		}
		return errors.New("unknown value")
	}}
}

// usage is the --help text: every setting with its default and accepted forms.
func usage() string {
	var b strings.Builder
	b.WriteString(`ztunnel: the per-node L4 secure tunnel proxy of an ambient mesh (gozt).

Usage:
  ztunnel [--flag=value ...]   run the proxy
  ztunnel proxy ztunnel [...]  the same: the command line Istio's ztunnel chart uses
  ztunnel version              print the version
  ztunnel --help               this text

Every setting is an environment variable (Istio ztunnel's names where one exists) or the
flag of the same name in lowercase with dashes (--admin-addr); a flag wins over the
environment. Listener addresses accept "off".

The proxy re-executes itself with schedtrace=2147483647 added to GODEBUG, which keeps the Go
runtime's sysmon thread polling instead of being woken by nearly every message; a schedtrace
already in GODEBUG is kept (GODEBUG=schedtrace=0 turns this off).

`)
	for _, s := range allSettings() {
		def := s.def
		if def == "" {
			def = `""`
		}
		fmt.Fprintf(&b, "  %s (--%s)\n      %s\n      default %s; accepted: %s\n", s.env, flagName(s.env), s.help, def, s.form)
	}
	for _, p := range prefixed {
		fmt.Fprintf(&b, "  %s<NAME>\n      %s\n", p.prefix, p.help)
	}
	return b.String()
}

// markdownTable is docs/CONFIGURATION.md's configuration table.
func markdownTable() string {
	var b strings.Builder
	b.WriteString("| variable | default | Rust ztunnel | meaning |\n| --- | --- | --- | --- |\n")
	for _, s := range allSettings() {
		def := "`" + s.def + "`"
		if s.def == "" {
			def = "–"
		}
		rs := "reads it"
		if s.goztOnly {
			rs = "–"
		}
		fmt.Fprintf(&b, "| `%s` | %s | %s | %s |\n", s.env, def, rs, strings.ReplaceAll(s.help, "|", `\|`))
	}
	for _, p := range prefixed { // every family is the Rust ztunnel's
		fmt.Fprintf(&b, "| `%s<NAME>` | – | reads it | %s |\n", p.prefix, p.help)
	}
	return b.String()
}

func osGetenv(k string) (string, bool) { return os.LookupEnv(k) }

// Translation: the settings into each package's own Config.

// proxyListenerEnv maps proxy listener names to their settings.
var proxyListenerEnv = map[string]string{
	proxy.ListenerOutbound:         "OUTBOUND_ADDR",
	proxy.ListenerInboundPlaintext: "INBOUND_PLAINTEXT_ADDR",
	proxy.ListenerInbound:          "INBOUND_ADDR",
	proxy.ListenerSocks5:           "SOCKS5_ADDR",
}

func (c *config) enableProxy() bool {
	return c.OutboundAddr != "" || c.InboundPlaintextAddr != "" || c.InboundAddr != "" || c.Socks5Addr != ""
}

// proxyConfig is the whole configuration of one proxy serving local and logging to log,
// hbone's included, each field decided here: the settings; hbone's hooks counting into the
// node's metrics (proxy.HBONEEvents); the network gateways, which relay other clients'
// connections, exempt from the per-source budgets (a few clients' failures must not shut
// out every other); the node's endpoint health, shared by its proxies. Its sockets: a
// pod's proxy opens and dials every one through sockets, inside the pod's network
// namespace and marked there (internal/netns); any other proxy through the process's own,
// each dial marked with PACKET_MARK.
func (n *ztunnel) proxyConfig(local state.Local, log *slog.Logger, sockets proxy.Sockets) proxy.Config {
	c := n.cfg
	events := proxy.NewHBONEEvents(n.metrics, log)
	conn := hbone.Config{
		StreamWindow:     c.StreamWindow,
		ConnWindow:       c.ConnWindow,
		MaxFrameSize:     c.FrameSize,
		DisableKernelTLS: !c.KernelTLS,
		OnDrop:           events.OnDrop,
		OnTLS:            events.OnTLS,
		OnKernelTLSEnd:   events.OnKernelTLSEnd,
		OnKeyLimit:       events.OnKeyLimit,
	}
	pcfg := proxy.Config{
		Local:                local,
		Logger:               log,
		OutboundAddr:         c.OutboundAddr,
		InboundPlaintextAddr: c.InboundPlaintextAddr,
		InboundAddr:          c.InboundAddr,
		Socks5Addr:           c.Socks5Addr,
		HBONEClient: hbone.ClientConfig{
			Config:            conn,
			MaxStreamsPerConn: c.PoolMaxStreams,
			IdleTimeout:       c.PoolUnusedRelease,
		},
		HBONEServer: hbone.ServerConfig{
			Config:        conn,
			MaxHandshakes: c.maxHandshakes,
			Admission: hbone.AdmissionConfig{
				HandshakeWorkers:       c.HandshakeWorkers,
				SourceHandshakes:       c.SourceHandshakes,
				SourceHandshakeRate:    c.SourceHandshakeRate,
				SourceFailedHandshakes: c.SourceFailedHandshakes,
				PeerConnRate:           c.PeerConnRate,
				PeerStreams:            c.PeerStreams,
				PeerDials:              c.PeerDials,
				StreamStarts:           c.StreamStarts,
				SourceRelays:           func(ip netip.Addr) bool { return n.store.IsNetworkGateway(local.Network, ip) },
			},
		},
		OrigSrc:           c.EnableOrigSrc == "true",
		KeepaliveDisabled: !c.KeepaliveEnabled,
		KeepaliveTime:     c.KeepaliveTime,
		KeepaliveInterval: c.KeepaliveInterval,
		KeepaliveRetries:  c.KeepaliveRetries,
		UserTimeout:       c.userTimeout(),
		HandshakeFailure:  certs.HandshakeFailure,
		Outliers:          n.outliers,
		RetryBudget:       n.retries,
		Poller:            n.poller,

		DisableResetPropagation: !c.ResetPropagation,
		DisableBaggage:          !c.ResponseBaggage,
		ConnectRetries:          c.ConnectRetries,
	}
	if sockets != nil {
		pcfg.Sockets, pcfg.HBONEClient.Dial = sockets, sockets.Dial
	} else if c.PacketMark != 0 {
		pcfg.PacketMark, pcfg.HBONEClient.Control = c.PacketMark, sockopt.Control(c.PacketMark)
	}
	return pcfg
}

// userTimeout is TCP_USER_TIMEOUT when USER_TIMEOUT_ENABLED is true: as the Rust ztunnel
// sets it, the time keepalive takes to give up (time + retries × interval).
func (c *config) userTimeout() time.Duration {
	if !c.rust.userTimeout {
		return 0
	}
	return c.KeepaliveTime + time.Duration(c.KeepaliveRetries)*c.KeepaliveInterval
}

func caConfig(c *config) ca.Config {
	return ca.Config{
		Provider:     c.CAProvider,
		Config:       c.endpoint(c.CAAddress, c.CARootCA, c.AltCAHostname, c.CAHeaders),
		SecretTTL:    c.SecretTTL,
		Impersonate:  !c.local().Dedicated(), // one ztunnel, many workload identities
		Dir:          c.CADir,
		SpiffeSocket: c.SpiffeSocket,
		SpireSocket:  c.SpireSocket,
		LocalXDS:     c.LocalXDSPath != "",
	}
}

func xdsConfig(c *config) xds.Config {
	meta := map[string]string{
		"NAME":         c.PodName,
		"NAMESPACE":    c.PodNamespace,
		"INSTANCE_IPS": c.InstanceIP,
		"NODE_NAME":    c.NodeName,
		"CLUSTER_ID":   c.ClusterID,
	}
	for k, v := range c.ProxyMeta {
		meta[k] = v
	}
	ip := c.InstanceIP
	if ip == "" {
		ip = "1.1.1.1"
	}
	return xds.Config{
		Config:   c.endpoint(c.XDSAddress, c.XDSRootCA, c.AltXDSHostname, c.XDSHeaders),
		NodeID:   fmt.Sprintf("ztunnel~%s~%s.%s~%s.svc.cluster.local", ip, c.PodName, c.PodNamespace, c.PodNamespace),
		Metadata: meta,
		OnDemand: c.XDSOnDemand,
	}
}

// endpoint is an Istio gRPC endpoint (xDS or CA) of the node's: its own address, root, alt
// hostname and headers, the token and cluster id both share.
func (c *config) endpoint(addr, rootCA, altHostname string, headers map[string]string) istiogrpc.Config {
	return istiogrpc.Config{
		Address:     addr,
		RootCA:      rootCA,
		AltHostname: altHostname,
		TokenFile:   c.AuthToken,
		ClusterID:   c.ClusterID,
		Headers:     headerNames(headers),
	}
}

// headerNames turns XDS_HEADER_X_FOO style suffixes into header names (x-foo).
func headerNames(m map[string]string) map[string]string {
	out := make(map[string]string, len(m))
	for k, v := range m {
		out[strings.ToLower(strings.ReplaceAll(k, "_", "-"))] = v
	}
	return out
}
