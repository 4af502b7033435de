package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gozt/gozt/dns"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/inpod"
	"github.com/gozt/gozt/inpod/podproxy"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/sockopt"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/metrics/otlp"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/proxy/outlier"
	"github.com/gozt/gozt/xds"
	"github.com/gozt/gozt/xds/state"
)

// ztunnel is one running ztunnel, in any mode: what run starts, in one place, so tests can
// start several in one process and look at their bound addresses. (Not "node": that is
// PROXY_MODE=node, and the machine whose pods it serves.)
type ztunnel struct {
	cfg      *config
	local    state.Local // what this node serves: cfg.local()
	logLevel *logLevels
	ready    *readiness
	registry *prometheus.Registry
	metrics  *metrics.Metrics
	store    *state.Store
	outliers *outlier.Detector    // shared by every proxy of the node; nil with ENDPOINT_EJECTION_FAILURES=0
	retries  *outlier.RetryBudget // shared by every proxy of the node; nil with ENDPOINT_CONNECT_RETRIES=0
	otlp     *otlp.Exporter       // the access log's OTLP export; nil without ACCESS_LOG_OTLP_ENDPOINT
	xds      *xds.Client          // nil without XDS_ADDRESS
	certs    *certs.Manager
	spire    bool           // CA_PROVIDER=spire: certificates per workload (spire.go)
	crl      *certs.CRL     // nil without CRL_PATH
	resolver *dns.Resolver  // hostname-only workloads' on-demand DNS; nil without a nameserver
	poller   netpoll.Poller // every proxy's and DNS proxy's sockets, in every mode
	proxy    *proxy.Proxy   // the node's own listeners (node and dedicated mode); nil in in-pod mode
	self     *proxy.Proxy   // in-pod mode: ztunnel's own 15008 (selfproxy.go); nil if not named
	inpod    *inpod.Manager // in-pod (shared) mode only
	pods     *podproxy.Set  // in-pod mode: the pods' proxies the Manager drives
	servers  []*http.Server // admin, stats and readiness (startHTTP)

	quitOnce sync.Once
	quit     chan struct{} // closed by POST /quitquitquit

	// Background work (config sources, certificate prefetch, the metrics sweep, node mode's
	// DNS proxy) runs on goroutines of bgWG until stopBG ends bg (goBG).
	bg     context.Context
	stopBG context.CancelFunc
	bgWG   sync.WaitGroup

	addrs map[string]net.Addr // bound listener addresses by setting name, e.g. "ADMIN_ADDR"
}

// Readiness tasks.
const (
	taskState  = "state manager"
	taskCerts  = "certificates"
	taskInpod  = "workload manager"
	taskAccept = "listeners"
)

// run starts a node and blocks until ctx ends or /quitquitquit is called, then drains:
// listeners stop, HBONE peers get GOAWAY, live connections have CONNECTION_TERMINATION_DEADLINE
// to finish. started, if not nil, is called once every listener is bound.
//
// Its phases: construct (what every mode shares: metrics, the background goroutines, the
// config sources, the CA client and certificates), start the node's proxies (node and
// dedicated mode's listeners and DNS proxy, or in-pod mode's workload manager, pod proxies
// and self-proxy), start the admin, metrics and readiness servers, then serve until told to
// stop. Whatever a phase starts goes on one cleanup stack, and the drain is that stack
// run, last first, under CONNECTION_TERMINATION_DEADLINE: the proxies drain first, the
// HTTP servers answer until they have (their cleanup is pushed before the proxies start),
// the background goroutines and the certificates go last. A failed start runs it too.
func run(ctx context.Context, cfg *config, logLevel *logLevels, started func(*ztunnel)) error {
	if limit, err := sockopt.RaiseFileLimit(); err != nil {
		slog.Warn("could not raise the open-file limit", "err", err)
	} else {
		slog.Debug("open-file limit", "soft", limit)
	}
	n := newZtunnel(cfg, logLevel)
	var undo cleanups
	defer undo.run(cfg.TerminationDeadline) // a failed start; after a drain, nothing is left
	if err := n.construct(ctx, &undo); err != nil {
		return err
	}
	undo.pushDrain(n.stopHTTP) // below the proxies': readiness and metrics answer through their drain
	start := n.startNodeMode
	if n.local.Mode == state.ModeShared {
		start = n.startInPod
	}
	if err := start(&undo); err != nil {
		return err
	}
	if err := n.startHTTP(); err != nil {
		return err
	}
	n.serve(ctx, started)
	slog.Info("draining", "deadline", cfg.TerminationDeadline)
	err := undo.run(cfg.TerminationDeadline)
	slog.Info("ztunnel stopped")
	return err
}

// cleanups is a stack of what to undo when run returns: each entry undoes one thing a
// phase started, within the drain's context.
type cleanups []func(drain context.Context) error

// push adds f, which undoes its thing at once.
func (c *cleanups) push(f func()) {
	*c = append(*c, func(context.Context) error { f(); return nil })
}

// pushDrain adds f, which undoes its thing within drain (a proxy's connections finish, or
// are closed at its deadline).
func (c *cleanups) pushDrain(f func(drain context.Context) error) { *c = append(*c, f) }

// run undoes everything pushed, last first, within one deadline from now, and returns
// what failed.
func (c *cleanups) run(deadline time.Duration) error {
	drain, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	var errs []error
	for i := len(*c) - 1; i >= 0; i-- {
		errs = append(errs, (*c)[i](drain))
	}
	*c = nil
	return errors.Join(errs...)
}

func newZtunnel(cfg *config, logLevel *logLevels) *ztunnel {
	n := &ztunnel{
		cfg:      cfg,
		local:    cfg.local(),
		logLevel: logLevel,
		ready:    newReadiness(),
		registry: prometheus.NewRegistry(),
		quit:     make(chan struct{}),
		addrs:    map[string]net.Addr{},
		store: state.NewStoreWith(state.Options{Network: cfg.Network, PreferredServiceNamespace: cfg.PreferredServiceNamespace,
			UnhealthyFallback: cfg.UnhealthyFallback}),
	}
	if cfg.EjectionFailures > 0 {
		n.outliers = outlier.New(outlier.Config{Failures: cfg.EjectionFailures})
	}
	if cfg.ConnectRetries > 0 {
		n.retries = outlier.NewRetryBudget()
	}
	accessLog := slog.Default()
	if cfg.AccessLogOTLP.Endpoint != "" {
		oc := cfg.AccessLogOTLP
		oc.Scope, oc.Resource = "access", otlpResource(cfg)
		exp, err := otlp.New(oc)
		if err != nil {
			slog.Error("ACCESS_LOG_OTLP_ENDPOINT: access log not exported", "err", err)
		} else {
			n.otlp = exp
			accessLog = slog.New(slog.NewMultiHandler(accessLog.Handler(), exp.Handler()))
		}
	}
	accessLog = accessLog.With("scope", "access") // after the split: exported records carry it too
	mopts := []metrics.Option{
		metrics.WithAccessLog(accessLog),
		metrics.WithAccessLogFilter(cfg.AccessLog),
		metrics.WithDroppedLabels(cfg.DropLabels),
	}
	if n.local.Mode == state.ModeShared {
		mopts = append(mopts, metrics.WithWorkloadManager())
	}
	n.metrics = metrics.New(n.registry, version, mopts...)
	n.bg, n.stopBG = context.WithCancel(context.Background())
	return n
}

// otlpResource names this process in exported records, with OpenTelemetry's attribute names.
func otlpResource(cfg *config) []otlp.KeyValue {
	attrs := []otlp.KeyValue{{Key: "service.name", Value: "ztunnel"}, {Key: "service.version", Value: version}}
	for _, kv := range []otlp.KeyValue{{Key: "k8s.node.name", Value: cfg.NodeName}, {Key: "k8s.pod.name", Value: cfg.PodName}, {Key: "k8s.namespace.name", Value: cfg.PodNamespace}} {
		if kv.Value != "" {
			attrs = append(attrs, kv)
		}
	}
	return attrs
}

// goBG runs fn on a background goroutine until the node stops (n.bg ends), logging its
// error if it stops before that.
func (n *ztunnel) goBG(name string, fn func(context.Context) error) {
	n.bgWG.Go(func() {
		if err := fn(n.bg); err != nil && n.bg.Err() == nil {
			slog.Error("stopped", "component", name, "err", err)
		}
	})
}

// construct starts what every mode shares: the config sources, the CA client, the CRL and
// the certificate manager, and the background goroutines. Those start only once their
// stop is pushed, after the certificates' close: a drain stops them first (prefetch and
// SPIRE subscriptions use the certificates).
func (n *ztunnel) construct(ctx context.Context, undo *cleanups) error {
	if n.otlp != nil { // first in, last out: after the proxies' last records
		undo.push(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			if err := n.otlp.Shutdown(ctx); err != nil {
				slog.Warn("access log: OTLP export did not flush", "err", err)
			}
		})
	}
	// One poller for the node's sockets: every proxy's and DNS proxy's listeners, and the
	// idle connections parked in it. Closed once all of them have stopped.
	var err error
	if n.poller, err = netpoll.New(); err != nil {
		return err
	}
	undo.push(func() { n.poller.Close() })
	startSources, err := n.openConfigSources()
	if err != nil {
		return err
	}
	caClient, err := ca.New(ctx, caConfig(n.cfg))
	if err != nil {
		return err
	}
	undo.push(func() { caClient.Close() })
	if n.cfg.CRLPath != "" {
		if n.crl, err = certs.OpenCRL(n.cfg.CRLPath, nil); err != nil {
			return fmt.Errorf("CRL_PATH: %w", err)
		}
		undo.push(func() { n.crl.Close() }) // Watch starts in serve, once the proxies its callback closes exist
		n.registry.MustRegister(crlCollector{n.crl})
	}
	csrFailures := newCSRFailures()
	certsCfg := certs.Config{PQCOnly: n.cfg.Compliance == "pqc", TLS12: n.cfg.TLS12Enabled, CRL: n.crl,
		OnFetchFailure: func(reason string) { csrFailures.WithLabelValues(reason).Inc() }}
	if _, n.spire = caClient.(*ca.Delegated); n.spire {
		certsCfg.OnWithdraw = n.closeWithdrawn
	}
	n.certs = certs.New(certsCfg, caClient)
	undo.push(func() { n.certs.Close() })
	n.registry.MustRegister(csrFailures, certCollector{n.certs})
	undo.push(func() {
		n.stopBG()
		n.bgWG.Wait()
	})
	startSources()
	n.goBG("metrics sweep", n.forgetGoneWorkloads)
	if n.resolver, err = dns.NewResolver(dns.ResolverConfig{}); err != nil {
		slog.Warn("workloads known only by hostname cannot be reached: no nameserver for on-demand DNS", "err", err)
	}
	return nil
}

// startNodeMode binds node and dedicated mode's DNS proxy and listeners (unless none is
// configured) and serves them, and starts prefetching the served workloads' certificates.
// The DNS proxy's cleanup is pushed first, so it answers until the proxy has drained.
func (n *ztunnel) startNodeMode(undo *cleanups) error {
	cfg := n.cfg
	if cfg.DNSProxyAddr != "" {
		d := dns.New(n.dnsConfig(n.local), n.store, n.metrics)
		if err := d.Listen(); err != nil {
			return fmt.Errorf("DNS_PROXY_ADDR: %w", err)
		}
		undo.push(func() { d.Close() })
		n.addrs["DNS_PROXY_ADDR"] = d.Addr()
		n.goBG("dns proxy", d.Serve)
	}
	pcfg := n.proxyConfig(n.local, slog.Default(), nil)
	if n.xds != nil && cfg.XDSOnDemand {
		pcfg.Demand = n.xds.DemandAddress
	}
	n.withResolver(&pcfg)
	n.proxy = proxy.New(pcfg, n.store, n.certs, n.metrics)
	if err := n.serveProxy(n.proxy, cfg.enableProxy(), undo); err != nil {
		return err
	}
	if cfg.enableProxy() {
		for name, a := range n.proxy.Addrs() {
			n.addrs[proxyListenerEnv[name]] = a
		}
		n.ready.watch(taskAccept, n.proxy.AcceptError) // out of file descriptors, say
		if n.spire {
			n.ready.watch(taskCerts, n.spireReady)
			n.goBG("SPIRE subscriptions", n.subscribeWorkloads)
		} else {
			n.ready.add(taskCerts)
			n.goBG("certificate prefetch", n.prefetchCertificates)
		}
	}
	return nil
}

// serveProxy binds p's listeners (if listen) and serves them until undo drains it: p shuts
// down within the drain's deadline, then its Serve stops (Serve's context is its
// connections', so it must outlive the drain). A proxy that cannot bind is shut down at
// once.
func (n *ztunnel) serveProxy(p *proxy.Proxy, listen bool, undo *cleanups) error {
	if listen {
		if err := p.Listen(); err != nil {
			p.Shutdown(context.Background())
			return err
		}
	}
	ctx, stop := context.WithCancel(context.Background())
	served := make(chan struct{})
	go func() {
		defer close(served)
		p.Serve(ctx)
	}()
	undo.pushDrain(func(drain context.Context) error {
		err := p.Shutdown(drain)
		stop()
		<-served
		return err
	})
	return nil
}

// startInPod starts in-pod mode: no node-level listeners (every pod's open inside its
// netns, inpod/podproxy), ztunnel's own 15008 if the chart named its pod, certificate
// prefetch, and the workload manager, over which the pods arrive from istio-cni's node
// agent.
func (n *ztunnel) startInPod(undo *cleanups) error {
	if err := netns.CheckCapabilities(); err != nil {
		return fmt.Errorf("PROXY_MODE=shared (in-pod) cannot enter pod namespaces or mark sockets: %w", err)
	}
	n.pods = newPodProxies(n)
	undo.push(n.pods.Close) // waits for the pods' drains the workload manager's Close began
	if self, ok := newSelfProxy(n, undo); ok {
		if err := n.serveProxy(self, true, undo); err != nil {
			return fmt.Errorf("self-proxy (POD_NAME, POD_NAMESPACE, SERVICE_ACCOUNT): %w", err)
		}
		n.self = self
		n.addrs["SELF_PROXY"] = self.Addrs()[proxy.ListenerInbound]
	}
	if n.spire {
		n.ready.watch(taskCerts, n.spireReady)
	} else {
		n.ready.add(taskCerts)
		n.goBG("certificate prefetch", n.prefetchCertificates)
	}
	n.inpod = inpod.New(inpod.Config{Path: n.cfg.InpodUDS, Metrics: n.metrics}, n.pods)
	undo.push(func() { n.inpod.Close() }) // drains every pod's proxy, each within CONNECTION_TERMINATION_DEADLINE
	n.ready.watch(taskInpod, n.inpodReady)
	n.ready.watch(taskAccept, func() error {
		if n.self != nil {
			return errors.Join(n.self.AcceptError(), n.pods.AcceptError())
		}
		return n.pods.AcceptError()
	})
	return nil
}

// serve runs until ctx ends or /quitquitquit: the proxies and the workload manager run
// already, and a CRL reload now closes their connections to revoked peers.
func (n *ztunnel) serve(ctx context.Context, started func(*ztunnel)) {
	if n.crl != nil {
		n.crl.Watch(n.closeRevoked)
	}
	slog.Info("ztunnel started", "version", version, "mode", n.local.Mode, "threads", runtime.GOMAXPROCS(0), "listeners", n.listenerSummary(), "fips140", currentFIPS().logValue())
	if started != nil {
		started(n)
	}
	select {
	case <-ctx.Done():
	case <-n.quit:
	}
}

// openConfigSources loads the local file (synchronously: a bad file stops the start) and
// makes the xDS client; start runs them on background goroutines.
func (n *ztunnel) openConfigSources() (start func(), err error) {
	cfg := n.cfg
	if cfg.LocalXDSPath == "" && cfg.XDSAddress == "" {
		return nil, errors.New("config: no workload source: set LOCAL_XDS_PATH (a local YAML file) or XDS_ADDRESS (a control plane)")
	}
	var file *xds.FileSource
	if cfg.LocalXDSPath != "" {
		if file, err = xds.LoadFile(cfg.LocalXDSPath, n.store); err != nil {
			return nil, fmt.Errorf("LOCAL_XDS_PATH: %w", err)
		}
	}
	if cfg.XDSAddress != "" {
		xc := xdsConfig(cfg)
		xc.OnError = func(err error) { n.ready.failed(taskState, err) }
		if n.xds, err = xds.NewClient(xc, n.store, n.metrics); err != nil {
			return nil, fmt.Errorf("XDS_ADDRESS: %w", err)
		}
		n.ready.add(taskState)
	}
	return func() {
		if file != nil {
			n.goBG("local config", file.Run)
		}
		if client := n.xds; client != nil {
			n.goBG("xds", client.Run)
			n.goBG("xds readiness", func(ctx context.Context) error {
				select {
				case <-client.Synced():
					n.ready.done(taskState)
				case <-ctx.Done():
				}
				return nil
			})
		}
	}, nil
}

// startHTTP binds and serves the admin, stats and readiness servers (n.servers), which
// stopHTTP shuts down.
func (n *ztunnel) startHTTP() error {
	for _, l := range []struct {
		name, addr string
		h          http.Handler
	}{
		{"ADMIN_ADDR", n.cfg.AdminAddr, adminHandler(n.logLevel, n.configDump, n.requestQuit)},
		{"STATS_ADDR", n.cfg.StatsAddr, n.metrics.Handler()},
		{"READINESS_ADDR", n.cfg.ReadinessAddr, n.ready},
	} {
		if l.addr == "" {
			continue
		}
		ln, err := net.Listen("tcp", l.addr)
		if err != nil {
			return fmt.Errorf("listen %s=%s: %w", l.name, l.addr, err)
		}
		n.addrs[l.name] = ln.Addr()
		srv := &http.Server{Handler: l.h, ReadHeaderTimeout: 2 * time.Second}
		n.servers = append(n.servers, srv)
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				slog.Error("http server", "listener", l.name, "err", err)
			}
		}()
	}
	return nil
}

// stopHTTP shuts the HTTP servers down, letting requests in flight finish within drain.
func (n *ztunnel) stopHTTP(drain context.Context) error {
	for _, s := range n.servers {
		_ = s.Shutdown(drain)
		s.Close()
	}
	return nil
}

// proxies are the node's own proxies: its listeners (node and dedicated mode) or the
// self-proxy (in-pod mode).
func (n *ztunnel) proxies() []*proxy.Proxy {
	var ps []*proxy.Proxy
	for _, p := range []*proxy.Proxy{n.proxy, n.self} {
		if p != nil {
			ps = append(ps, p)
		}
	}
	return ps
}

func (n *ztunnel) requestQuit() { n.quitOnce.Do(func() { close(n.quit) }) }

func (n *ztunnel) listenerSummary() string {
	var parts []string
	for name, a := range n.addrs {
		parts = append(parts, strings.ToLower(strings.TrimSuffix(name, "_ADDR"))+"="+a.String())
	}
	return strings.Join(parts, " ")
}

// withResolver gives a proxy the node's on-demand resolver, if it has one (a nil
// *dns.Resolver must not become a non-nil proxy.HostResolver).
func (n *ztunnel) withResolver(pcfg *proxy.Config) {
	if n.resolver != nil {
		pcfg.Resolver = n.resolver
	}
}

// dnsConfig answers for the workloads this node serves (the dedicated one, or the local
// workload with the client's IP) from local.
func (n *ztunnel) dnsConfig(local state.Local) dns.Config {
	return dns.Config{
		Addr:          n.cfg.DNSProxyAddr,
		ClusterDomain: n.cfg.ClusterDomain,
		Local:         local,
		FixedSearch:   n.local.Dedicated(), // a dedicated ztunnel shares its workload's resolv.conf
		DisableIPv6:   !n.cfg.IPv6Enabled,
		OwnFamilies:   !n.cfg.DNSAllFamilies,
		Poller:        n.poller,
	}
}
