// Package metrics owns ztunnel's Prometheus metric families (Istio's standard TCP metrics), the
// once-per-connection result recorder that feeds them and writes the access log, and the
// /metrics and /stats/prometheus handler.
//
// The registry is always injected, never global. Counters for a connection are resolved once
// when it opens and recorded once when it closes; nothing here runs per read or write. The
// package does not decide label values: the proxy fills Labels from its workload cache.
package metrics

import (
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Label values ztunnel uses when nothing better is known.
const (
	Unknown        = "unknown"
	MutualTLS      = "mutual_tls"
	NoFlag         = "-"
	ReporterSource = "source"      // outbound: this node proxies the client
	ReporterDest   = "destination" // inbound: this node proxies the server
)

// Response flags (response_flags label) ztunnel sets on failed connections.
const (
	FlagDeny               = "DENY"
	FlagConnect            = "CONNECT"
	FlagTLSFailure         = "TLS_FAILURE"
	FlagH2HandshakeFailure = "H2_HANDSHAKE_FAILURE"
	FlagNetworkPolicy      = "NETWORK_POLICY"
	FlagIdentityError      = "IDENTITY_ERROR"
	FlagCertRevoked        = "CERT_REVOKED"
)

// trafficLabelNames is the label order of every istio_tcp_* family, matching the field order
// of Labels with response_flags inserted where Istio puts it.
var trafficLabelNames = []string{
	"reporter",
	"source_workload", "source_canonical_service", "source_canonical_revision",
	"source_workload_namespace", "source_principal", "source_app", "source_version", "source_cluster",
	"destination_service", "destination_service_namespace", "destination_service_name",
	"destination_workload", "destination_canonical_service", "destination_canonical_revision",
	"destination_workload_namespace", "destination_principal", "destination_app",
	"destination_version", "destination_cluster",
	"request_protocol", "response_flags", "connection_security_policy",
	"source_region", "source_zone", "destination_region", "destination_zone",
}

var dnsLabelNames = []string{"request_query_type", "request_protocol", "source_canonical_service", "source_canonical_revision"}

// Metrics holds the registered families. The exported vectors are for the packages that own
// those events (DNS proxy, xDS client, in-pod workload manager); TCP traffic goes through
// Open and Conn.Close.
type Metrics struct {
	log       *slog.Logger
	logFilter *AccessLogFilter // nil: every connection (WithAccessLogFilter)
	kept      []bool           // by trafficLabelNames index; nil: every label (WithDroppedLabels)
	reg       *prometheus.Registry

	opened, closed, received, sent, failed *prometheus.CounterVec
	socketsOpen                            *prometheus.GaugeVec

	// OnDemandDNS counts on-demand DNS resolutions (labels: the source_* traffic labels
	// and hostname).
	OnDemandDNS *prometheus.CounterVec
	// CRLRejections counts HBONE connections closed because a reloaded CRL revoked their
	// peer, by reporter: destination (inbound) or source (outbound).
	CRLRejections *prometheus.CounterVec
	// CRLUntracked counts HBONE connections a CRL reload could not judge, by reporter: a
	// list names their peer's chain, which no longer verifies against the roots held (the
	// Rust ztunnel's crl_untracked_connections).
	CRLUntracked *prometheus.CounterVec
	// XDSConnectionTerminations is labelled reason = ConnectionError|Error|Reconnect|Complete.
	XDSConnectionTerminations *prometheus.CounterVec
	// XDSMessages and XDSMessageBytes are labelled url (the resource type URL).
	XDSMessages, XDSMessageBytes *prometheus.CounterVec
	// DNS proxy families, labelled request_query_type (lowercase), request_protocol (udp|tcp),
	// source_canonical_service, source_canonical_revision.
	DNSRequests, DNSUpstreamRequests, DNSUpstreamFailures *prometheus.CounterVec
	DNSUpstreamDuration                                   *prometheus.HistogramVec
	// HBONEDrops counts, by reason (hbone.DropReason's names: refused, reset_unanswered,
	// enhance_your_calm, handshake_evicted, and the per-node budgets' source_handshakes,
	// source_handshake_rate, source_failed_handshakes, peer_connection_rate, peer_streams,
	// peer_dials_waited, stream_starts_waited), the streams dropped or delayed before a
	// handler answered them and the connections closed for abuse or refused by a budget.
	// Such streams get no access-log record of their own.
	HBONEDrops *prometheus.CounterVec
	// HBONEKernelTLS counts HBONE connections by where their TLS records are handled:
	// result = "kernel" (kernel TLS), or why not (hbone.TLSInfo.Reason: no_kernel_tls,
	// disabled, cipher, ...).
	HBONEKernelTLS *prometheus.CounterVec
	// HBONEKernelTLSBytes counts the DATA payload bytes of ended kernel TLS connections,
	// labelled direction = sent|received and path = spliced (never in user space) or
	// copied.
	HBONEKernelTLSBytes *prometheus.CounterVec
	// HBONEKeyLimit counts HBONE connections that met a TLS key's record limit, by event:
	// drain (new streams moved to a fresh connection), tx_limit (closed at RFC 8446's
	// limit), peer_key_update (a peer's KeyUpdate the kernel cannot follow ended it).
	// HBONEKeyLimitStreams counts the streams the last two reset.
	HBONEKeyLimit, HBONEKeyLimitStreams *prometheus.CounterVec
	// HBONEHandshakeFailures counts failed inbound HBONE TLS handshakes by reason
	// (identity/certs.HandshakeFailure's: no_client_certificate, unknown_ca, expired,
	// bad_certificate, revoked, wrong_trust_domain, cipher, not_fips_approved,
	// no_local_identity, peer_alert, protocol, timeout, peer_closed, other).
	HBONEHandshakeFailures *prometheus.CounterVec
	// ConnectRetries, ConnectRetriesOverBudget and EndpointEjections count the proxy's
	// endpoint retries, the retries its retry budget refused, and its outlier ejections, by
	// destination_service (gozt).
	ConnectRetries, ConnectRetriesOverBudget, EndpointEjections *prometheus.CounterVec
	// In-pod (shared) mode workload manager.
	ActiveProxies, PendingProxies  prometheus.Gauge
	ProxiesStarted, ProxiesStopped prometheus.Counter

	workloadManager bool // export workload_manager_* (in-pod mode)

	mu     sync.RWMutex
	series map[seriesKey]*series // guarded by mu; grows like the registry's own series
}

// Option configures New.
type Option func(*Metrics)

// WithAccessLog sets the logger for access-log records ("connection opened" at DEBUG,
// "connection complete" at INFO or ERROR). The default is slog.Default(); pass a logger
// with a discarding handler to turn the access log off.
func WithAccessLog(l *slog.Logger) Option {
	return func(m *Metrics) {
		if l != nil {
			m.log = l
		}
	}
}

// WithWorkloadManager registers the in-pod workload manager's families
// (workload_manager_*), which the Rust ztunnel exports only in in-pod mode. Without it
// the gauges and counters still work; they are just not exported.
func WithWorkloadManager() Option {
	return func(m *Metrics) { m.workloadManager = true }
}

// New registers Istio's families on reg, including istio_build{component="ztunnel",tag=version},
// the process collector (process_open_fds, process_max_fds, ...) and the Go runtime's. It
// panics if reg already holds any of them, as registering twice is a programming error.
func New(reg *prometheus.Registry, version string, opts ...Option) *Metrics {
	m := &Metrics{log: slog.Default(), reg: reg, series: make(map[seriesKey]*series)}
	for _, o := range opts {
		o(m)
	}
	counter := func(name, help string, labels []string) *prometheus.CounterVec {
		v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
		reg.MustRegister(v)
		return v
	}
	traffic := m.keptNames()
	m.opened = counter("istio_tcp_connections_opened_total", "The total number of TCP connections opened", traffic)
	m.closed = counter("istio_tcp_connections_closed_total", "The total number of TCP connections closed", traffic)
	m.received = counter("istio_tcp_received_bytes_total", "The size of total bytes received during request in case of a TCP connection", traffic)
	m.sent = counter("istio_tcp_sent_bytes_total", "The size of total bytes sent during response in case of a TCP connection", traffic)
	m.failed = counter("istio_tcp_connections_failed_total", "The total number of TCP connections that failed to establish (unstable)", traffic)
	m.socketsOpen = prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "istio_tcp_sockets_open", Help: "The current number of open TCP sockets (unstable)"}, []string{"reporter"})
	reg.MustRegister(m.socketsOpen)

	m.OnDemandDNS = counter("istio_on_demand_dns_total", "The total number of requests that used on-demand DNS (unstable)",
		[]string{"source_workload", "source_canonical_service", "source_canonical_revision", "source_workload_namespace",
			"source_principal", "source_app", "source_version", "source_cluster", "hostname"})
	m.CRLRejections = counter("istio_crl_policy_rejections_total", "The total number of connections rejected due to CRL certificate revocation (unstable)", []string{"reporter"})
	m.CRLUntracked = counter("istio_crl_untracked_connections_total", "The total number of connections not tracked for CRL enforcement (unstable)", []string{"reporter"})
	m.XDSConnectionTerminations = counter("istio_xds_connection_terminations_total", "The total number of completed connections to xds server (unstable)", []string{"reason"})
	m.XDSMessages = counter("istio_xds_message_total", "Total number of messages received (unstable)", []string{"url"})
	m.XDSMessageBytes = counter("istio_xds_message_bytes_total", "Total number of bytes received (unstable)", []string{"url"})
	m.HBONEDrops = counter("hbone_dropped_total", "HBONE streams refused or reset by the peer before they were answered, and HBONE connections closed with ENHANCE_YOUR_CALM (gozt)", []string{"reason"})
	m.HBONEKernelTLS = counter("hbone_kernel_tls_connections_total", "HBONE connections by where their TLS records are handled: result=kernel, or the reason they stayed in user space (gozt)", []string{"result"})
	m.HBONEKernelTLSBytes = counter("hbone_kernel_tls_bytes_total", "DATA payload bytes of ended kernel TLS HBONE connections, by direction and by path: spliced (never in user space) or copied (gozt)", []string{"direction", "path"})
	m.HBONEKeyLimit = counter("hbone_tls_key_limit_total", "HBONE connections that met their TLS key's record limit, by event: drain, tx_limit, peer_key_update (gozt)", []string{"event"})
	m.HBONEKeyLimitStreams = counter("hbone_tls_key_limit_reset_streams_total", "HBONE streams reset because their connection ended at a TLS key limit, by event: tx_limit, peer_key_update (gozt)", []string{"event"})
	m.HBONEHandshakeFailures = counter("hbone_tls_handshake_failures_total", "Failed inbound HBONE TLS handshakes, by reason (gozt)", []string{"reason"})
	m.ConnectRetries = counter("outbound_connect_retries_total", "Outbound connections tried on another endpoint of their service after one failed before any byte moved, by the service (gozt)", []string{"destination_service"})
	m.ConnectRetriesOverBudget = counter("outbound_connect_retries_over_budget_total", "Outbound connections not tried on another endpoint after one failed because the service's retry budget was spent (retries in flight at 20% of its connects in flight, at least 3), by the service (gozt)", []string{"destination_service"})
	m.EndpointEjections = counter("outbound_endpoint_ejections_total", "Service endpoints ejected from picks after consecutive failed connects, by the service (gozt)", []string{"destination_service"})
	m.DNSRequests = counter("istio_dns_requests_total", "Total number of DNS requests (unstable)", dnsLabelNames)
	m.DNSUpstreamRequests = counter("istio_dns_upstream_requests_total", "Total number of DNS requests forwarded to upstream (unstable)", dnsLabelNames)
	m.DNSUpstreamFailures = counter("istio_dns_upstream_failures_total", "Total number of DNS failures forwarding to upstream (unstable)", dnsLabelNames)
	m.DNSUpstreamDuration = prometheus.NewHistogramVec(prometheus.HistogramOpts{
		Name:    "istio_dns_upstream_request_duration_seconds",
		Help:    "Total time in seconds Istio takes to get DNS response from upstream (unstable)",
		Buckets: []float64{0.0005, 0.001, 0.01, 0.1, 1, 5},
	}, dnsLabelNames)
	reg.MustRegister(m.DNSUpstreamDuration)

	m.ActiveProxies = prometheus.NewGauge(prometheus.GaugeOpts{Name: "workload_manager_active_proxy_count", Help: "The total number current workloads with active proxies (unstable)"})
	m.PendingProxies = prometheus.NewGauge(prometheus.GaugeOpts{Name: "workload_manager_pending_proxy_count", Help: "The total number current workloads with pending proxies (unstable)"})
	m.ProxiesStarted = prometheus.NewCounter(prometheus.CounterOpts{Name: "workload_manager_proxies_started_total", Help: "The total number of proxies that were started (unstable)"})
	m.ProxiesStopped = prometheus.NewCounter(prometheus.CounterOpts{Name: "workload_manager_proxies_stopped_total", Help: "The total number of proxies that were stopped (unstable)"})
	if m.workloadManager {
		reg.MustRegister(m.ActiveProxies, m.PendingProxies, m.ProxiesStarted, m.ProxiesStopped)
	}

	build := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: "istio_build", Help: "Istio component build info"}, []string{"component", "tag"})
	build.WithLabelValues("ztunnel", validUTF8(version)).Set(1)
	reg.MustRegister(build)
	reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	// The Go runtime's, as the Rust ztunnel exports its tokio runtime's: go_goroutines for
	// tokio_num_alive_tasks, go_sched_gomaxprocs_threads for tokio_num_workers,
	// go_sched_latencies_seconds for its queue depth and park counts, go_gc_* and
	// go_memstats_* for what a garbage collector adds.
	reg.MustRegister(collectors.NewGoCollector(collectors.WithGoCollectorRuntimeMetrics(collectors.MetricsScheduler)))
	return m
}

// Handler serves the registry at /metrics and /stats/prometheus (Istio's scrape path) in the
// Prometheus text format, or OpenMetrics when the Accept header asks for it, gzip-compressed
// when the client accepts it. Other paths get 404.
func (m *Metrics) Handler() http.Handler {
	h := promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		EnableOpenMetrics: true,
		ErrorLog:          slogPrinter{slog.Default()}, // not the access log
	})
	mux := http.NewServeMux()
	mux.Handle("/metrics", h)
	mux.Handle("/stats/prometheus", h)
	return mux
}

// slogPrinter adapts slog to promhttp's error logger.
type slogPrinter struct{ l *slog.Logger }

func (p slogPrinter) Println(v ...any) {
	p.l.Error("metrics: serving scrape", "error", fmt.Sprint(v...))
}

// validUTF8 keeps a label value Prometheus accepts; values from the workload cache are
// protobuf strings and already valid, so this only guards against misuse.
func validUTF8(s string) string {
	if utf8.ValidString(s) {
		return s
	}
	return strings.ToValidUTF8(s, "\uFFFD")
}

// OnDemandDNSUsed counts one connection whose destination workload was resolved by its
// hostname (istio_on_demand_dns_total), labelled by its source (l's source_* labels,
// Istio's defaults for empty ones) and the hostname, as the Rust ztunnel labels it.
func (m *Metrics) OnDemandDNSUsed(l Labels, hostname string) {
	l = l.withDefaults()
	if hostname == "" {
		hostname = Unknown
	}
	m.OnDemandDNS.WithLabelValues(validUTF8(l.SourceWorkload), validUTF8(l.SourceCanonicalService), validUTF8(l.SourceCanonicalRevision),
		validUTF8(l.SourceWorkloadNamespace), validUTF8(l.SourcePrincipal), validUTF8(l.SourceApp), validUTF8(l.SourceVersion),
		validUTF8(l.SourceCluster), validUTF8(hostname)).Inc()
}
