package proxy

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/reuse"
	"github.com/gozt/gozt/internal/sockopt"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy/outlier"
	"github.com/gozt/gozt/xds/state"
)

// CertSource gives the data plane its TLS configurations. identity/certs.Manager
// implements it; the proxy never sees a CA.
type CertSource interface {
	// ClientConfig is for an outbound HBONE connection presenting src and expecting the
	// server to be one of expected.
	ClientConfig(ctx context.Context, src identity.ID, expected []identity.ID) (*tls.Config, error)
	// ServerConfig is for the HBONE listener; local names the identity to serve a handshake as.
	ServerConfig(local func(*tls.ClientHelloInfo) (identity.ID, error)) *tls.Config
}

// Sockets opens a proxy's listeners and dials its connections. internal/netns.Sockets
// implements it for in-pod mode: every socket inside the pod's network namespace, marked.
type Sockets interface {
	Listen(ctx context.Context, network, address string) (net.Listener, error)
	// Dial connects with d's settings (timeout, local address, Control).
	Dial(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error)
}

// Config is the data plane's configuration. The zero value of each field is its default
// (listeners with an empty address are not started).
type Config struct {
	// Local is what the proxy serves (every workload on Local.Node, or one dedicated
	// workload) and its network.
	Local state.Local

	OutboundAddr         string // 15001
	InboundPlaintextAddr string // 15006
	InboundAddr          string // 15008
	Socks5Addr           string // 15080

	// HBONEClient configures the outbound pool (hbone.NewPool), HBONEServer the inbound
	// HBONE server on 15008 (hbone.NewServer), each taken as given: the caller sets their
	// hooks (HBONEEvents's, to count and log them), how the pool dials (Control or Dial,
	// as the proxy's own dials: PacketMark, Sockets) and which sources relay others'
	// connections (AdmissionConfig.SourceRelays: the network gateways).
	HBONEClient hbone.ClientConfig
	HBONEServer hbone.ServerConfig

	// Sockets opens every listener and dials every plain TCP connection; nil: the
	// process's own sockets. HBONEClient.Dial dials the pool's.
	Sockets Sockets
	// Poller accepts on the listeners and watches idle proxied connections' sockets: the
	// node's (internal/netpoll: on Linux one epoll set for every proxy and DNS proxy of
	// the node, in which idle connections park without a goroutine). nil: a goroutine per
	// listener, and copies that keep their goroutines (netpoll.PerSocket).
	Poller netpoll.Poller

	// PacketMark is SO_MARK on the plain TCP sockets the proxy dials (0 = none); leave it
	// 0 with a Sockets that marks what it opens (internal/netns). HBONEClient.Control
	// marks the pool's.
	PacketMark uint32
	// OrigSrc makes inbound dials to a workload leave from the client's IP (IP_TRANSPARENT),
	// so the application sees who connected. Needs CAP_NET_ADMIN, and for clients on other
	// hosts the policy routing istio-cni installs, or the replies bypass this node.
	OrigSrc     bool
	DialTimeout time.Duration // [10s] plain TCP dials; bounds an outbound connect as a whole, every attempt and CONNECT answer included (HBONEClient.DialTimeout bounds each pool dial within it)
	// ConnectRetries is how many other endpoints of a service an outbound connection tries
	// when its endpoint fails before any byte has moved (ENDPOINT_CONNECT_RETRIES; 0: none,
	// as the Rust ztunnel).
	ConnectRetries int
	// RetryBudget bounds the retries in flight to each service (outlier.RetryBudget); one
	// per node, shared by its proxies. Nil with ConnectRetries: the proxy makes its own.
	RetryBudget *outlier.RetryBudget
	// Outliers, when set, ejects endpoints whose connects keep failing from service picks
	// for a while (ENDPOINT_EJECTION_FAILURES); shared by every proxy of a node.
	Outliers          *outlier.Detector
	KeepaliveDisabled bool
	KeepaliveTime     time.Duration // [180s]
	KeepaliveInterval time.Duration // [180s]
	KeepaliveRetries  int           // [9]
	// UserTimeout, when not zero, is TCP_USER_TIMEOUT on proxied sockets: how long sent
	// data may stay unacknowledged before the kernel drops the connection (the Rust
	// ztunnel's USER_TIMEOUT_ENABLED, time + retries × interval).
	UserTimeout  time.Duration
	WorkloadWait time.Duration // [5s] how long to wait for an unknown local workload to appear
	// Demand, when set (XDS_ON_DEMAND), asks the control plane for an address the cache
	// does not hold and waits for the answer.
	Demand func(ctx context.Context, network string, ip netip.Addr) error
	// Resolver looks up the hostname of a destination workload that has no address (a
	// ServiceEntry with DNS resolution), on demand; nil refuses such destinations.
	Resolver HostResolver
	Logger   *slog.Logger // [slog.Default()]
	// DisableResetPropagation keeps today's Rust ztunnel behaviour: a TCP peer's reset
	// ends the other side with a FIN (END_STREAM), and a connection refused after it was
	// accepted (no route, dial failure, policy) is closed with a FIN. By default a reset is
	// carried as a reset (RFC 9113 §8.5: RST ↔ RST_STREAM(CONNECT_ERROR)) and such a
	// connection gets a reset, so a client can tell a cut stream from a whole one.
	DisableResetPropagation bool
	// DisableBaggage (ENABLE_RESPONSE_BAGGAGE=false) makes inbound HBONE answer without a
	// baggage header describing the destination workload, and ignore the client's baggage
	// when the cache does not know the client (its labels stay unknown), as the Rust
	// ztunnel does with the variable false. Outbound reads a double-HBONE destination's
	// answer whatever it says, as the Rust ztunnel does.
	DisableBaggage bool
	// HandshakeFailure names why an inbound TLS handshake failed, in one word of a bounded
	// set (identity/certs.HandshakeFailure, for the configs it makes), or "" for a
	// connection we closed ourselves; nil: every failure is "other".
	HandshakeFailure func(error) string
}

func (c *Config) setDefaults() {
	if c.DialTimeout == 0 {
		c.DialTimeout = 10 * time.Second
	}
	if c.ConnectRetries > 0 && c.RetryBudget == nil {
		c.RetryBudget = outlier.NewRetryBudget()
	}
	if c.KeepaliveTime == 0 {
		c.KeepaliveTime = 180 * time.Second
	}
	if c.KeepaliveInterval == 0 {
		c.KeepaliveInterval = 180 * time.Second
	}
	if c.KeepaliveRetries == 0 {
		c.KeepaliveRetries = 9
	}
	if c.WorkloadWait == 0 {
		c.WorkloadWait = 5 * time.Second
	}
	if c.Poller == nil {
		c.Poller = netpoll.PerSocket{}
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
}

// Listener names, as in Addrs.
const (
	ListenerOutbound         = "outbound"
	ListenerInboundPlaintext = "inbound_plaintext"
	ListenerInbound          = "inbound"
	ListenerSocks5           = "socks5"
)

// Proxy is a running data plane. Create it with New, bind with Listen, run with Serve, stop
// with Shutdown.
type Proxy struct {
	cfg     Config
	store   *state.Store
	certs   CertSource
	metrics *metrics.Metrics
	log     *slog.Logger

	pool      *hbone.Pool
	server    *hbone.Server
	serverTLS *tls.Config
	dialer    net.Dialer

	listeners  map[string]net.Listener
	conns      tracker
	handshakes summaryLog // by handshake failure reason

	acceptMu      sync.Mutex
	acceptFailing map[string]acceptFailure // guarded by acceptMu: listener -> its last accept error

	watchMu sync.Mutex
	watches []func() // guarded by watchMu: Serve's watches' stops, for Shutdown

	// stopped ends when Shutdown gives up waiting: work still waiting (for a workload to
	// appear, for a dial) stops with it.
	stopped context.Context
	stop    context.CancelFunc

	// Idle connections (idle.go).
	runMu        sync.Mutex
	running      map[*pump]struct{} // guarded by runMu: copy directions on a goroutine
	sweepArmed   bool               // guarded by runMu: sweepTimer will fire
	sweepStopped bool               // guarded by runMu: Shutdown has stopped the sweep
	sweepTimer   *time.Timer        // guarded by runMu: runs sweepIdle
	sweepBuf     []*pump            // guarded by runMu: sweepIdle's, reused
	// parksSinceQuiet, guarded by runMu, counts parks since the sweep last found nothing
	// running: a burst that went idle (release.go).
	parksSinceQuiet int

	testHookLocalWait atomic.Pointer[func()] // if set, called when awaitLocal starts waiting for the store
}

// New builds a proxy; nothing is bound yet.
func New(cfg Config, store *state.Store, certs CertSource, m *metrics.Metrics) *Proxy {
	cfg.setDefaults()
	p := &Proxy{
		cfg:       cfg,
		store:     store,
		certs:     certs,
		metrics:   m,
		log:       cfg.Logger,
		listeners: map[string]net.Listener{},
	}
	p.conns.init()
	p.stopped, p.stop = context.WithCancel(context.Background())
	p.dialer = net.Dialer{Timeout: cfg.DialTimeout, KeepAlive: -1}
	if cfg.PacketMark != 0 {
		p.dialer.Control = sockopt.Control(cfg.PacketMark)
	}
	p.pool = hbone.NewPool(cfg.HBONEClient, func(ctx context.Context, k hbone.Key) (*tls.Config, error) {
		tc, err := certs.ClientConfig(ctx, k.Src, k.Expected())
		if err != nil {
			return nil, fmt.Errorf("%w for %v: %w", errLocalCert, k.Src, err)
		}
		return tc, nil
	})
	p.server = hbone.NewServer(cfg.HBONEServer, p.serveHBONE)
	p.serverTLS = certs.ServerConfig(p.localIdentity)
	return p
}

// Listen binds every configured listener. On error nothing stays bound and the error names
// the listener.
func (p *Proxy) Listen() error {
	for _, l := range []struct{ name, addr string }{
		{ListenerOutbound, p.cfg.OutboundAddr},
		{ListenerInboundPlaintext, p.cfg.InboundPlaintextAddr},
		{ListenerInbound, p.cfg.InboundAddr},
		{ListenerSocks5, p.cfg.Socks5Addr},
	} {
		if l.addr == "" {
			continue
		}
		ln, err := p.listen(l.addr)
		if err == nil && l.name == ListenerInbound {
			// Handshakes past the server's room wait in the kernel's backlog, however the
			// listener is accepted on (hbone's AdmitListener).
			ln = p.server.Admit(ln)
		}
		if err != nil {
			for _, open := range p.listeners {
				open.Close()
			}
			clear(p.listeners)
			return fmt.Errorf("proxy: listen %s on %s: %w", l.name, l.addr, err)
		}
		p.listeners[l.name] = ln
	}
	return nil
}

func (p *Proxy) listen(addr string) (net.Listener, error) {
	if p.cfg.Sockets != nil {
		return p.cfg.Sockets.Listen(context.Background(), "tcp", addr)
	}
	// KeepAlive -1: tuneSocket sets ztunnel's keepalive (or none) once, instead of Go's
	// default being set first and then overwritten on every accepted connection.
	return (&net.ListenConfig{KeepAlive: -1}).Listen(context.Background(), "tcp", addr)
}

// Addrs returns the bound address of each listener by name (ListenerOutbound, ...).
func (p *Proxy) Addrs() map[string]net.Addr {
	out := map[string]net.Addr{}
	for name, ln := range p.listeners {
		out[name] = ln.Addr()
	}
	return out
}

// Serve has the Poller watch every listener and runs the policy watcher on this goroutine
// until ctx ends or Shutdown is called; then it closes the listeners and stops the
// watches. With the node's epoll poller a pod's idle proxy in in-pod mode thus holds this
// one goroutine. Connections may still be draining when it returns.
func (p *Proxy) Serve(ctx context.Context) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	defer context.AfterFunc(p.stopped, cancel)()
	handlers := map[string]func(context.Context, *net.TCPConn){
		ListenerOutbound:         p.serveOutbound,
		ListenerInboundPlaintext: p.servePlaintext,
		ListenerInbound:          p.serveInboundTLS,
		ListenerSocks5:           p.serveSocks5,
	}
	closed := make(chan struct{}) // ends the setup goroutines waiting for a connection
	defer close(closed)
	for name, ln := range p.listeners {
		handle := handlers[name]
		next := make(chan *net.TCPConn) // to a waiting setupLoop
		var failing atomic.Bool         // the last accept failed
		accepted := func(c net.Conn, err error) {
			if err != nil {
				if !failing.Swap(true) {
					p.log.Warn("proxy: accept failing; backing off", "listener", name, "err", err)
				}
				p.acceptFailed(name, err)
				return
			}
			if failing.Swap(false) {
				p.log.Info("proxy: accepting again", "listener", name)
				p.acceptFailed(name, nil)
			}
			p.dispatch(ctx, c.(*net.TCPConn), handle, next, closed)
		}
		stop, err := p.cfg.Poller.Watch(ln, accepted)
		if err != nil {
			p.log.Warn("proxy: cannot watch listener; accepting on a goroutine of its own", "listener", name, "err", err)
			stop, _ = netpoll.PerSocket{}.Watch(ln, accepted)
		}
		defer p.watching(stop)()
		defer ln.Close() // before the stop, as in Shutdown: it ends an accept waiting for room
	}
	p.watchPolicies(ctx)
}

// watching keeps a watch's stop for Shutdown and returns it, callable twice.
func (p *Proxy) watching(stop func()) func() {
	stop = sync.OnceFunc(stop)
	p.watchMu.Lock()
	p.watches = append(p.watches, stop)
	p.watchMu.Unlock()
	return stop
}

// stopWatches stops the watches Serve has started: once it returns, every connection
// accepted on a listener closed before has been handed to dispatch. A watch Serve starts
// later watches a closed listener, which accepts nothing.
func (p *Proxy) stopWatches() {
	p.watchMu.Lock()
	stops := p.watches
	p.watches = nil
	p.watchMu.Unlock()
	for _, stop := range stops {
		stop()
	}
}

// dispatch hands an accepted connection to a setup goroutine waiting for its listener's
// next one, or to a new one. It runs on the Poller's goroutine (the epoll poller's serves
// every listener of the node), so it makes no syscall.
func (p *Proxy) dispatch(ctx context.Context, tc *net.TCPConn, handle func(context.Context, *net.TCPConn), next chan *net.TCPConn, closed <-chan struct{}) {
	select {
	case next <- tc:
	default:
		if !p.conns.goTracked(func() { p.setupLoop(ctx, tc, handle, next, closed) }) {
			tc.Close() // draining
		}
	}
}

// setupIdle is how long a setup goroutine waits for its listener's next connection (a
// variable for tests).
var setupIdle = time.Second

// setupLoop sets up c, then further connections from its listener until none has come for
// setupIdle or the listener has closed. Setup (handshake, routing, tunnel, metrics) grows
// a fresh goroutine's stack twice, from 2 to 8 KiB, and each growth copies the stack and
// walks its frames: about 5% of a SOCKS5 node's CPU under connection churn. A reused
// goroutine has grown its stack already. The copy still starts on a fresh goroutine
// (handOff), so an idle connection keeps a small stack.
func (p *Proxy) setupLoop(ctx context.Context, c *net.TCPConn, handle func(context.Context, *net.TCPConn), next <-chan *net.TCPConn, closed <-chan struct{}) {
	reuse.Loop(c, func(c *net.TCPConn) { p.handleTracked(ctx, c, handle) }, next, closed, setupIdle)
}

// handleTracked registers an accepted connection for the drain deadline before its handler
// runs: a client still in a handshake (SOCKS5 request, original-destination lookup, waiting
// for its workload) is closed at the deadline instead of holding Shutdown until its own
// timeout.
func (p *Proxy) handleTracked(ctx context.Context, c *net.TCPConn, handle func(context.Context, *net.TCPConn)) {
	tc := &liveConn{client: c}
	p.conns.add(tc)
	defer p.conns.remove(tc)
	p.tuneSocket(c)
	handle(ctx, c)
}

// acceptFailure is a listener's last failed accept.
type acceptFailure struct {
	err error
	at  time.Time
}

// acceptErrorFresh is how long a failed accept counts against readiness. Out of file
// descriptors, accept(2) fails at once even with no connection waiting, and once
// descriptors are free again it just waits: no successful accept says the listener has
// recovered, so a failure counts only while retries (at most a second apart) keep failing.
const acceptErrorFresh = 2 * time.Second

// acceptFailed records that the listener's accept failed with err, or (nil) worked again.
func (p *Proxy) acceptFailed(listener string, err error) {
	p.acceptMu.Lock()
	defer p.acceptMu.Unlock()
	if err == nil {
		delete(p.acceptFailing, listener)
		return
	}
	if p.acceptFailing == nil {
		p.acceptFailing = map[string]acceptFailure{}
	}
	p.acceptFailing[listener] = acceptFailure{err, time.Now()}
}

// AcceptError says which listeners cannot accept now and why (out of file descriptors,
// say), or nil: a node whose listeners fail is not ready.
func (p *Proxy) AcceptError() error {
	p.acceptMu.Lock()
	defer p.acceptMu.Unlock()
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(p.acceptFailing)) {
		if f := p.acceptFailing[name]; time.Since(f.at) < acceptErrorFresh {
			errs = append(errs, fmt.Errorf("%s listener: %w", name, f.err))
		}
	}
	return errors.Join(errs...)
}

// tuneSocket applies ztunnel's socket options: TCP_NODELAY (Go's default), keepalive and
// TCP_USER_TIMEOUT.
func (p *Proxy) tuneSocket(c *net.TCPConn) {
	if p.cfg.UserTimeout > 0 {
		if err := sockopt.SetUserTimeout(c, p.cfg.UserTimeout); err != nil {
			p.log.Debug("proxy: user timeout", "err", err)
		}
	}
	if p.cfg.KeepaliveDisabled {
		return
	}
	if err := sockopt.SetKeepalive(c, p.cfg.KeepaliveTime, p.cfg.KeepaliveInterval, p.cfg.KeepaliveRetries); err != nil {
		p.log.Debug("proxy: keepalive", "err", err)
	}
}

// dialTCP dials a plain TCP leg (marked, with keepalive) and returns it as *net.TCPConn so
// the copy can splice.
func (p *Proxy) dialTCP(ctx context.Context, dst netip.AddrPort) (*net.TCPConn, error) {
	return p.dialWith(ctx, &p.dialer, dst)
}

// dialWith dials dst with d, through Config.Sockets when set.
func (p *Proxy) dialWith(ctx context.Context, d *net.Dialer, dst netip.AddrPort) (*net.TCPConn, error) {
	var c net.Conn
	var err error
	if p.cfg.Sockets != nil {
		c, err = p.cfg.Sockets.Dial(ctx, d, "tcp", dst.String())
	} else {
		c, err = d.DialContext(ctx, "tcp", dst.String())
	}
	if err != nil {
		return nil, err
	}
	tc := c.(*net.TCPConn)
	p.tuneSocket(tc)
	return tc, nil
}

// Shutdown drains: the listeners close at once, HBONE peers get GOAWAY, live connections
// may finish until ctx ends, then the rest are closed. It returns once every connection
// goroutine has exited.
//
// A listener closes rather than stop being accepted on, so that it leaves its SO_REUSEPORT
// group (in-pod mode) at once: the kernel sends new connections to the listeners bound
// beside it, a new ztunnel's, and moves those it had queued on it there too
// (net.ipv4.tcp_migrate_req), instead of leaving them in a backlog no one accepts from;
// and a close ends an accept waiting for the HBONE server's room (netpoll.PerSocket's). The
// connections the Poller had accepted before the close are served like live ones.
func (p *Proxy) Shutdown(ctx context.Context) error {
	for _, ln := range p.listeners {
		ln.Close()
	}
	p.stopWatches()
	p.conns.stopAccepting()
	serverDone := make(chan error, 1)
	go func() { serverDone <- p.server.Shutdown(ctx) }()
	drained := p.conns.wait(ctx)
	if !drained {
		p.log.Info("proxy: drain deadline reached; closing live connections", "open", p.conns.count())
		p.stop()
		p.conns.closeAll()
		p.conns.wait(context.Background())
	}
	p.stopSweep() // nothing is parked or running now: every copy has completed
	err := <-serverDone
	p.stop()
	p.server.Close()
	p.pool.Close()
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, context.Canceled) {
		err = nil // forced close is the documented outcome of a missed deadline
	}
	return err
}

// localIdentity is the identity the HBONE listener serves a handshake as: the workload the
// connection was addressed to.
func (p *Proxy) localIdentity(hello *tls.ClientHelloInfo) (identity.ID, error) {
	dst := addrPortOf(hello.Conn.LocalAddr())
	w, err := p.localWorkload(hello.Context(), dst.Addr())
	if err != nil {
		return identity.ID{}, err
	}
	return w.Identity(), nil
}

// localWorkload returns the workload this node serves at ip (Local.WorkloadAt), waiting
// briefly for the control plane when it is not known yet (a new pod's first connection can
// race its xDS push).
func (p *Proxy) localWorkload(ctx context.Context, ip netip.Addr) (*state.Workload, error) {
	return p.awaitLocal(ctx, ip, false)
}

// awaitLocal returns Local.WorkloadAt(ip), or Local.Client(ip) if client, waiting up to
// WorkloadWait for the store to change while it is nil.
func (p *Proxy) awaitLocal(ctx context.Context, ip netip.Addr, client bool) (*state.Workload, error) {
	find := func() *state.Workload {
		if client {
			return p.cfg.Local.Client(p.store, ip)
		}
		return p.cfg.Local.WorkloadAt(p.store, ip)
	}
	if w := find(); w != nil {
		return w, nil
	}
	ctx, cancel := context.WithTimeout(ctx, p.cfg.WorkloadWait)
	defer cancel()
	changes := p.store.Subscribe(ctx)
	if hook := p.testHookLocalWait.Load(); hook != nil {
		(*hook)()
	}
	for {
		if w := find(); w != nil {
			return w, nil
		}
		select {
		case _, ok := <-changes:
			if !ok {
				return nil, p.unknownLocal(ip)
			}
		case <-ctx.Done():
			return nil, p.unknownLocal(ip)
		}
	}
}

// Workload returns the workload a dedicated proxy serves, or nil while it is not known (and
// in node mode). It does not wait: a pod's DNS proxy asks it per query.
func (p *Proxy) Workload() *state.Workload { return p.cfg.Local.DedicatedWorkload(p.store) }

func (p *Proxy) unknownLocal(ip netip.Addr) error {
	if l := p.cfg.Local; l.Dedicated() {
		return fmt.Errorf("proxy: workload %s/%s (PROXY_WORKLOAD_INFO) is not known to this node at %v", l.Workload.Namespace, l.Workload.Name, ip)
	}
	return fmt.Errorf("proxy: no workload of node %q at %v", p.cfg.Local.Node, ip)
}

// originalDst is where a captured connection was going: SO_ORIGINAL_DST after an iptables
// REDIRECT, else the local address (TPROXY, or a connection made straight to a listener).
func originalDst(c *net.TCPConn) netip.AddrPort {
	if dst, err := sockopt.OriginalDst(c); err == nil {
		return dst
	}
	return addrPortOf(c.LocalAddr())
}

func addrPortOf(a net.Addr) netip.AddrPort {
	switch a := a.(type) {
	case *net.TCPAddr:
		ap := a.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	case interface{ AddrPort() netip.AddrPort }:
		ap := a.AddrPort()
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
	}
	ap, _ := netip.ParseAddrPort(a.String())
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// CloseMatching closes the HBONE connections, inbound (served on 15008) and outbound
// (pooled), whose TLS handshake match returns an error for (a peer revoked since, say); the
// streams on them end with that error. inbound tells match which side it judges. It returns
// how many it closed each way.
func (p *Proxy) CloseMatching(match func(inbound bool, cs tls.ConnectionState) error) (inbound, outbound int) {
	inbound = p.server.CloseMatching(func(cs tls.ConnectionState) error { return match(true, cs) })
	outbound = p.pool.CloseMatching(func(cs tls.ConnectionState) error { return match(false, cs) })
	return inbound, outbound
}
