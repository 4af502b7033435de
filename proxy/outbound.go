package proxy

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"syscall"
	"time"

	"golang.org/x/net/http2"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy/outlier"
	"github.com/gozt/gozt/proxy/rbac"
	"github.com/gozt/gozt/xds/state"
)

// ztunnelPorts are ztunnel's own listener ports: a connection to one of them on a local
// address would loop through this proxy.
var ztunnelPorts = map[uint16]bool{15001: true, 15006: true, 15008: true, 15080: true}

// errSelfCall refuses outbound connections to ztunnel's own ports.
var errSelfCall = errors.New("proxy: refusing a connection to ztunnel's own port (self-call loop)")

// serveOutbound handles a connection captured on 15001: its original destination comes
// from SO_ORIGINAL_DST, or is the local address when redirected with TPROXY.
func (p *Proxy) serveOutbound(ctx context.Context, c *net.TCPConn) {
	dst := originalDst(c)
	client := addrPortOf(c.RemoteAddr())
	src, err := p.sourceWorkload(ctx, client.Addr())
	if err != nil {
		c.Close()
		p.log.Warn("proxy: outbound: unknown source workload; connection dropped", "src", client, "dst", dst, "err", err)
		return
	}
	p.outbound(ctx, c, src, client, dst, nil)
}

// sourceWorkload is the local workload an outbound connection comes from (Local.Client),
// waiting briefly for it as localWorkload does.
func (p *Proxy) sourceWorkload(ctx context.Context, clientIP netip.Addr) (*state.Workload, error) {
	return p.awaitLocal(ctx, clientIP, true)
}

// outbound proxies client to dst for the source workload src, and owns client from the
// call on. ready, if not nil, is called once the upstream is connected (err nil) or failed,
// before any byte is copied: SOCKS5 answers its client there.
//
// The copy runs on a fresh goroutine and the caller's returns (see handOff): a proxied
// connection's goroutine lives as long as the connection, and one that never ran the
// setup (routing, TLS, HPACK, metrics) needs a 4 KiB stack instead of 8.
func (p *Proxy) outbound(ctx context.Context, client *net.TCPConn, src *state.Workload, clientAddr, dst netip.AddrPort, ready func(error)) {
	answered := ready != nil // a failure is told to the client, not only shown by the close
	if ready == nil {
		ready = func(error) {}
	}
	tc := &liveConn{attrs: rbac.Conn{DstIP: dst.Addr(), DstPort: dst.Port()}}
	upstream, err := p.connect(ctx, src, clientAddr, dst, ready, &tc.rec)
	if err != nil {
		if answered {
			closeRefused(client) // so the answer is not lost to a reset
		} else {
			p.refuse(client)
		}
		p.log.Debug("proxy: outbound", "src", clientAddr, "dst", dst, "err", err)
		return
	}
	p.handOff(tc, client, upstream)
}

// connect routes and dials an outbound connection, then calls ready. A failure is recorded
// in the metrics here; on success rec is open.
//
// The whole connect, every attempt and the wait for each CONNECT answer included, ends
// within DialTimeout, whatever the endpoints do (accept and never finish TLS, never answer
// the CONNECT). A service's connection whose endpoint fails before any byte has moved
// (dial, TLS, a 5xx CONNECT answer) is tried on another endpoint, up to ConnectRetries more
// times within that time, as the service's retry budget allows (RetryBudget); each
// endpoint's outcome goes to the outlier detector, whose ejections steer later picks. The
// client sees one connection: only its last attempt is in the metrics.
func (p *Proxy) connect(ctx context.Context, src *state.Workload, clientAddr, dst netip.AddrPort, ready func(error), rec *metrics.Conn) (halfCloser, error) {
	base := metrics.Labels{Reporter: metrics.ReporterSource, SourcePrincipal: src.Identity().String()}
	sourceLabels(&base, src)
	labels := base
	dstAddr := dst.String()
	log := metrics.ConnLog{SrcAddr: clientAddr.String(), DstAddr: dstAddr, Direction: "outbound"}
	fail := func(flag string, err error) (halfCloser, error) {
		ready(err)
		if flag != "" {
			p.metrics.Open(labels, log).Close(0, 0, flag, err)
		}
		return nil, err
	}

	if p.isSelfCall(dst) {
		return fail(metrics.FlagConnect, errSelfCall)
	}
	p.demand(ctx, dst.Addr())
	var avoid state.Avoid
	if p.cfg.Outliers != nil {
		avoid.Ejected = p.cfg.Outliers.Ejected
	}
	// One deadline for the whole connect. The first attempt runs on ctx: the dialer (its
	// Timeout) and the pool (DialBy, told DialTimeout from now) bound it themselves, without
	// a context every connection would allocate. Later attempts, a hostname's lookup and
	// double HBONE (two dials in a row) run on one with the deadline.
	deadline := connectDeadline{at: time.Now().Add(p.cfg.DialTimeout)}
	defer deadline.stop()
	var flight outlier.Flight // the connect's place in its service's retry budget
	defer flight.End()
	var lastErr error
	for attempt := 0; ; attempt++ {
		route, err := p.store.ResolveAvoiding(src, dst, avoid)
		actx := ctx
		if attempt > 0 || route.Hostname != "" || route.Kind == state.RouteDoubleHBONE {
			actx = deadline.context(ctx)
		}
		if err == nil && route.Hostname != "" {
			route, err = p.resolveHostname(actx, src, route, dst)
		}
		if attempt > 0 && (err != nil || slices.Contains(avoid.Tried, route.Workload)) {
			// Out of endpoints (or a waypoint addressed by IP, the same one again): the
			// client hears why the last one failed.
			return fail(connectFlag(lastErr), lastErr)
		}
		if err != nil {
			return fail(metrics.FlagConnect, err)
		}
		if attempt == 0 && route.Service != nil && p.cfg.ConnectRetries > 0 {
			flight = p.cfg.RetryBudget.Begin(route.Service)
		}
		if attempt > 0 && route.Service != nil {
			p.metrics.ConnectRetries.WithLabelValues(route.Service.Hostname).Inc()
		}
		labels, log.DstAddr, log.HBONEAddr = base, dstAddr, "" // what an earlier attempt set
		destLabels(&labels, route.Workload, route.Service)
		upstream, err := p.dialRoute(actx, deadline.attempt(p.cfg.ConnectRetries-attempt, route), src, clientAddr, route, &labels, &log)
		if err == nil {
			if p.cfg.Outliers != nil && route.Workload != nil {
				p.cfg.Outliers.Succeeded(endpointOf(route))
			}
			ready(nil)
			p.metrics.OpenAt(rec, labels, log)
			return upstream, nil
		}
		lastErr = err
		if !p.endpointFailed(ctx, route, err) || attempt >= p.cfg.ConnectRetries || !time.Now().Before(deadline.at) {
			return fail(connectFlag(err), err)
		}
		if !flight.Retry() {
			p.metrics.ConnectRetriesOverBudget.WithLabelValues(route.Service.Hostname).Inc()
			p.log.Debug("proxy: outbound: no retry, the service's retry budget is spent", "src", clientAddr, "dst", dst, "endpoint", route.Workload.UID, "err", err)
			return fail(connectFlag(err), err)
		}
		p.log.Debug("proxy: outbound: retrying on another endpoint", "src", clientAddr, "dst", dst, "endpoint", route.Workload.UID, "err", err)
		avoid.Tried = append(avoid.Tried, route.Workload)
		if route.Workload.Node != "" && unanswered(err) {
			avoid.Nodes = append(avoid.Nodes, route.Workload.Node)
		}
	}
}

// unanswered reports whether a failed attempt got no answer at all: it ran out of time (a
// dial, a TLS handshake or a CONNECT that nothing answered) or had no route. Then the
// retry goes to another node where the service has endpoints: a node cut off takes all its
// pods with it, and trying them one by one, each for its share of the deadline, would
// spend the connect and hold retries in flight against the service's retry budget. A
// refusal or an answer says the node is up, and its other pods stay as likely as any.
func unanswered(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || errors.Is(err, syscall.EHOSTUNREACH) ||
		errors.Is(err, syscall.ENETUNREACH) || errors.As(err, &ne) && ne.Timeout()
}

// connectDeadline is an outbound connect's deadline, and the context that carries it once
// one is needed.
type connectDeadline struct {
	at     time.Time
	ctx    context.Context
	cancel context.CancelFunc
}

// context returns parent with the deadline, made at the first call.
func (d *connectDeadline) context(parent context.Context) context.Context {
	if d.ctx == nil {
		d.ctx, d.cancel = context.WithDeadline(parent, d.at)
	}
	return d.ctx
}

// attempt is when an attempt that may still be retried retries times must end: an equal
// share of what is left, so that an endpoint that never answers (its node cut off, a pooled
// connection whose peer is gone) leaves time to try another, as Envoy's per-try timeout
// does. The last attempt, and one with no other endpoint to go to, gets all that is left:
// the zero time, the connect's own deadline.
func (d *connectDeadline) attempt(retries int, route state.Route) time.Time {
	retries = min(retries, route.Others)
	if retries <= 0 || route.Service == nil || route.Workload == nil {
		return time.Time{}
	}
	return time.Now().Add(time.Until(d.at) / time.Duration(retries+1))
}

func (d *connectDeadline) stop() {
	if d.cancel != nil {
		d.cancel()
	}
}

// endpointFailed reports whether err, from connecting route, says its endpoint could not be
// reached, so another may be tried, and records the failures the endpoint caused for
// outlier detection. Not retried: a CONNECT answered 4xx (a policy denial, a bad target),
// which any endpoint would answer the same; a context ended by the client or shutdown; a
// failure of this node's own (localFailure); a route without a service, which has no
// other endpoint. Retried but not held against the endpoint: a stream its node refused
// (REFUSED_STREAM: its budget of streams for our identity is full, which says it is up).
func (p *Proxy) endpointFailed(ctx context.Context, route state.Route, err error) bool {
	if route.Service == nil || route.Workload == nil || ctx.Err() != nil || localFailure(err) {
		return false
	}
	var se *hbone.StatusError
	if errors.As(err, &se) && se.Code < 500 {
		return false
	}
	if re := (*hbone.ResetError)(nil); errors.As(err, &re) && re.Code == http2.ErrCodeRefusedStream {
		return true
	}
	if p.cfg.Outliers != nil && p.cfg.Outliers.Failed(endpointOf(route), route.Service.Key()) {
		p.metrics.EndpointEjections.WithLabelValues(route.Service.Hostname).Inc()
		p.log.Info("proxy: endpoint ejected after failed connects", "endpoint", route.Workload.UID, "port", route.EndpointPort, "service", route.Service.Key(), "err", err)
	}
	return true
}

// errLocalCert marks a connect that failed for want of this node's own certificate (the
// CA unreachable, say): no endpoint's doing.
var errLocalCert = errors.New("proxy: no client certificate")

// localErrors are this node's own failures: no certificate, or out of file descriptors,
// socket buffers, memory or local ports.
var localErrors = []error{errLocalCert, syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.EADDRNOTAVAIL}

// localFailure reports whether err is one of localErrors, not the endpoint's doing. Any
// endpoint would fail the same, so it is neither retried nor counted against one.
func localFailure(err error) bool {
	for _, local := range localErrors {
		if errors.Is(err, local) {
			return true
		}
	}
	return false
}

// endpointOf is the endpoint route goes to, as outlier detection keys it.
func endpointOf(route state.Route) outlier.Endpoint {
	return outlier.Endpoint{Workload: route.Workload, Port: route.EndpointPort}
}

// dialRoute opens the upstream leg of route and fills in the labels and log fields that
// depend on it; by, if set, is when this attempt must end (connectDeadline.attempt), else
// DialTimeout from now or ctx's deadline.
func (p *Proxy) dialRoute(ctx context.Context, by time.Time, src *state.Workload, clientAddr netip.AddrPort, route state.Route, labels *metrics.Labels, log *metrics.ConnLog) (halfCloser, error) {
	switch route.Kind {
	case state.RouteHBONE, state.RouteWaypoint:
		labels.ConnectionSecurityPolicy = metrics.MutualTLS
		if route.Workload != nil {
			labels.DestinationPrincipal = route.Workload.Identity().String()
		}
		log.DstAddr, log.HBONEAddr = route.Dial.String(), route.Authority
		if by.IsZero() {
			by = time.Now().Add(p.cfg.DialTimeout) // as the dialer's Timeout bounds a plain dial
		}
		key := hbone.NewKey(src.Identity(), route.Identities, route.Dial, p.sourceIP(src))
		s, err := p.pool.DialBy(ctx, by, key, route.Authority, hboneHeaders(src, clientAddr, route.Service))
		if err != nil {
			return nil, fmt.Errorf("proxy: hbone to %v (%s): %w", route.Dial, route.Authority, err)
		}
		return s, nil
	case state.RouteTCP, state.RoutePassthrough:
		log.DstAddr = route.Dial.String()
		d := &p.dialer
		if !by.IsZero() {
			dc := p.dialer // this attempt's share of the connect's deadline
			dc.Deadline, d = by, &dc
		}
		s, err := p.dialWith(ctx, d, route.Dial)
		if err != nil {
			return nil, fmt.Errorf("proxy: dial %v: %w", route.Dial, err)
		}
		return s, nil
	case state.RouteDoubleHBONE:
		labels.ConnectionSecurityPolicy = metrics.MutualTLS
		labels.DestinationPrincipal = route.Workload.Identity().String()
		log.DstAddr, log.HBONEAddr = route.Dial.String(), route.Authority
		s, err := p.dialThroughGateway(ctx, src, clientAddr, route)
		if err != nil {
			return nil, err
		}
		if bag := s.Header().Get("Baggage"); bag != "" {
			derivedDestLabels(labels, bag)
		}
		return s, nil
	}
	return nil, fmt.Errorf("proxy: unknown route kind %v", route.Kind)
}

// dialThroughGateway opens double HBONE to a destination on another network, as the Rust
// ztunnel's proxy_to_double_hbone: a pooled CONNECT to the network gateway (mTLS to the
// gateway's identities), then over that stream an unpooled mTLS HTTP/2 connection to the
// destination behind it, whose CONNECT also says which network the client is on
// (x-forwarded-network). The gateway forwards the outer stream's bytes without opening
// them; pooling the inner connection would pin every later connection to whichever
// endpoint the gateway picked for the first.
func (p *Proxy) dialThroughGateway(ctx context.Context, src *state.Workload, clientAddr netip.AddrPort, route state.Route) (*hbone.Stream, error) {
	hdr := hboneHeaders(src, clientAddr, route.Service)
	outerKey := hbone.NewKey(src.Identity(), route.GatewayIdentities, route.Dial, p.sourceIP(src))
	outer, err := p.pool.Dial(ctx, outerKey, route.Authority, hdr)
	if err != nil {
		return nil, fmt.Errorf("proxy: hbone to network gateway %v (%s): %w", route.Dial, route.Authority, err)
	}
	inner := maps.Clone(hdr)
	inner[forwardedNetworkHeader] = []string{p.cfg.Local.Network}
	innerKey := hbone.NewKey(src.Identity(), route.Identities, route.Dial, netip.Addr{})
	s, err := p.pool.DialOver(ctx, outer, innerKey, route.Authority, inner)
	if err != nil {
		return nil, fmt.Errorf("proxy: hbone to %s through network gateway %v (inner, to %s): %w", route.Authority, route.Dial, route.Workload.UID, err)
	}
	return s, nil
}

// connectFlag is the response flag of a failed HBONE dial.
func connectFlag(err error) string {
	var se *hbone.StatusError
	if errors.As(err, &se) && se.Code == 401 {
		return metrics.FlagDeny
	}
	return metrics.FlagConnect
}

// isSelfCall reports whether dst is one of this proxy's own listeners: a well-known ztunnel
// port on a local address, or the address a listener is actually bound to (listeners may be
// configured on other ports).
func (p *Proxy) isSelfCall(dst netip.AddrPort) bool {
	if ztunnelPorts[dst.Port()] && p.isLocalAddr(dst.Addr()) {
		return true
	}
	for _, ln := range p.listeners {
		a := addrPortOf(ln.Addr())
		if a.Port() == dst.Port() && (a.Addr() == dst.Addr() || a.Addr().IsUnspecified() && p.isLocalAddr(dst.Addr())) {
			return true
		}
	}
	return false
}

// isLocalAddr reports whether ip is an address of this host (loopback, unspecified or one
// of this node's listener addresses).
func (p *Proxy) isLocalAddr(ip netip.Addr) bool {
	if ip.IsLoopback() || ip.IsUnspecified() {
		return true
	}
	for _, ln := range p.listeners {
		if addrPortOf(ln.Addr()).Addr() == ip {
			return true
		}
	}
	return false
}

// demand fetches an unknown address from the control plane when on-demand xDS is on, so
// the route is not a passthrough just because the cache had not asked yet.
func (p *Proxy) demand(ctx context.Context, ip netip.Addr) {
	if p.cfg.Demand == nil || p.store.WorkloadByIP(p.cfg.Local.Network, ip) != nil || p.store.ServiceByVIP(p.cfg.Local.Network, ip, "") != nil {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.WorkloadWait)
	defer cancel()
	if err := p.cfg.Demand(ctx, p.cfg.Local.Network, ip); err != nil {
		p.log.Debug("proxy: on-demand lookup", "ip", ip, "err", err)
	}
}

// sourceIP is the address outbound HBONE connections leave from: the source workload's own
// loopback address when it has one (several "pods" on one host, as in the demo), so the
// peer sees which workload connected; otherwise the kernel's choice, as ztunnel does.
func (p *Proxy) sourceIP(src *state.Workload) netip.Addr {
	for _, a := range src.Addresses {
		if a.IsLoopback() {
			return a
		}
	}
	return netip.Addr{}
}
