package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"strings"
	"syscall"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/sockopt"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy/rbac"
	"github.com/gozt/gozt/xds/state"
)

// origDstConn presents a redirected connection with the address the client dialed as its
// local address, so TLS certificate selection and HBONE destination checks see the pod,
// not the listener.
type origDstConn struct {
	*net.TCPConn
	dst net.Addr
}

func (c *origDstConn) LocalAddr() net.Addr { return c.dst }

// TCP lets hbone hand the socket to kernel TLS (ktls.TCPWrapper).
func (c *origDstConn) TCP() *net.TCPConn { return c.TCPConn }

// withOrigDst wraps c when iptables REDIRECT changed its destination.
func withOrigDst(c *net.TCPConn) net.Conn {
	dst := originalDst(c)
	if dst == addrPortOf(c.LocalAddr()) {
		return c
	}
	return &origDstConn{TCPConn: c, dst: net.TCPAddrFromAddrPort(dst)}
}

// serveInboundTLS serves one connection accepted on 15008: mTLS, then HTTP/2 CONNECT
// streams, each handled by serveHBONE. handleTracked has registered c for the drain deadline.
func (p *Proxy) serveInboundTLS(ctx context.Context, c *net.TCPConn) {
	err := p.server.ServeTLS(ctx, withOrigDst(c), p.serverTLS)
	var he *hbone.HandshakeError
	if errors.As(err, &he) {
		p.handshakeFailed(c.RemoteAddr(), he.Err)
		return
	}
	if err != nil && !cleanEnd(err) {
		p.log.Debug("proxy: inbound hbone connection", "peer", c.RemoteAddr(), "err", err)
	}
}

// inboundError is an HBONE request failure with the status it answers and its flag.
type inboundError struct {
	code int
	flag string
	err  error
}

func (e *inboundError) Error() string { return e.err.Error() }

func reject(code int, flag, format string, args ...any) *inboundError {
	return &inboundError{code: code, flag: flag, err: fmt.Errorf(format, args...)}
}

// inboundTarget is where an inbound request goes, once validated.
type inboundTarget struct {
	dst     *state.Workload
	svc     *state.Service
	addr    netip.AddrPort // the workload address and target port the client asked for
	dial    netip.AddrPort // what is dialed (differs for an application tunnel)
	tunnel  bool           // prefix the upstream with a PROXY v2 header
	connDst netip.Addr     // the address the HBONE connection itself was sent to
}

// policyView is what authorization policy sees of a connection to t.
func (t *inboundTarget) policyView(peer identity.ID, src netip.Addr) rbac.Conn {
	return rbac.Conn{Peer: peer, SrcIP: src, DstIP: t.addr.Addr(), DstPort: t.addr.Port()}
}

// serveHBONE answers one CONNECT stream: validate, authorize, dial, then 200 and copy.
// Status codes as ztunnel: 400 bad target, 401 denied, 503 unknown or unreachable.
//
// A stream the peer reset before it was answered gets no record: hbone counted it (see
// onDrop), and a flood of them must cost the node as little as possible.
func (p *Proxy) serveHBONE(r *hbone.Request) {
	ctx := r.Context() // ends with the stream, the connection or the proxy
	client := addrPortOf(r.RemoteAddr)
	labels := metrics.Labels{
		Reporter:                 metrics.ReporterDest,
		SourcePrincipal:          r.Peer.String(),
		ConnectionSecurityPolicy: metrics.MutualTLS,
	}
	log := metrics.ConnLog{SrcAddr: client.String(), DstAddr: r.LocalAddr.String(), HBONEAddr: r.Authority, Direction: "inbound"}
	if n := r.Header.Get(forwardedNetworkHeader); n != "" && !strings.EqualFold(n, p.cfg.Local.Network) {
		// Double HBONE through a gateway: the client is on network n, and the address the
		// connection came from is the gateway's, so the source is known by its baggage only.
		log.SrcNetwork = n
		p.inboundSourceLabels(&labels, r.Peer, netip.Addr{}, p.peerBaggage(r.Header))
	} else {
		p.inboundSourceLabels(&labels, r.Peer, client.Addr(), p.peerBaggage(r.Header))
	}
	failed := func(flag string, err error) {
		if !errors.Is(context.Cause(ctx), hbone.ErrPeerReset) {
			p.metrics.Open(labels, log).Close(0, 0, flag, err)
		}
	}

	t, ierr := p.inboundTarget(ctx, r.Authority, addrPortOf(r.LocalAddr).Addr())
	if ierr == nil {
		destLabels(&labels, t.dst, t.svc)
		labels.DestinationPrincipal = t.dst.Identity().String()
		ierr = p.authorize(t, r.Peer, client.Addr())
	}
	if ierr != nil {
		r.Reject(ierr.code)
		failed(ierr.flag, ierr.err)
		return
	}
	up, err := p.dialInbound(ctx, t, client, r.Peer)
	if err != nil {
		r.Reject(http.StatusServiceUnavailable)
		failed(metrics.FlagConnect, err)
		return
	}
	var resp http.Header
	if b := baggage(t.dst); b != "" && !p.cfg.DisableBaggage {
		resp = http.Header{"Baggage": []string{b}}
	}
	s, err := r.Accept(resp)
	if err != nil {
		up.Close()
		failed(metrics.FlagConnect, err)
		return
	}
	p.proxyInbound(s, up, t, t.policyView(r.Peer, client.Addr()), labels, log)
}

// proxyInbound copies an accepted inbound connection and records it; it owns client and
// up from the call on, and returns once the copy has been handed off. The connection stays
// registered for policy re-checks while it lives.
func (p *Proxy) proxyInbound(client halfCloser, up *net.TCPConn, t *inboundTarget, attrs rbac.Conn, labels metrics.Labels, log metrics.ConnLog) {
	tc := &liveConn{dst: t.dst, attrs: attrs, inbound: true} // attrs' destination is t.addr
	p.metrics.OpenAt(&tc.rec, labels, log)
	p.handOff(tc, client, up)
	// A policy change between the caller's authorization and handOff's registration was
	// missed by watchPolicies; now that the connection is registered, one more check closes
	// that gap.
	if !rbac.Check(p.store.PoliciesFor(t.dst), attrs).Allow {
		tc.denied.Store(true)
		tc.close()
	}
}

// inboundTarget validates an HBONE authority against the connection it came on.
func (p *Proxy) inboundTarget(ctx context.Context, authority string, connDst netip.Addr) (*inboundTarget, *inboundError) {
	local, err := p.localWorkload(ctx, connDst)
	if err != nil {
		return nil, reject(http.StatusServiceUnavailable, metrics.FlagConnect, "%w", err)
	}
	t := &inboundTarget{connDst: connDst}
	host, portStr, err := net.SplitHostPort(authority)
	if err != nil {
		return nil, reject(http.StatusBadRequest, metrics.FlagConnect, "proxy: bad authority %q: %v", authority, err)
	}
	port64, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil {
		return nil, reject(http.StatusBadRequest, metrics.FlagConnect, "proxy: bad port in authority %q", authority)
	}
	port := uint16(port64)
	if ip, err := netip.ParseAddr(host); err == nil {
		ip = ip.Unmap()
		t.addr = netip.AddrPortFrom(ip, port)
		if ip != connDst && local.AppTunnel == nil && !p.isWaypointFor(local, ip) {
			return nil, reject(http.StatusBadRequest, metrics.FlagConnect, "proxy: HBONE target %v is not the address the connection was sent to (%v)", ip, connDst)
		}
		t.dst = local
		if !local.HasAddress(ip) {
			if w := p.store.WorkloadByIP(p.cfg.Local.Network, ip); w != nil {
				t.dst = w
			}
		}
	} else {
		// hostname:port: a service by hostname, preferring the local workload's namespace.
		svc := p.store.ServiceByHostname(strings.TrimSuffix(host, "."), local.Namespace)
		if svc == nil {
			return nil, reject(http.StatusServiceUnavailable, metrics.FlagConnect, "proxy: unknown service %q", host)
		}
		target, ok := svc.Ports[port]
		if !ok {
			return nil, reject(http.StatusServiceUnavailable, metrics.FlagConnect, "proxy: service %s has no port %d", host, port)
		}
		if tp := local.Services[svc.Key()][port]; tp != 0 {
			target = tp
		}
		if target == 0 {
			target = port
		}
		t.svc, t.dst = svc, local
		t.addr = netip.AddrPortFrom(connDst, target)
		if len(local.Addresses) > 0 && !local.HasAddress(connDst) {
			t.addr = netip.AddrPortFrom(local.Addresses[0], target)
		}
	}
	if ztunnelPorts[t.addr.Port()] {
		return nil, reject(http.StatusServiceUnavailable, metrics.FlagConnect, "proxy: target port %d is one of ztunnel's own", t.addr.Port())
	}
	t.dial = t.addr
	if at := t.dst.AppTunnel; at != nil && at.Protocol == state.AppTunnelProxy && at.Port != 0 {
		t.dial = netip.AddrPortFrom(netip.MustParseAddr("127.0.0.1"), at.Port)
		t.tunnel = true
	}
	if p.isSelfCall(t.dial) { // a listener on a configured port: dialing it would loop
		return nil, reject(http.StatusServiceUnavailable, metrics.FlagConnect, "proxy: target %v is one of this proxy's own listeners", t.dial)
	}
	if t.svc == nil {
		t.svc = p.serviceFor(t.dst, t.addr.Port())
	}
	return t, nil
}

// isWaypointFor reports whether local is the waypoint of the workload or service at ip
// (a "sandwiched" waypoint receives traffic addressed to what it fronts).
func (p *Proxy) isWaypointFor(local *state.Workload, ip netip.Addr) bool {
	matches := func(g *state.GatewayAddress) bool {
		return g != nil && g.Address.IsValid() && local.HasAddress(g.Address)
	}
	if w := p.store.WorkloadByIP(p.cfg.Local.Network, ip); w != nil && matches(w.Waypoint) {
		return true
	}
	if s := p.store.ServiceByVIP(p.cfg.Local.Network, ip, local.Namespace); s != nil && matches(s.Waypoint) {
		return true
	}
	return false
}

// serviceFor guesses the service a workload was reached through, for metric labels.
func (p *Proxy) serviceFor(w *state.Workload, port uint16) *state.Service {
	for key, ports := range w.Services {
		for svcPort, target := range ports {
			if target == port || svcPort == port {
				return p.store.ServiceByKey(key)
			}
		}
	}
	return nil
}

// authorize applies the destination workload's policies.
func (p *Proxy) authorize(t *inboundTarget, peer identity.ID, src netip.Addr) *inboundError {
	d := rbac.Check(p.store.PoliciesFor(t.dst), t.policyView(peer, src))
	if d.Allow {
		return nil
	}
	return reject(http.StatusUnauthorized, metrics.FlagDeny, "proxy: %s", d.String())
}

// dialInbound connects to the destination workload, with a PROXY v2 header naming the
// client and its identity when the workload has an application tunnel.
func (p *Proxy) dialInbound(ctx context.Context, t *inboundTarget, client netip.AddrPort, peer identity.ID) (*net.TCPConn, error) {
	var up *net.TCPConn
	var err error
	if p.cfg.OrigSrc && client.IsValid() && !t.tunnel {
		up, err = p.dialTransparent(ctx, t.dial, client.Addr())
	} else {
		up, err = p.dialTCP(ctx, t.dial)
	}
	if err != nil {
		return nil, fmt.Errorf("proxy: dial %v: %w", t.dial, err)
	}
	if t.tunnel {
		if _, err := up.Write(proxyV2Header(client, t.addr, peer)); err != nil {
			up.Close()
			return nil, fmt.Errorf("proxy: PROXY header to %v: %w", t.dial, err)
		}
	}
	return up, nil
}

// dialTransparent dials dst from the client's address (IP_TRANSPARENT + IP_FREEBIND).
func (p *Proxy) dialTransparent(ctx context.Context, dst netip.AddrPort, src netip.Addr) (*net.TCPConn, error) {
	d := p.dialer
	d.LocalAddr = &net.TCPAddr{IP: src.AsSlice()}
	d.Control = func(network, address string, c syscall.RawConn) error {
		if err := sockopt.SetTransparent(c, src.Is6()); err != nil {
			return err
		}
		return sockopt.Control(p.cfg.PacketMark)(network, address, c)
	}
	return p.dialWith(ctx, &d, dst)
}

// inboundSourceLabels fills the source labels from the client's workload when the cache
// knows it and its identity is the peer's, else (and when client is the zero Addr) from
// the peer's baggage.
func (p *Proxy) inboundSourceLabels(l *metrics.Labels, peer identity.ID, client netip.Addr, bag string) {
	if !peer.IsZero() {
		l.SourceWorkloadNamespace = peer.Namespace()
	}
	if w := p.store.WorkloadByIP(p.cfg.Local.Network, client); w != nil && w.Identity() == peer {
		sourceLabels(l, w)
		return
	}
	if bag == "" {
		return
	}
	b := parseBaggage(bag)
	l.SourceCluster = b.cluster
	if b.namespace != "" {
		l.SourceWorkloadNamespace = b.namespace
	}
	l.SourceWorkload = b.workload
	l.SourceCanonicalService = b.service
	l.SourceCanonicalRevision = b.version
	l.SourceApp, l.SourceVersion = l.SourceCanonicalService, l.SourceCanonicalRevision
	l.SourceRegion, l.SourceZone = b.region, b.zone
}

// peerBaggage is the client's baggage header, unless DisableBaggage.
func (p *Proxy) peerBaggage(h http.Header) string {
	if p.cfg.DisableBaggage {
		return ""
	}
	return h.Get("Baggage")
}

// servePlaintext handles a connection captured on 15006: policy with no peer identity,
// then plain TCP to the workload.
func (p *Proxy) servePlaintext(ctx context.Context, c *net.TCPConn) {
	dst := originalDst(c)
	client := addrPortOf(c.RemoteAddr())
	labels := metrics.Labels{Reporter: metrics.ReporterDest}
	log := metrics.ConnLog{SrcAddr: client.String(), DstAddr: dst.String(), Direction: "inbound"}
	if w := p.store.WorkloadByIP(p.cfg.Local.Network, client.Addr()); w != nil {
		sourceLabels(&labels, w)
	}
	t, ierr := p.inboundTarget(ctx, dst.String(), dst.Addr())
	if ierr == nil {
		destLabels(&labels, t.dst, t.svc)
		ierr = p.authorize(t, identity.ID{}, client.Addr())
	}
	if ierr != nil {
		p.refuse(c)
		p.metrics.Open(labels, log).Close(0, 0, ierr.flag, ierr.err)
		return
	}
	up, err := p.dialInbound(ctx, t, client, identity.ID{})
	if err != nil {
		p.refuse(c)
		p.metrics.Open(labels, log).Close(0, 0, metrics.FlagConnect, err)
		return
	}
	p.proxyInbound(c, up, t, t.policyView(identity.ID{}, client.Addr()), labels, log)
}
