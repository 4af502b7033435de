package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"net/http"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gozt/gozt/dns"
	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/inpod"
	"github.com/gozt/gozt/internal/istiogrpc"
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
	logLevel *slog.LevelVar
	ready    *readiness
	registry *prometheus.Registry
	metrics  *metrics.Metrics
	store    *state.Store
	xds      *xds.Client // nil without XDS_ADDRESS
	certs    *certs.Manager
	proxy    *proxy.Proxy   // the node's own listeners (node and dedicated mode)
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
func run(ctx context.Context, cfg *config, logLevel *slog.LevelVar, started func(*node)) error {
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
		store:    state.NewStoreWith(state.Options{Network: cfg.Network}),
	}
	n.metrics = metrics.New(n.registry, version, metrics.WithAccessLog(slog.Default().With("scope", "access")))

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
	n.certs = certs.New(certs.Config{PQCOnly: cfg.Compliance == "pqc"}, caClient)
	defer n.certs.Close()

	goBG("metrics sweep", n.forgetGoneWorkloads)

	pcfg := proxyConfig(cfg)
	if n.xds != nil && cfg.XDSOnDemand {
		pcfg.Demand = n.xds.DemandAddress
	}
	n.proxy = proxy.New(pcfg, n.store, n.certs, n.metrics)
	inPod := n.local.Mode == state.ModeShared
	if inPod {
		// Every pod's listeners open inside its netns, so the node opens none of its own.
		if err := netns.CheckCapabilities(); err != nil {
			return fmt.Errorf("PROXY_MODE=shared (in-pod) cannot enter pod namespaces or mark sockets: %w", err)
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
		n.proxy.Shutdown(context.Background())
		return err
	}
	proxyCtx, stopProxy := context.WithCancel(context.Background())
	defer stopProxy()
	proxyDone := make(chan struct{})
	go func() {
		defer close(proxyDone)
		n.proxy.Serve(proxyCtx)
	}()
	if inPod {
		n.pods = newPodProxies(n)
		n.inpod = inpod.New(inpod.Config{Path: cfg.InpodUDS, Metrics: n.metrics}, n.pods)
		n.ready.watch(taskInpod, n.inpodReady)
		n.ready.watch(taskAccept, n.pods.acceptError)
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
		n.pods.wait()   // ...each within CONNECTION_TERMINATION_DEADLINE
	}
	err = n.proxy.Shutdown(drainCtx)
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
		local, err := xds.LoadLocal(cfg.LocalXDSPath, n.store)
		if err != nil {
			return fmt.Errorf("LOCAL_XDS_PATH: %w", err)
		}
		goBG("local config", local.Run)
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

// prefetchCertificates keeps a certificate ready for every workload this node serves:
// fetched when the workload appears, forgotten when the last one with that identity goes.
// The node is ready once the current set has been fetched; failures are retried every 5s
// and shown at readiness (the certificate manager logs them).
func (n *node) prefetchCertificates(ctx context.Context) error {
	have := map[identity.ID]bool{}
	changes := n.store.Subscribe(ctx)
	for {
		var retry <-chan time.Time
		if err := n.syncCertificates(ctx, have); err != nil {
			n.ready.failed(taskCerts, err)
			retry = time.After(5 * time.Second)
		} else {
			n.ready.done(taskCerts)
		}
		select {
		case _, open := <-changes:
			if !open {
				return nil
			}
		case <-retry:
		}
	}
}

// syncCertificates prefetches new identities, forgets gone ones and returns why a wanted
// certificate is not available, nil when every one is.
func (n *node) syncCertificates(ctx context.Context, have map[identity.ID]bool) error {
	want := map[identity.ID]bool{}
	for _, w := range n.local.Workloads(n.store) {
		if w.Protocol == state.TunnelHBONE || w.NativeTunnel {
			want[w.Identity()] = true
		}
	}
	for id := range have {
		if !want[id] {
			n.certs.Forget(id)
			delete(have, id)
		}
	}
	var errs []error
	if len(want) == 0 && n.local.Dedicated() {
		errs = append(errs, fmt.Errorf("no HBONE workload %s (PROXY_WORKLOAD_INFO) in the workload store yet", n.local.Workload))
	}
	byName := func(a, b identity.ID) int { return strings.Compare(a.String(), b.String()) }
	for _, id := range slices.SortedFunc(maps.Keys(want), byName) {
		if !have[id] {
			n.certs.Prefetch(id)
			have[id] = true
		}
		fetchCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
		if _, err := n.certs.Certificate(fetchCtx, id); err != nil {
			errs = append(errs, err)
		}
		cancel()
	}
	return errors.Join(errs...)
}

// metricsSweepEvery is how often the node drops the metric series of workloads that have
// left the workload store (a variable for tests).
var metricsSweepEvery = time.Minute

// forgetGoneWorkloads drops, every metricsSweepEvery, the metric series of workloads the
// store no longer has, so workloads that churn names do not grow /metrics for good.
func (n *node) forgetGoneWorkloads(ctx context.Context) error {
	t := time.NewTicker(metricsSweepEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		if dropped := n.metrics.Forget(goneFrom(n.store)); dropped > 0 {
			slog.Debug("metrics: dropped the series of workloads that left", "label_sets", dropped)
		}
	}
}

// goneFrom reports, for a metric label's (namespace, workload), whether no workload in
// store has that name now (the proxy labels a workload by its workload name, else its
// name).
func goneFrom(store *state.Store) func(namespace, workload string) bool {
	type nsName struct{ ns, name string }
	known := map[nsName]bool{}
	store.EachWorkload(func(w *state.Workload) {
		known[nsName{w.Namespace, w.Name}] = true
		if w.WorkloadName != "" {
			known[nsName{w.Namespace, w.WorkloadName}] = true
		}
	})
	return func(ns, w string) bool { return !known[nsName{ns, w}] }
}

func (n *node) requestQuit() { n.quitOnce.Do(func() { close(n.quit) }) }

func (n *node) listenerSummary() string {
	var parts []string
	for name, a := range n.addrs {
		parts = append(parts, strings.ToLower(strings.TrimSuffix(name, "_ADDR"))+"="+a.String())
	}
	return strings.Join(parts, " ")
}

func (n *node) configDump() map[string]any {
	d := map[string]any{
		"version":      map[string]string{"version": version, "buildInfo": versionString()},
		"config":       n.cfg,
		"certificates": n.certs.Dump(),
	}
	if sd, ok := n.store.Dump().(*state.Dump); ok {
		d["workloads"], d["services"], d["policies"] = sd.Workloads, sd.Services, sd.Policies
	}
	var conns [][]proxy.ConnInfo
	if n.proxy != nil {
		in, out := n.proxy.Connections()
		conns = append(conns, in, out)
	}
	if n.inpod != nil {
		ws := n.workloadState()
		d["workloadState"] = ws
		for _, pd := range ws {
			conns = append(conns, pd.Connections.Inbound, pd.Connections.Outbound)
		}
	}
	if n.proxy != nil || n.inpod != nil {
		d["kernelTls"] = kernelTLSDump(n.cfg.KernelTLS, conns)
	}
	return d
}

// kernelTLSDump is /config_dump's kernelTls (a gozt section): whether KERNEL_TLS is on,
// and the proxied connections whose HBONE leg runs in kernel TLS and in user space.
func kernelTLSDump(enabled bool, conns [][]proxy.ConnInfo) map[string]any {
	counts := map[string]int{"kernel": 0, "user": 0}
	for _, cs := range conns {
		for _, c := range cs {
			if c.TLS != "" {
				counts[c.TLS]++
			}
		}
	}
	return map[string]any{"enabled": enabled, "proxiedConnections": counts}
}

// dnsConfig answers for the workloads this node serves (the dedicated one, or the local
// workload with the client's IP) from local.
func (n *node) dnsConfig(local state.Local) dns.Config {
	return dns.Config{
		Addr:          n.cfg.DNSProxyAddr,
		ClusterDomain: n.cfg.ClusterDomain,
		Local:         local,
		FixedSearch:   n.local.Dedicated(), // a dedicated ztunnel shares its workload's resolv.conf
		DisableIPv6:   !n.cfg.IPv6Enabled,
	}
}

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

func proxyConfig(c *config) proxy.Config {
	return proxy.Config{
		Local:                c.local(),
		OutboundAddr:         c.OutboundAddr,
		InboundPlaintextAddr: c.InboundPlaintextAddr,
		InboundAddr:          c.InboundAddr,
		Socks5Addr:           c.Socks5Addr,
		HBONE: hbone.Config{
			StreamWindow:      c.StreamWindow,
			ConnWindow:        c.ConnWindow,
			MaxFrameSize:      c.FrameSize,
			MaxStreamsPerConn: c.PoolMaxStreams,
			IdleTimeout:       c.PoolUnusedRelease,
			DisableKernelTLS:  !c.KernelTLS,
		},
		PacketMark:        c.PacketMark,
		OrigSrc:           c.EnableOrigSrc == "true",
		KeepaliveDisabled: !c.KeepaliveEnabled,
		KeepaliveTime:     c.KeepaliveTime,
		KeepaliveInterval: c.KeepaliveInterval,
		KeepaliveRetries:  c.KeepaliveRetries,
	}
}

func caConfig(c *config) ca.Config {
	return ca.Config{
		Provider:     c.CAProvider,
		Config:       c.endpoint(c.CAAddress, c.CARootCA, c.AltCAHostname, c.CAHeaders),
		SecretTTL:    c.SecretTTL,
		Impersonate:  !c.local().Dedicated(), // one ztunnel, many workload identities
		Dir:          c.CADir,
		SpiffeSocket: c.SpiffeSocket,
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
