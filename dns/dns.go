// Package dns is ztunnel's DNS proxy (port 15053, UDP and TCP): it answers A and AAAA queries
// for mesh services authoritatively from the xds/state workload cache and forwards every other
// query to the upstream nameservers, as the Rust ztunnel's src/dns/server.rs does, counting
// the istio_dns_* metrics.
//
// Name lookup: the query, its Kubernetes expansions by label count and the query with each
// search domain stripped (plus their expansions) are tried in that order, each first exactly
// and then as wildcards of decreasing specificity (*.b.c, *.c). A service with VIPs answers its
// VIPs on the client's network; a VIP-less service is answered only if it is a Kubernetes
// headless service (hostname under .svc.<cluster domain>), with one IP per endpoint workload.
//
// Drain (Shutdown, a pod's proxy during an upgrade): the sockets leave their SO_REUSEPORT
// groups first, so that the kernel gives every new query to the sockets bound beside them
// and none to one no longer read; then the queries taken are answered (serve.go).
//
// It does not capture traffic (istio-cni redirects port 53 to 15053), enter network
// namespaces, or resolve workload or headless pod hostnames (those are forwarded). Wire
// encoding is github.com/miekg/dns.
package dns

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/miekg/dns"

	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/sockopt"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
)

// Defaults applied to a zero Config.
const (
	DefaultAddr          = "localhost:15053"
	DefaultClusterDomain = "cluster.local"
	DefaultResolvConf    = "/etc/resolv.conf"
	// TCPTimeout bounds one TCP request, including any forwarding (ztunnel's 5 s).
	TCPTimeout = 5 * time.Second
	// DefaultUpstreamTimeout bounds one exchange with one upstream nameserver.
	DefaultUpstreamTimeout = 5 * time.Second
	// TTL is the TTL in seconds of authoritative answers.
	TTL = 30
)

// tcpTimeout is TCPTimeout, shortened by tests.
var tcpTimeout = TCPTimeout

// Config configures a Server. The zero value listens on localhost:15053 in shared mode,
// forwards to /etc/resolv.conf's nameservers and answers AAAA.
type Config struct {
	// Addr is host:port for both UDP and TCP [localhost:15053]. "localhost" binds 127.0.0.1
	// and, if the host has IPv6 loopback, ::1 on the same port.
	Addr string
	// ClusterDomain is the Kubernetes cluster domain [cluster.local].
	ClusterDomain string
	// Local is what this node serves: a query's client workload is Local.Client of the
	// client's address. Answers use the VIPs on the client workload's own network (as
	// ztunnel does), which for a pod on this node is Local.Network.
	Local state.Local
	// Upstreams are nameservers as host[:port] (port 53 if omitted); empty means the
	// nameservers of ResolvConf.
	Upstreams []string
	// ResolvConf is read at Listen for nameservers (when Upstreams is empty) and, with
	// FixedSearch, for the search list (when SearchDomains is nil) [/etc/resolv.conf].
	ResolvConf string
	// FixedSearch gives every client one search list: SearchDomains, or ResolvConf's when
	// nil. A dedicated ztunnel sets it, as it shares its workload's resolv.conf. Without it
	// the search list is per client: <ns>.svc.<domain>, svc.<domain>, <domain>.
	FixedSearch   bool
	SearchDomains []string
	// Source, when set, replaces Local: it returns the client workload for a client address.
	// A nil result answers SERVFAIL, as does a client Local does not serve.
	Source func(client netip.Addr) *state.Workload
	// WorkloadWait, when positive, is how long a query from a client the store does not know
	// yet waits for it to appear before that SERVFAIL (a pod's DNS proxy, whose pod may ask
	// before its workload's xDS push arrives).
	WorkloadWait time.Duration
	// DisableIPv6 suppresses AAAA answers for mesh services (IPV6_ENABLED=false).
	DisableIPv6 bool
	// OwnFamilies answers a mesh name only with addresses of a family the asking client
	// has an address of itself (an IPv4-only pod gets an empty AAAA answer for a
	// dual-stack service, an IPv6-only one an empty A), so that a client that tries the
	// first answer does not wait for a failure before it falls back. Off (the default),
	// every family the service has is answered, as the Rust ztunnel does: a pod without an
	// address of a family may still reach it (istio/ztunnel#1965).
	OwnFamilies bool
	// UpstreamTimeout bounds one exchange with one upstream [5s].
	UpstreamTimeout time.Duration
	// Dial dials upstream nameservers ("udp" or "tcp"); nil uses a net.Dialer. Set it to
	// send upstream queries from the pod's network namespace.
	Dial func(ctx context.Context, network, address string) (net.Conn, error)
	// Listen and ListenPacket open the TCP and UDP listeners; nil uses package net. Set
	// them (internal/netns.Sockets) to serve inside a pod's network namespace. ListenPacket
	// must return a *net.UDPConn.
	Listen       func(ctx context.Context, network, address string) (net.Listener, error)
	ListenPacket func(ctx context.Context, network, address string) (net.PacketConn, error)
	// Poller waits on the sockets: the node's (internal/netpoll), which in-pod mode shares
	// among every pod's DNS proxy; nil: a goroutine per socket (netpoll.PerSocket). Either
	// way the queries are read, framed and answered by the same code.
	Poller netpoll.Poller
	// Logger receives the per-query debug log [slog.Default()], with scope=dns.
	Logger *slog.Logger
}

// Server is the DNS proxy. Create it with New, bind with Listen, run with Serve.
type Server struct {
	cfg        Config
	store      *state.Store
	m          *metrics.Metrics
	log        *slog.Logger
	svcSuffix  string // ".svc.<domain>": VIP-less services under it are headless
	tcpTimeout time.Duration
	dial       func(ctx context.Context, network, address string) (net.Conn, error)

	// ctx is the handlers' context: forwarding stops when Close cancels it.
	ctx    context.Context
	cancel context.CancelFunc

	mu        sync.Mutex
	upstreams []string // set by Listen; read-only afterwards
	search    []string // FixedSearch search list, normalised; set by Listen
	udp       []*net.UDPConn
	tcp       []net.Listener
	conns     map[net.Conn]bool // TCP clients being served: true once one has had an answer
	serving   bool
	closed    bool          // Serve is stopping: no new TCP client
	draining  bool          // Shutdown's drain: TCP clients' reads go on until their queries are answered
	done      chan struct{} // closed when Serve returns (or by Close if Serve never ran)
	// stopping is closed by Shutdown; drain (set before) bounds the wait for the queries in
	// flight. Serve owns what happens next.
	stopping     chan struct{}
	stoppingOnce sync.Once
	drain        context.Context
}

// New returns a Server answering from store. m may be nil (no metrics).
func New(cfg Config, store *state.Store, m *metrics.Metrics) *Server {
	if cfg.Addr == "" {
		cfg.Addr = DefaultAddr
	}
	cfg.ClusterDomain = normalize(cfg.ClusterDomain)
	if cfg.ClusterDomain == "" {
		cfg.ClusterDomain = DefaultClusterDomain
	}
	if cfg.ResolvConf == "" {
		cfg.ResolvConf = DefaultResolvConf
	}
	if cfg.UpstreamTimeout <= 0 {
		cfg.UpstreamTimeout = DefaultUpstreamTimeout
	}
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	s := &Server{
		cfg: cfg, store: store, m: m, log: log.With("scope", "dns"),
		svcSuffix: ".svc." + cfg.ClusterDomain, tcpTimeout: tcpTimeout,
		dial: cfg.Dial,
		done: make(chan struct{}), stopping: make(chan struct{}), drain: context.Background(),
	}
	if s.dial == nil {
		var d net.Dialer
		s.dial = d.DialContext
	}
	var lc net.ListenConfig
	if s.cfg.Listen == nil {
		s.cfg.Listen = lc.Listen
	}
	if s.cfg.ListenPacket == nil {
		s.cfg.ListenPacket = lc.ListenPacket
	}
	s.ctx, s.cancel = context.WithCancel(context.Background())
	return s
}

// normalize lowercases a DNS name and drops the trailing dot.
func normalize(name string) string {
	return strings.ToLower(strings.TrimSuffix(name, "."))
}

// Listen reads the upstream configuration and binds UDP and TCP on Addr (and on ::1 too
// for "localhost"). Port 0 picks one free port shared by all the sockets.
func (s *Server) Listen() error {
	if err := s.loadResolvConf(); err != nil {
		return err
	}
	s.log.Debug("dns: upstreams", "upstreams", s.upstreams, "network", s.cfg.Local.Network,
		"fixed_search", s.cfg.FixedSearch, "search", s.search)
	host, port, err := net.SplitHostPort(s.cfg.Addr)
	if err != nil {
		return fmt.Errorf("dns: listen %s: %w", s.cfg.Addr, err)
	}
	hosts := []string{host}
	if host == "localhost" {
		hosts = []string{"127.0.0.1", "::1"}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return fmt.Errorf("dns: listen %s: %w", s.cfg.Addr, net.ErrClosed)
	}
	if len(s.udp) > 0 {
		return fmt.Errorf("dns: listen %s: already listening", s.cfg.Addr)
	}
	for i, h := range hosts {
		pc, ln, err := s.listenPair(h, port)
		if err != nil {
			if i > 0 && host == "localhost" {
				// IPv6 loopback is optional (IPv4-only hosts and pods).
				s.log.Debug("dns: no IPv6 loopback listener", "error", err)
				continue
			}
			s.closeListenersLocked()
			return fmt.Errorf("dns: listen %s: %w", net.JoinHostPort(h, port), err)
		}
		if port == "0" {
			port = fmt.Sprint(pc.LocalAddr().(*net.UDPAddr).Port)
		}
		s.udp = append(s.udp, pc)
		s.tcp = append(s.tcp, ln)
	}
	return nil
}

// listenPair binds UDP and TCP on the same port; with port 0 it retries when the UDP port
// it got is taken for TCP.
func (s *Server) listenPair(host, port string) (*net.UDPConn, net.Listener, error) {
	ctx := context.Background()
	for attempt := 0; ; attempt++ {
		pc, err := s.cfg.ListenPacket(ctx, "udp", net.JoinHostPort(host, port))
		if err != nil {
			return nil, nil, err
		}
		uc, ok := pc.(*net.UDPConn)
		if !ok {
			pc.Close()
			return nil, nil, fmt.Errorf("ListenPacket returned a %T, not a *net.UDPConn", pc)
		}
		if err := answerFromDst(uc); err != nil {
			uc.Close()
			return nil, nil, err
		}
		p := fmt.Sprint(uc.LocalAddr().(*net.UDPAddr).Port)
		ln, err := s.cfg.Listen(ctx, "tcp", net.JoinHostPort(host, p))
		if err == nil {
			return uc, ln, nil
		}
		uc.Close()
		if port != "0" || attempt == 10 || !errors.Is(err, syscall.EADDRINUSE) {
			return nil, nil, err
		}
	}
}

// answerFromDst has a UDP socket bound to a wildcard report each query's destination, for
// answerUDP to answer from it: the kernel would pick the source by route, and a client that
// asked 127.0.0.2, or one of several addresses of the host, drops an answer from another.
// A socket bound to one address answers from it anyway, so in-pod mode's loopback sockets
// read and write no control message per datagram. Elsewhere than Linux the kernel picks.
func answerFromDst(uc *net.UDPConn) error {
	if !uc.LocalAddr().(*net.UDPAddr).IP.IsUnspecified() {
		return nil
	}
	rc, err := uc.SyscallConn()
	if err != nil {
		return err
	}
	if err := sockopt.SetRecvDst(rc); err != nil && !errors.Is(err, errors.ErrUnsupported) {
		return err
	}
	return nil
}

func (s *Server) closeListenersLocked() {
	for _, pc := range s.udp {
		pc.Close()
	}
	for _, ln := range s.tcp {
		ln.Close()
	}
	s.udp, s.tcp = nil, nil
}

// loadResolvConf fills the upstreams and the FixedSearch search list.
func (s *Server) loadResolvConf() error {
	ups := make([]string, 0, len(s.cfg.Upstreams))
	for _, u := range s.cfg.Upstreams {
		if _, _, err := net.SplitHostPort(u); err != nil {
			u = net.JoinHostPort(strings.Trim(u, "[]"), "53")
		}
		ups = append(ups, u)
	}
	search := s.cfg.SearchDomains
	if len(ups) == 0 || (s.cfg.FixedSearch && search == nil) {
		rc, err := dns.ClientConfigFromFile(s.cfg.ResolvConf)
		if err != nil {
			return fmt.Errorf("dns: read %s: %w", s.cfg.ResolvConf, err)
		}
		if len(ups) == 0 {
			for _, ns := range rc.Servers {
				ups = append(ups, net.JoinHostPort(ns, rc.Port))
			}
			if len(ups) == 0 {
				return fmt.Errorf("dns: no nameserver in %s", s.cfg.ResolvConf)
			}
		}
		if s.cfg.FixedSearch && search == nil {
			search = rc.Search
		}
	}
	var norm []string
	for _, d := range search {
		if d = normalize(d); d != "" {
			norm = append(norm, d)
		}
	}
	s.mu.Lock()
	s.upstreams, s.search = ups, norm
	s.mu.Unlock()
	return nil
}

// Addr returns the first bound UDP address (TCP listens on the same port), or nil before
// Listen.
func (s *Server) Addr() net.Addr {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.udp) == 0 {
		return nil
	}
	return s.udp[0].LocalAddr()
}

// Serve answers queries until ctx ends or Close is called, then stops the listeners and
// waits for in-flight queries. It returns nil on such a stop, or the error of a failed
// watch.
func (s *Server) Serve(ctx context.Context) error {
	s.mu.Lock()
	switch {
	case s.closed:
		s.mu.Unlock()
		return fmt.Errorf("dns: serve: %w", net.ErrClosed)
	case s.serving:
		s.mu.Unlock()
		return errors.New("dns: serve: already serving")
	case len(s.udp) == 0:
		s.mu.Unlock()
		return errors.New("dns: serve: Listen was not called")
	}
	s.serving = true
	s.mu.Unlock()
	defer close(s.done)
	poller := s.cfg.Poller
	if poller == nil {
		poller = netpoll.PerSocket{}
	}
	return s.serve(ctx, poller)
}

// Shutdown drains: it takes the sockets out of their SO_REUSEPORT groups at once (the TCP
// listeners close, the UDP sockets stop taking datagrams), so that the kernel sends every
// new query to the sockets bound beside them, a new ztunnel's; it answers the queries it
// had taken (those queued on its UDP sockets, forwards to the upstream and the queries TCP
// clients have sent included) until ctx ends, then stops as Close does. A draining pod's
// DNS proxy thus neither drops what it has taken nor leaves a socket bound that no one
// reads.
func (s *Server) Shutdown(ctx context.Context) error {
	s.stoppingOnce.Do(func() {
		s.mu.Lock()
		serving := s.serving
		s.drain = ctx
		s.mu.Unlock()
		close(s.stopping)
		if !serving {
			s.Close()
		}
	})
	<-s.done
	return nil
}

// drainCtx is Shutdown's context (Background before it).
func (s *Server) drainCtx() context.Context {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.drain
}

// Close stops Serve and releases the sockets; it returns after Serve has returned.
// It is idempotent.
func (s *Server) Close() error {
	s.cancel()
	s.mu.Lock()
	serving := s.serving
	if !serving && !s.closed {
		s.closeListenersLocked()
		close(s.done)
	}
	s.closed = true
	s.mu.Unlock()
	<-s.done
	return nil
}
