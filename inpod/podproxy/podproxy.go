// Package podproxy runs in-pod mode's per-pod proxies: it is the inpod.Proxies the workload
// manager drives. For each pod it starts a proxy.Proxy dedicated to the pod's workload
// (state.Local.Pod) and a DNS proxy, every socket of both opened inside the pod's network
// namespace and marked (internal/netns), sharing the node's store, certificate source and
// metrics. Each pod gets its own HBONE pool and serves its own identity on 15008.
//
// No pod has a goroutine per listening socket: the node's poller (internal/netpoll, which
// cmd/ztunnel puts in every proxy.Config and dns.Config it makes) waits on every pod's
// listeners and DNS sockets, accepts and reads on readiness and hands the work to the
// pod's proxy or DNS proxy; the pods' idle proxied connections park in it too. An idle pod
// holds two goroutines: servePod, which runs its proxy's policy watcher, and its DNS
// proxy's Serve.
//
// It decides nothing about when a pod starts or stops (inpod.Manager does) and reads no
// setting (cmd/ztunnel fills Config).
package podproxy

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
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds/state"
)

var (
	_ inpod.Proxies = (*Set)(nil)
	_ proxy.Sockets = netns.Sockets{}
)

// Config is what every pod's proxies are built from.
type Config struct {
	// Node is what the node serves; a pod's proxies serve Node.Pod(the pod's workload).
	Node state.Local
	// Proxy is the whole configuration of a pod's proxy serving local, its sockets opened
	// by sockets (inside the pod's network namespace, marked: its HBONE pool's dials too),
	// logging to log: its listeners (on the pod's wildcard addresses), the node's settings
	// and its Poller, the node's.
	Proxy func(local state.Local, sockets netns.Sockets, log *slog.Logger) proxy.Config
	// DNS, if set, is the configuration of a pod's DNS proxy answering for local, its
	// Poller the node's; nil runs none (DNS_PROXY_ADDR=off). Start sets its sockets,
	// WorkloadWait and Logger.
	DNS func(local state.Local) dns.Config
	// Mark is the SO_MARK of every socket opened in a pod (PACKET_MARK).
	Mark uint32
	// ReusePort opens the pods' listeners with SO_REUSEPORT and tcp_migrate_req, so a new
	// ztunnel binds beside the old one during an upgrade (INPOD_PORT_REUSE).
	ReusePort bool
	// DrainDeadline is how long Drain lets a pod's connections and DNS queries finish
	// (CONNECTION_TERMINATION_DEADLINE).
	DrainDeadline time.Duration

	Store *state.Store
	Certs proxy.CertSource
	// PodCerts, if set, is the certificate source of one pod's proxy in place of Certs,
	// for a CA that issues certificates per workload (SPIRE): it starts following the
	// pod's certificates, and release, called once the pod's proxy has stopped, ends that.
	PodCerts func(p inpod.Pod) (src proxy.CertSource, release func(), err error)
	Metrics  *metrics.Metrics
}

// Set is the running pods' proxies.
type Set struct {
	cfg Config
	wg  sync.WaitGroup // one count per pod from Start until its shutdown has finished

	mu   sync.Mutex
	pods map[string]*pod // guarded by mu: running pods by UID
}

type pod struct {
	uid     string
	release func()       // PodCerts's, called once the proxy has stopped
	ns      *netns.NetNS // owned from Start on; closed once both servers have stopped
	proxy   *proxy.Proxy
	dns     *dns.Server // nil without Config.DNS
	cancel  context.CancelFunc
	served  chan struct{} // closed when servePod has returned
}

// New returns an empty Set.
func New(cfg Config) *Set {
	return &Set{cfg: cfg, pods: map[string]*pod{}}
}

// Start binds the pod's listeners in its netns and serves them in the background. It waits
// for neither xDS nor the CA: the pod's workload is looked up per connection (waiting up to
// 5 s for it to appear), its certificate at the first handshake.
func (s *Set) Start(p inpod.Pod) error {
	cfg := s.cfg
	log := slog.Default().With("pod", p.Info.Namespace+"/"+p.Info.Name, "uid", p.UID)
	sockets := netns.Sockets{NS: p.NetNS, Mark: cfg.Mark, ReusePort: cfg.ReusePort, Transparent: true}
	local := cfg.Node.Pod(state.WorkloadRef{Namespace: p.Info.Namespace, Name: p.Info.Name, ServiceAccount: p.Info.ServiceAccount})
	pcfg := cfg.Proxy(local, sockets, log)
	if cfg.ReusePort {
		if err := migrateOnClose(p.NetNS); err != nil {
			log.Debug("cannot set tcp_migrate_req in the pod; an upgrade may reset a few connections", "err", err)
		}
	}
	certs, release := cfg.Certs, func() {}
	if cfg.PodCerts != nil {
		var err error
		if certs, release, err = cfg.PodCerts(p); err != nil {
			return err
		}
	}
	px := proxy.New(pcfg, cfg.Store, certs, cfg.Metrics)
	if err := px.Listen(); err != nil {
		px.Shutdown(context.Background())
		release()
		return err
	}
	var d *dns.Server
	if cfg.DNS != nil {
		dc := cfg.DNS(local)
		dc.WorkloadWait = dnsWorkloadWait
		dc.Listen, dc.ListenPacket = sockets.Listen, sockets.ListenPacket
		dc.Dial = func(ctx context.Context, network, address string) (net.Conn, error) {
			return sockets.Dial(ctx, nil, network, address)
		}
		dc.Logger = log
		d = dns.New(dc, cfg.Store, cfg.Metrics)
		if err := d.Listen(); err != nil {
			d.Close()
			px.Shutdown(context.Background())
			release()
			return err
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	pd := &pod{uid: p.UID, release: release, ns: p.NetNS, proxy: px, dns: d, cancel: cancel, served: make(chan struct{})}
	s.mu.Lock()
	s.pods[p.UID] = pd
	s.mu.Unlock()
	s.wg.Add(1)
	go servePod(ctx, pd)
	return nil
}

// dnsWorkloadWait bounds how long a pod's DNS proxy waits for the pod's workload to reach
// the store before it answers SERVFAIL: under a resolver's usual 5 s timeout, so the client
// sees an answer, not a retry.
const dnsWorkloadWait = 2 * time.Second

// servePod runs a pod's proxy and DNS proxy until both stop.
func servePod(ctx context.Context, pd *pod) {
	defer close(pd.served)
	var wg sync.WaitGroup
	if pd.dns != nil {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// A pod deleted at once can be closed before Serve begins: not an error.
			if err := pd.dns.Serve(ctx); err != nil && !errors.Is(err, net.ErrClosed) {
				slog.Error("pod dns proxy stopped", "uid", pd.uid, "err", err)
			}
		}()
	}
	pd.proxy.Serve(ctx)
	wg.Wait()
}

// Drain shuts the pod's proxy down gracefully: live connections get Config.DrainDeadline
// to finish.
func (s *Set) Drain(uid string) { s.end(uid, s.cfg.DrainDeadline) }

// Stop shuts the pod's proxy down at once: the pod is gone.
func (s *Set) Stop(uid string) { s.end(uid, 0) }

func (s *Set) end(uid string, deadline time.Duration) {
	s.mu.Lock()
	pd := s.pods[uid]
	delete(s.pods, uid)
	s.mu.Unlock()
	if pd == nil {
		return
	}
	go s.shutdownPod(pd, deadline)
}

// shutdownPod stops the pod's listeners, lets connections finish and DNS queries already
// taken be answered until deadline, then releases the pod's network namespace. Both take
// their sockets out of their SO_REUSEPORT groups at once, so a new ztunnel's sockets get
// every new connection and query. (A DNS proxy closed at once loses the queries it is
// forwarding: a cluster's ztunnel upgrade caught a client's lookup timing out that way.)
func (s *Set) shutdownPod(pd *pod, deadline time.Duration) {
	defer s.wg.Done()
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	var dnsDone sync.WaitGroup
	if pd.dns != nil {
		dnsDone.Go(func() { pd.dns.Shutdown(ctx) })
	}
	if err := pd.proxy.Shutdown(ctx); err != nil {
		slog.Warn("pod proxy shutdown", "uid", pd.uid, "err", err)
	}
	dnsDone.Wait()
	pd.cancel()
	<-pd.served
	pd.release()
	pd.ns.Close()
}

// Close returns once every pod whose proxy was stopped has finished shutting down. The
// workload manager drains every pod when it closes, so after Manager.Close none is left.
func (s *Set) Close() {
	s.wg.Wait()
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

// Connections lists the connections carried by the proxy of the pod uid; false if it has
// none running.
func (s *Set) Connections(uid string) (inbound, outbound []proxy.ConnInfo, ok bool) {
	s.mu.Lock()
	pd := s.pods[uid]
	s.mu.Unlock()
	if pd == nil {
		return nil, nil, false
	}
	inbound, outbound = pd.proxy.Connections()
	return inbound, outbound, true
}

// AcceptError is every running pod's proxy's AcceptError, naming the pod.
func (s *Set) AcceptError() error {
	var errs []error
	for _, pd := range s.running() {
		if err := pd.proxy.AcceptError(); err != nil {
			errs = append(errs, fmt.Errorf("pod %s: %w", pd.uid, err))
		}
	}
	return errors.Join(errs...)
}

// CloseMatching is proxy.Proxy.CloseMatching on every running pod's proxy.
func (s *Set) CloseMatching(match func(inbound bool, cs tls.ConnectionState) error) {
	for _, pd := range s.running() {
		pd.proxy.CloseMatching(match)
	}
}

// ClosePod closes every HBONE connection of the proxy of the pod uid, both ways, with
// why: the pod lost its certificate (its SPIRE entry was deleted).
func (s *Set) ClosePod(uid string, why error) {
	s.mu.Lock()
	pd := s.pods[uid]
	s.mu.Unlock()
	if pd != nil {
		pd.proxy.CloseMatching(func(bool, tls.ConnectionState) error { return why })
	}
}

// running is the running pods, collected under the lock to be acted on after it.
func (s *Set) running() []*pod {
	s.mu.Lock()
	defer s.mu.Unlock()
	pods := make([]*pod, 0, len(s.pods))
	for _, pd := range s.pods {
		pods = append(pods, pd)
	}
	return pods
}
