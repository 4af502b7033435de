package metrics

import (
	"context"
	"log/slog"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Labels are the traffic labels of Istio's standard TCP metrics (the Rust ztunnel's
// src/proxy/metrics.rs). Empty fields take Istio's defaults: "unknown" for all, except
// RequestProtocol "tcp". ConnectionSecurityPolicy is "mutual_tls" or "unknown". Principals are full "spiffe://..." URIs. response_flags is not here: it is
// known only when the connection ends and is passed to Conn.Close.
type Labels struct {
	Reporter string // ReporterSource (outbound) or ReporterDest (inbound)

	SourceWorkload, SourceCanonicalService, SourceCanonicalRevision, SourceWorkloadNamespace,
	SourcePrincipal, SourceApp, SourceVersion, SourceCluster string

	DestinationService, DestinationServiceNamespace, DestinationServiceName,
	DestinationWorkload, DestinationCanonicalService, DestinationCanonicalRevision,
	DestinationWorkloadNamespace, DestinationPrincipal, DestinationApp, DestinationVersion,
	DestinationCluster string

	RequestProtocol, ConnectionSecurityPolicy string

	// The workloads' locality, as the Rust ztunnel labels it since 1.27.
	SourceRegion, SourceZone, DestinationRegion, DestinationZone string
}

// fields are l's fields in trafficLabelNames order (which has response_flags too).
func (l *Labels) fields() [26]*string {
	return [26]*string{
		&l.Reporter,
		&l.SourceWorkload, &l.SourceCanonicalService, &l.SourceCanonicalRevision, &l.SourceWorkloadNamespace,
		&l.SourcePrincipal, &l.SourceApp, &l.SourceVersion, &l.SourceCluster,
		&l.DestinationService, &l.DestinationServiceNamespace, &l.DestinationServiceName,
		&l.DestinationWorkload, &l.DestinationCanonicalService, &l.DestinationCanonicalRevision,
		&l.DestinationWorkloadNamespace, &l.DestinationPrincipal, &l.DestinationApp, &l.DestinationVersion,
		&l.DestinationCluster, &l.RequestProtocol, &l.ConnectionSecurityPolicy,
		&l.SourceRegion, &l.SourceZone, &l.DestinationRegion, &l.DestinationZone,
	}
}

// withDefaults fills empty labels with Istio's defaults.
func (l Labels) withDefaults() Labels {
	if l.RequestProtocol == "" {
		l.RequestProtocol = "tcp"
	}
	for _, f := range l.fields() {
		if *f == "" {
			*f = Unknown
		}
	}
	return l
}

// values returns the label values in trafficLabelNames order. It allocates; it runs only when
// a series is first created.
func (l *Labels) values(flag string) []string {
	vs := []string{
		l.Reporter,
		l.SourceWorkload, l.SourceCanonicalService, l.SourceCanonicalRevision, l.SourceWorkloadNamespace,
		l.SourcePrincipal, l.SourceApp, l.SourceVersion, l.SourceCluster,
		l.DestinationService, l.DestinationServiceNamespace, l.DestinationServiceName,
		l.DestinationWorkload, l.DestinationCanonicalService, l.DestinationCanonicalRevision,
		l.DestinationWorkloadNamespace, l.DestinationPrincipal, l.DestinationApp,
		l.DestinationVersion, l.DestinationCluster,
		l.RequestProtocol, flag, l.ConnectionSecurityPolicy,
		l.SourceRegion, l.SourceZone, l.DestinationRegion, l.DestinationZone,
	}
	for i, v := range vs {
		vs[i] = validUTF8(v)
	}
	return vs
}

// ConnLog holds the access-log fields that are not labels.
type ConnLog struct {
	SrcAddr   string // client address
	DstAddr   string // L4 destination; on inbound the :15008 address
	HBONEAddr string // CONNECT authority, if tunnelled
	// SrcNetwork is the client's network when it is not this node's: a connection that came
	// through a network gateway (double HBONE's x-forwarded-network). gozt's own field.
	SrcNetwork string
	Direction  string // "inbound" or "outbound"; empty derives it from Labels.Reporter
}

// seriesKey names one set of series: the traffic labels (defaults applied) and a response flag.
type seriesKey struct {
	Labels
	flag string
}

// series are the resolved counters of one seriesKey, so that recording is a few atomic adds.
// opened is set only without a flag, failed only with one.
type series struct {
	key                                    seriesKey
	opened, closed, received, sent, failed prometheus.Counter
	sockets                                prometheus.Gauge
	isFailure                              bool
	open                                   atomic.Int64 // connections open on these labels (unflagged series only)
}

// lookup returns the series for k, creating them on first use.
func (m *Metrics) lookup(k *seriesKey) *series {
	m.mu.RLock()
	s := m.series[*k]
	m.mu.RUnlock()
	if s != nil {
		return s
	}
	// Create only the series this key can move, so that scrapes show no zero-valued
	// opened{response_flags="DENY"} or failed{response_flags="-"} series.
	vs := m.keptValues(k.values(k.flag))
	s = &series{
		key:       *k,
		closed:    m.closed.WithLabelValues(vs...),
		received:  m.received.WithLabelValues(vs...),
		sent:      m.sent.WithLabelValues(vs...),
		sockets:   m.socketsOpen.WithLabelValues(vs[0]),
		isFailure: k.flag != NoFlag,
	}
	if s.isFailure {
		s.failed = m.failed.WithLabelValues(vs...)
	} else {
		s.opened = m.opened.WithLabelValues(vs...)
	}
	m.mu.Lock()
	if old := m.series[*k]; old != nil {
		s = old
	} else {
		m.series[*k] = s
	}
	m.mu.Unlock()
	return s
}

// epoch is what a Conn's start counts from: the process's start, near enough.
var epoch = time.Now()

// Conn records one connection: Open resolves its series, Close records the result once.
type Conn struct {
	m      *Metrics
	s      *series // series for the labels without a flag; s.key holds the labels
	labels *Labels // every label, for the access log, when s.key has some dropped; else nil
	log    ConnLog
	start  time.Duration // when it opened, as time since epoch: monotonic, and 8 bytes where a time.Time is 24
	closed atomic.Bool
}

// Open is called once when a connection starts. It resolves the series for l (one map
// lookup), counts istio_tcp_connections_opened_total and istio_tcp_sockets_open, and logs
// "connection opened" at DEBUG. A nil *Metrics returns a nil *Conn, whose Close does nothing.
func (m *Metrics) Open(l Labels, log ConnLog) *Conn {
	if m == nil {
		return nil
	}
	c := new(Conn)
	m.OpenAt(c, l, log)
	return c
}

// OpenAt is Open into a zero Conn the caller holds, inside a record of its own: a held
// connection then costs one object fewer (a proxy's idle connections are mostly such
// records). With a nil *Metrics it leaves c zero, and a zero Conn's Close does nothing.
func (m *Metrics) OpenAt(c *Conn, l Labels, log ConnLog) {
	if m == nil {
		return
	}
	k := seriesKey{Labels: l.withDefaults(), flag: NoFlag}
	var full *Labels
	if m.kept != nil {
		full = new(Labels)
		*full = k.Labels
		m.maskLabels(&k.Labels)
	}
	c.m, c.s, c.labels, c.log, c.start = m, m.lookup(&k), full, log, time.Since(epoch)
	if c.log.Direction == "" {
		c.log.Direction = "inbound"
		if k.Reporter == ReporterSource {
			c.log.Direction = "outbound"
		}
	}
	c.s.opened.Inc()
	c.s.sockets.Inc()
	c.s.open.Add(1)
	if ctx := context.Background(); m.logFilter == nil && m.log.Enabled(ctx, slog.LevelDebug) {
		var buf [20]slog.Attr
		m.logAccess(ctx, slog.LevelDebug, "connection opened", c.appendAttrs(buf[:0]))
	}
}

// Close is called when the connection ends, with the bytes sent (server to client) and
// received (client to server), a response flag ("" or "-" for none; FlagDeny, FlagConnect,
// ...) and the error, if any. It counts istio_tcp_connections_closed_total, the byte counters
// and, when a flag is set, istio_tcp_connections_failed_total, all under the labels plus that
// flag; then it writes one "connection complete" access-log record, at ERROR when err or a
// flag is set, else INFO. Only the first call counts.
func (c *Conn) Close(sent, received int64, flag string, err error) {
	if c == nil || c.m == nil || !c.closed.CompareAndSwap(false, true) {
		return
	}
	s := c.s
	if flag != "" && flag != NoFlag {
		k := c.s.key
		k.flag = flag
		s = c.m.lookup(&k)
	}
	c.s.sockets.Dec()
	c.s.open.Add(-1)
	s.closed.Inc()
	if sent > 0 {
		s.sent.Add(float64(sent))
	}
	if received > 0 {
		s.received.Add(float64(received))
	}
	if s.isFailure {
		s.failed.Inc()
	}

	level := slog.LevelInfo
	if err != nil || s.isFailure {
		level = slog.LevelError
	}
	ctx := context.Background()
	if !c.m.log.Enabled(ctx, level) || (c.m.logFilter != nil && !c.m.logFilter.logs(flag, err)) {
		return
	}
	// Istio's byte metrics are from the server's point of view; the access log reports them
	// from the local application's: on outbound the local app is the client.
	appSent, appRecv := sent, received
	if c.s.key.Reporter == ReporterSource {
		appSent, appRecv = received, sent
	}
	var buf [20]slog.Attr
	attrs := c.appendAttrs(buf[:0])
	attrs = append(attrs,
		slog.Int64("bytes_sent", appSent),
		slog.Int64("bytes_recv", appRecv),
		slog.String("duration", strconv.FormatInt((time.Since(epoch)-c.start).Milliseconds(), 10)+"ms"),
	)
	if err != nil {
		attrs = append(attrs, slog.String("error", err.Error()))
	}
	c.m.logAccess(ctx, level, "connection complete", attrs)
}

// logAccess writes one access-log record; the caller has checked that level is enabled.
// Building the Record here skips Logger.LogAttrs's runtime.Callers: the handler never
// prints a source location for access lines.
func (m *Metrics) logAccess(ctx context.Context, level slog.Level, msg string, attrs []slog.Attr) {
	r := slog.NewRecord(time.Now(), level, msg, 0)
	r.AddAttrs(attrs...)
	_ = m.log.Handler().Handle(ctx, r)
}

// appendAttrs adds ztunnel's access-log fields, leaving out unknown ones as ztunnel does.
func (c *Conn) appendAttrs(a []slog.Attr) []slog.Attr {
	l := &c.s.key.Labels
	if c.labels != nil {
		l = c.labels
	}
	mtls := l.ConnectionSecurityPolicy == MutualTLS
	a = appendKnown(a, "src.addr", c.log.SrcAddr)
	a = appendKnown(a, "src.workload", orKnown(l.SourceWorkload, l.SourceCanonicalService))
	a = appendKnown(a, "src.namespace", l.SourceWorkloadNamespace)
	if mtls {
		a = appendKnown(a, "src.identity", l.SourcePrincipal)
	}
	a = appendKnown(a, "src.cluster", l.SourceCluster)
	a = appendKnown(a, "src.network", c.log.SrcNetwork)
	a = appendKnown(a, "dst.addr", c.log.DstAddr)
	a = appendKnown(a, "dst.hbone_addr", c.log.HBONEAddr)
	a = appendKnown(a, "dst.service", l.DestinationService)
	a = appendKnown(a, "dst.workload", orKnown(l.DestinationWorkload, l.DestinationCanonicalService))
	a = appendKnown(a, "dst.namespace", l.DestinationWorkloadNamespace)
	if mtls {
		a = appendKnown(a, "dst.identity", l.DestinationPrincipal)
	}
	a = appendKnown(a, "dst.cluster", l.DestinationCluster)
	return append(a, slog.String("direction", c.log.Direction))
}

// orKnown returns v, or fallback when v is unknown: ztunnel logs the canonical service when
// it does not know the workload name.
func orKnown(v, fallback string) string {
	if v == "" || v == Unknown {
		return fallback
	}
	return v
}

func appendKnown(a []slog.Attr, k, v string) []slog.Attr {
	if v == "" || v == Unknown {
		return a
	}
	return append(a, slog.String(k, v))
}

// Forget drops the series of connections to or from workloads that have left, so that
// churning workloads (jobs, bare pods: each run a new workload name) do not grow /metrics
// without bound, a known complaint against the Rust ztunnel. A series goes when no
// connection on its labels is open and gone(namespace, workload) holds for its source or
// its destination workload ("unknown" ones are kept: they cannot be looked up). It
// returns how many label sets were dropped.
//
// A connection that opens on a label set as it is dropped counts into series no longer
// exported; gone should only hold for workloads the cache no longer has, which open no
// connections.
func (m *Metrics) Forget(gone func(namespace, workload string) bool) int {
	if m == nil {
		return 0
	}
	left := func(ns, w string) bool { return w != Unknown && gone(ns, w) }
	m.mu.Lock()
	defer m.mu.Unlock()
	doomed := map[Labels]bool{}
	for k, s := range m.series {
		if k.flag == NoFlag && s.open.Load() == 0 &&
			(left(k.SourceWorkloadNamespace, k.SourceWorkload) || left(k.DestinationWorkloadNamespace, k.DestinationWorkload)) {
			doomed[k.Labels] = true
		}
	}
	for k, s := range m.series {
		if !doomed[k.Labels] {
			continue
		}
		vs := k.values(k.flag)
		for _, v := range []*prometheus.CounterVec{m.closed, m.received, m.sent} {
			v.DeleteLabelValues(vs...)
		}
		if s.isFailure {
			m.failed.DeleteLabelValues(vs...)
		} else {
			m.opened.DeleteLabelValues(vs...)
		}
		delete(m.series, k)
	}
	return len(doomed)
}
