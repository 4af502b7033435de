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
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/sockopt"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds"
	"github.com/gozt/gozt/xds/state"
)

// node is one running ztunnel: what run starts, in one place, so tests can start several in
// one process and look at their bound addresses.
type node struct {
	cfg      *config
	local    state.Local // what this node serves: cfg.local()
	logLevel *logLevels
	ready    *readiness
	registry *prometheus.Registry
	metrics  *metrics.Metrics
	store    *state.Store
	xds      *xds.Client // nil without XDS_ADDRESS
	certs    *certs.Manager
	crl      *certs.CRL     // nil without CRL_PATH
	resolver *dns.Resolver  // hostname-only workloads' on-demand DNS; nil without a nameserver
	proxy    *proxy.Proxy   // the node's own listeners (node and dedicated mode); nil in in-pod mode
	self     *proxy.Proxy   // in-pod mode: ztunnel's own 15008 (selfproxy.go); nil if not named
	inpod    *inpod.Manager // in-pod (shared) mode only
	pods     *podProxies    // in-pod mode: the pods' proxies the Manager drives

	quitOnce sync.Once
	quit     chan struct{} // closed by POST /quitquitquit

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
func run(ctx context.Context, cfg *config, logLevel *logLevels, started func(*node)) error {
	if limit, err := sockopt.RaiseFileLimit(); err != nil {
		slog.Warn("could not raise the open-file limit", "err", err)
	} else {
		slog.Debug("open-file limit", "soft", limit)
	}
	n := &node{
		cfg:      cfg,
		local:    cfg.local(),
		logLevel: logLevel,
		ready:    newReadiness(),
		registry: prometheus.NewRegistry(),
		quit:     make(chan struct{}),
		addrs:    map[string]net.Addr{},
		store:    state.NewStoreWith(state.Options{Network: cfg.Network, PreferredServiceNamespace: cfg.PreferredServiceNamespace}),
	}
	mopts := []metrics.Option{metrics.WithAccessLog(slog.Default().With("scope", "access"))}
	if n.local.Mode == state.ModeShared {
		mopts = append(mopts, metrics.WithWorkloadManager())
	}
	n.metrics = metrics.New(n.registry, version, mopts...)

	// Background work (config sources, certificate prefetch) runs on bg until the node stops.
	bg, stopBG := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	defer wg.Wait()
	defer stopBG()
	goBG := func(name string, fn func(context.Context) error) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := fn(bg); err != nil && bg.Err() == nil {
				slog.Error("stopped", "component", name, "err", err)
			}
		}()
	}

	if err := n.startConfigSources(goBG); err != nil {
		return err
	}
	caClient, err := ca.New(ctx, caConfig(cfg))
	if err != nil {
		return err
	}
	defer caClient.Close()
	if cfg.CRLPath != "" {
		if n.crl, err = certs.OpenCRL(cfg.CRLPath, nil); err != nil {
			return fmt.Errorf("CRL_PATH: %w", err)
		}
		defer n.crl.Close() // Watch starts below, once the proxies its callback closes exist
		n.registry.MustRegister(crlCollector{n.crl})
	}
	csrFailures := newCSRFailures()
	n.certs = certs.New(certs.Config{PQCOnly: cfg.Compliance == "pqc", TLS12: cfg.TLS12Enabled, CRL: n.crl,
		OnFetchFailure: func(reason string) { csrFailures.WithLabelValues(reason).Inc() }}, caClient)
	defer n.certs.Close()
	n.registry.MustRegister(csrFailures, certCollector{n.certs})

	goBG("metrics sweep", n.forgetGoneWorkloads)
	if n.resolver, err = dns.NewResolver(dns.ResolverConfig{}); err != nil {
		slog.Warn("workloads known only by hostname cannot be reached: no nameserver for on-demand DNS", "err", err)
	}

	inPod := n.local.Mode == state.ModeShared
	if !inPod {
		// In-pod mode has no node-level proxy: every pod's listeners open inside its netns
		// (podproxies.go), so the node opens none of its own.
		pcfg := proxyConfig(cfg)
		if n.xds != nil && cfg.XDSOnDemand {
			pcfg.Demand = n.xds.DemandAddress
		}
		n.withResolver(&pcfg)
		n.proxy = proxy.New(pcfg, n.store, n.certs, n.metrics)
	}
	if inPod {
		if err := netns.CheckCapabilities(); err != nil {
			return fmt.Errorf("PROXY_MODE=shared (in-pod) cannot enter pod namespaces or mark sockets: %w", err)
		}
		pods, err := newPodProxies(n)
		if err != nil {
			return err
		}
		n.pods = pods
		if self, ok := newSelfProxy(n); ok {
			if err := self.Listen(); err != nil {
				n.pods.close()
				return fmt.Errorf("self-proxy (POD_NAME, POD_NAMESPACE, SERVICE_ACCOUNT): %w", err)
			}
			n.self = self
			n.addrs["SELF_PROXY"] = self.Addrs()[proxy.ListenerInbound]
		}
		n.ready.add(taskCerts)
		goBG("certificate prefetch", n.prefetchCertificates)
	} else if cfg.enableProxy() {
		if err := n.proxy.Listen(); err != nil {
			return err
		}
		for name, a := range n.proxy.Addrs() {
			n.addrs[proxyListenerEnv[name]] = a
		}
		n.ready.watch(taskAccept, n.proxy.AcceptError) // out of file descriptors, say
		n.ready.add(taskCerts)
		goBG("certificate prefetch", n.prefetchCertificates)
	}

	if cfg.DNSProxyAddr != "" && !inPod {
		d := dns.New(n.dnsConfig(n.local), n.store, n.metrics)
		if err := d.Listen(); err != nil {
			n.proxy.Shutdown(context.Background())
			return fmt.Errorf("DNS_PROXY_ADDR: %w", err)
		}
		defer d.Close()
		n.addrs["DNS_PROXY_ADDR"] = d.Addr()
		goBG("dns proxy", d.Serve)
	}
	servers, err := n.startHTTP()
	if err != nil {
		n.shutdownProxies(context.Background())
		if n.pods != nil {
			n.pods.close()
		}
		return err
	}
	proxyCtx, stopProxy := context.WithCancel(context.Background())
	defer stopProxy()
	proxyDone := make(chan struct{})
	go func() {
		defer close(proxyDone)
		var wg sync.WaitGroup
		for _, p := range n.proxies() {
			wg.Go(func() { p.Serve(proxyCtx) })
		}
		wg.Wait()
	}()
	if inPod {
		n.inpod = inpod.New(inpod.Config{Path: cfg.InpodUDS, Metrics: n.metrics}, n.pods)
		n.ready.watch(taskInpod, n.inpodReady)
		n.ready.watch(taskAccept, func() error {
			if n.self != nil {
				return errors.Join(n.self.AcceptError(), n.pods.acceptError())
			}
			return n.pods.acceptError()
		})
	}

	if n.crl != nil {
		n.crl.Watch(n.closeRevoked)
	}

	slog.Info("ztunnel started", "version", version, "mode", n.local.Mode, "threads", runtime.GOMAXPROCS(0), "listeners", n.listenerSummary())
	if started != nil {
		started(n)
	}

	select {
	case <-ctx.Done():
	case <-n.quit:
	}
	slog.Info("draining", "deadline", cfg.TerminationDeadline)
	drainCtx, cancel := context.WithTimeout(context.Background(), cfg.TerminationDeadline)
	defer cancel()
	if n.inpod != nil {
		n.inpod.Close() // drains every pod's proxy, in the background...
		n.pods.close()  // ...each within CONNECTION_TERMINATION_DEADLINE
	}
	err = n.shutdownProxies(drainCtx)
	stopProxy()
	<-proxyDone
	for _, s := range servers {
		_ = s.Shutdown(drainCtx)
		s.Close()
	}
	stopBG()
	wg.Wait()
	slog.Info("ztunnel stopped")
	return err
}

// startConfigSources loads the local file (synchronously: a bad file stops the start) and
// starts the xDS client.
func (n *node) startConfigSources(goBG func(string, func(context.Context) error)) error {
	cfg := n.cfg
	if cfg.LocalXDSPath == "" && cfg.XDSAddress == "" {
		return errors.New("config: no workload source: set LOCAL_XDS_PATH (a local YAML file) or XDS_ADDRESS (a control plane)")
	}
	if cfg.LocalXDSPath != "" {
		file, err := xds.LoadFile(cfg.LocalXDSPath, n.store)
		if err != nil {
			return fmt.Errorf("LOCAL_XDS_PATH: %w", err)
		}
		goBG("local config", file.Run)
	}
	if cfg.XDSAddress != "" {
		xc := xdsConfig(cfg)
		xc.OnError = func(err error) { n.ready.failed(taskState, err) }
		client, err := xds.NewClient(xc, n.store, n.metrics)
		if err != nil {
			return fmt.Errorf("XDS_ADDRESS: %w", err)
		}
		n.xds = client
		n.ready.add(taskState)
		goBG("xds", client.Run)
		goBG("xds readiness", func(ctx context.Context) error {
			select {
			case <-client.Synced():
				n.ready.done(taskState)
			case <-ctx.Done():
			}
			return nil
		})
	}
	return nil
}

// startHTTP binds the admin, stats and readiness servers.
func (n *node) startHTTP() ([]*http.Server, error) {
	var servers []*http.Server
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
			for _, s := range servers {
				s.Close()
			}
			return nil, fmt.Errorf("listen %s=%s: %w", l.name, l.addr, err)
		}
		n.addrs[l.name] = ln.Addr()
		srv := &http.Server{Handler: l.h, ReadHeaderTimeout: 2 * time.Second}
		servers = append(servers, srv)
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				slog.Error("http server", "listener", l.name, "err", err)
			}
		}()
	}
	return servers, nil
}

// proxies are the node's own proxies: its listeners (node and dedicated mode) or the
// self-proxy (in-pod mode).
func (n *node) proxies() []*proxy.Proxy {
	var ps []*proxy.Proxy
	for _, p := range []*proxy.Proxy{n.proxy, n.self} {
		if p != nil {
			ps = append(ps, p)
		}
	}
	return ps
}

// shutdownProxies drains the node's own proxies until ctx ends.
func (n *node) shutdownProxies(ctx context.Context) error {
	var errs []error
	for _, p := range n.proxies() {
		errs = append(errs, p.Shutdown(ctx))
	}
	return errors.Join(errs...)
}

func (n *node) requestQuit() { n.quitOnce.Do(func() { close(n.quit) }) }

func (n *node) listenerSummary() string {
	var parts []string
	for name, a := range n.addrs {
		parts = append(parts, strings.ToLower(strings.TrimSuffix(name, "_ADDR"))+"="+a.String())
	}
	return strings.Join(parts, " ")
}

// dnsConfig answers for the workloads this node serves (the dedicated one, or the local
// workload with the client's IP) from local.
// withResolver gives a proxy the node's on-demand resolver, if it has one (a nil
// *dns.Resolver must not become a non-nil proxy.HostResolver).
func (n *node) withResolver(pcfg *proxy.Config) {
	if n.resolver != nil {
		pcfg.Resolver = n.resolver
	}
}

func (n *node) dnsConfig(local state.Local) dns.Config {
	return dns.Config{
		Addr:          n.cfg.DNSProxyAddr,
		ClusterDomain: n.cfg.ClusterDomain,
		Local:         local,
		FixedSearch:   n.local.Dedicated(), // a dedicated ztunnel shares its workload's resolv.conf
		DisableIPv6:   !n.cfg.IPv6Enabled,
	}
}
