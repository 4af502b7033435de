package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"sync"
	"time"

	"github.com/gozt/gozt/dns"
	"github.com/gozt/gozt/inpod"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/podpoll"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

var (
	_ inpod.Proxies = (*podProxies)(nil)
	_ proxy.Sockets = netns.Sockets{}
)

// podProxies runs in-pod mode's per-pod proxies for the workload manager: for each pod a
// proxy.Proxy dedicated to the pod's workload (Local.Pod) and a DNS proxy, every socket of both opened
// inside the pod's network namespace and marked, sharing the node's store, certificate
// manager and metrics. Each pod gets its own HBONE pool and serves its own identity on 15008.
//
// No pod has a goroutine per listening socket: one poller (internal/podpoll) waits on every
// pod's listeners and DNS sockets, accepts and reads on readiness and hands the work to the
// pod's proxy or DNS proxy. An idle pod holds two goroutines: servePod, which runs its
// proxy's policy watcher, and its DNS proxy's Serve.
type podProxies struct {
	n      *node
	poller *podpoll.Poller // closed by close, after every pod has stopped
	wg     sync.WaitGroup  // one count per pod from Start until its shutdown has finished

	mu   sync.Mutex
	pods map[string]*podProxy // guarded by mu: running pods by UID
}

type podProxy struct {
	uid    string
	ns     *netns.NetNS // owned from Start on; closed once both servers have stopped
	proxy  *proxy.Proxy
	dns    *dns.Server // nil with DNS_PROXY_ADDR=off
	cancel context.CancelFunc
	served chan struct{} // closed when servePod has returned
}

func newPodProxies(n *node) (*podProxies, error) {
	p, err := podpoll.New()
	if err != nil {
		return nil, fmt.Errorf("in-pod mode: %w", err)
	}
	return &podProxies{n: n, poller: p, pods: map[string]*podProxy{}}, nil
}

// Start binds the pod's listeners in its netns and serves them in the background. It waits
// for neither xDS nor the CA: the pod's workload is looked up per connection (waiting up to
// 5 s for it to appear), its certificate at the first handshake.
func (pp *podProxies) Start(p inpod.Pod) error {
	cfg := pp.n.cfg
	log := slog.Default().With("pod", p.Info.Namespace+"/"+p.Info.Name, "uid", p.UID)
	sockets := netns.Sockets{NS: p.NetNS, Mark: cfg.PacketMark, ReusePort: cfg.InpodPortReuse, Transparent: true}
	local := pp.n.local.Pod(state.WorkloadRef{Namespace: p.Info.Namespace, Name: p.Info.Name, ServiceAccount: p.Info.ServiceAccount})
	pcfg := proxyConfig(cfg)
	pcfg.Outliers = pp.n.outliers
	pcfg.Local = local
	pcfg.OutboundAddr = podAddr(cfg.OutboundAddr, cfg.IPv6Enabled)
	pcfg.InboundPlaintextAddr = podAddr(cfg.InboundPlaintextAddr, cfg.IPv6Enabled)
	pcfg.InboundAddr = podAddr(cfg.InboundAddr, cfg.IPv6Enabled)
	pcfg.Sockets = sockets
	pcfg.Acceptor = pp.poller
	pcfg.Logger = log
	pp.n.withResolver(&pcfg)
	if cfg.InpodPortReuse {
		if err := migrateOnClose(p.NetNS); err != nil {
			log.Debug("cannot set tcp_migrate_req in the pod; an upgrade may reset a few connections", "err", err)
		}
	}
	px := proxy.New(pcfg, pp.n.store, pp.n.certs, pp.n.metrics)
	if err := px.Listen(); err != nil {
		px.Shutdown(context.Background())
		return err
	}
	var d *dns.Server
	if cfg.DNSProxyAddr != "" {
		dc := pp.n.dnsConfig(local) // the search list is the client's namespace, not ztunnel's resolv.conf
		dc.WorkloadWait = podDNSWorkloadWait
		dc.Listen, dc.ListenPacket = sockets.Listen, sockets.ListenPacket
		dc.Poller = pp.poller
		dc.Dial = func(ctx context.Context, network, address string) (net.Conn, error) {
			return sockets.Dial(ctx, nil, network, address)
		}
		dc.Logger = log
		d = dns.New(dc, pp.n.store, pp.n.metrics)
		if err := d.Listen(); err != nil {
			d.Close()
			px.Shutdown(context.Background())
			return err
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	pod := &podProxy{uid: p.UID, ns: p.NetNS, proxy: px, dns: d, cancel: cancel, served: make(chan struct{})}
	pp.mu.Lock()
	pp.pods[p.UID] = pod
	pp.mu.Unlock()
	pp.wg.Add(1)
	go servePod(ctx, pod)
	return nil
}

// podDNSWorkloadWait bounds how long a pod's DNS proxy waits for the pod's workload to reach
// the store before it answers SERVFAIL: under a resolver's usual 5 s timeout, so the client
// sees an answer, not a retry.
const podDNSWorkloadWait = 2 * time.Second

// servePod runs a pod's proxy and DNS proxy until both stop.
func servePod(ctx context.Context, pod *podProxy) {
	defer close(pod.served)
	var wg sync.WaitGroup
	if pod.dns != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A pod deleted at once can be closed before Serve begins: not an error.
			if err := pod.dns.Serve(ctx); err != nil && !errors.Is(err, net.ErrClosed) {
				slog.Error("pod dns proxy stopped", "uid", pod.uid, "err", err)
			}
		}()
	}
	pod.proxy.Serve(ctx)
	wg.Wait()
}

// Drain shuts the pod's proxy down gracefully: live connections get
// CONNECTION_TERMINATION_DEADLINE to finish.
func (pp *podProxies) Drain(uid string) { pp.end(uid, pp.n.cfg.TerminationDeadline) }

// Stop shuts the pod's proxy down at once: the pod is gone.
func (pp *podProxies) Stop(uid string) { pp.end(uid, 0) }

func (pp *podProxies) end(uid string, deadline time.Duration) {
	pp.mu.Lock()
	pod := pp.pods[uid]
	delete(pp.pods, uid)
	pp.mu.Unlock()
	if pod == nil {
		return
	}
	go pp.shutdownPod(pod, deadline)
}

// shutdownPod stops the pod's listeners, lets connections finish and DNS queries already
// taken be answered until deadline, then releases the pod's network namespace. (A DNS
// proxy closed at once loses the queries it is forwarding: a cluster's ztunnel upgrade
// caught a client's lookup timing out that way.)
func (pp *podProxies) shutdownPod(pod *podProxy, deadline time.Duration) {
	defer pp.wg.Done()
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	var dnsDone sync.WaitGroup
	if pod.dns != nil {
		dnsDone.Go(func() { pod.dns.Shutdown(ctx) })
	}
	if err := pod.proxy.Shutdown(ctx); err != nil {
		slog.Warn("pod proxy shutdown", "uid", pod.uid, "err", err)
	}
	dnsDone.Wait()
	pod.cancel()
	<-pod.served
	pod.ns.Close()
}

// close returns once every pod whose proxy was stopped has finished shutting down, then
// stops the poller. The workload manager drains every pod when it closes, so after
// Manager.Close none is left.
func (pp *podProxies) close() {
	pp.wg.Wait()
	pp.poller.Close()
}

// migrateOnClose sets net.ipv4.tcp_migrate_req in the pod's namespace (Linux 5.14+). During
// an upgrade two ztunnels hold each pod listener in one SO_REUSEPORT group, and the kernel
// has already assigned some handshakes to the old one's socket when it drains: without the
// setting, closing that listener resets them and those it queued but did not accept; with
// it, the kernel moves them to the new ztunnel's listener. It changes nothing else for the
// pod (an application's own SO_REUSEPORT listeners get the same migration).
func migrateOnClose(ns *netns.NetNS) error {
	return ns.Do(func() error {
		// /proc/sys/net is that of the opening thread's network namespace.
		return os.WriteFile("/proc/sys/net/ipv4/tcp_migrate_req", []byte("1"), 0)
	})
}

// podAddr is a pod listener's address: the setting's port on the wildcard address ([::],
// or 0.0.0.0 with IPV6_ENABLED=false); "" stays off.
func podAddr(setting string, ipv6 bool) string {
	if setting == "" {
		return ""
	}
	_, port, err := net.SplitHostPort(setting)
	if err != nil {
		return setting // loadConfig checked it; Listen reports it
	}
	if ipv6 {
		return net.JoinHostPort("::", port)
	}
	return net.JoinHostPort("0.0.0.0", port)
}

// inpodReady is the readiness check of in-pod mode: the workload manager has reconciled the
// node agent's snapshot and no pod's proxy is pending.
func (n *node) inpodReady() error {
	if n.inpod.Ready() {
		return nil
	}
	if st := n.inpod.Stats(); st.Pending > 0 {
		return fmt.Errorf("%d pod proxies failed to start (retried every 5s)", st.Pending)
	}
	return fmt.Errorf("no snapshot yet from the istio-cni node agent on %s", n.cfg.InpodUDS)
}

// podConnections lists the connections carried by the proxy of the pod uid; false if it
// has none running.
func (pp *podProxies) podConnections(uid string) (inbound, outbound []proxy.ConnInfo, ok bool) {
	pp.mu.Lock()
	pod := pp.pods[uid]
	pp.mu.Unlock()
	if pod == nil {
		return nil, nil, false
	}
	inbound, outbound = pod.proxy.Connections()
	return inbound, outbound, true
}

// podDump is one pod of /config_dump's workloadState, in the Rust ztunnel's shape:
// {state, info, connections: {inbound: [...], outbound: [...]}}.
type podDump struct {
	inpod.PodState
	Connections struct {
		Inbound  []proxy.ConnInfo `json:"inbound"`
		Outbound []proxy.ConnInfo `json:"outbound"`
	} `json:"connections"`
}

// workloadState is /config_dump's workloadState: each pod's state from the in-pod manager
// and the connections its proxy carries.
func (n *node) workloadState() map[string]podDump {
	out := map[string]podDump{}
	for uid, st := range n.inpod.WorkloadState() {
		d := podDump{PodState: st}
		d.Connections.Inbound, d.Connections.Outbound = []proxy.ConnInfo{}, []proxy.ConnInfo{}
		if in, outb, ok := n.pods.podConnections(uid); ok {
			d.Connections.Inbound, d.Connections.Outbound = in, outb
		}
		out[uid] = d
	}
	return out
}

// acceptError is every running pod's proxy's AcceptError, naming the pod.
func (pp *podProxies) acceptError() error {
	pp.mu.Lock()
	pods := make([]*podProxy, 0, len(pp.pods))
	for _, pod := range pp.pods {
		pods = append(pods, pod)
	}
	pp.mu.Unlock()
	var errs []error
	for _, pod := range pods {
		if err := pod.proxy.AcceptError(); err != nil {
			errs = append(errs, fmt.Errorf("pod %s: %w", pod.uid, err))
		}
	}
	return errors.Join(errs...)
}

// closeMatching is proxy.Proxy.CloseMatching on every running pod's proxy.
func (pp *podProxies) closeMatching(match func(inbound bool, cs tls.ConnectionState) error) {
	pp.mu.Lock()
	pods := make([]*podProxy, 0, len(pp.pods))
	for _, pod := range pp.pods {
		pods = append(pods, pod)
	}
	pp.mu.Unlock()
	for _, pod := range pods {
		pod.proxy.CloseMatching(match)
	}
}
