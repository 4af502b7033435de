package proxy_test

// The soak's mesh (soak_test.go runs it): two nodes fed by real xDS and CA servers that the
// fault cycle stops, restarts and kills.

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/gozt/gozt/identity/ca"
	"github.com/gozt/gozt/identity/certs"
	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/proxy"
	"github.com/gozt/gozt/xds"
	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// noCleanup is a TB for the servers and nodes the faults restart, which the test stops
// itself: t.Cleanup would keep every one it replaced reachable until the run ends, and the
// settled heap would grow by each restart (0.25 MiB a cycle).
type noCleanup struct{ testing.TB }

func (noCleanup) Cleanup(func()) {}

// newSoakMesh is newMesh on loopback subnets no other test uses: while node B is down
// another test process on the machine would otherwise find its 15008 free and take it.
func newSoakMesh(tb testing.TB) *mesh {
	tb.Helper()
	for _, sub := range []string{"127.0.50.", "127.0.51.", "127.0.52."} {
		if free(sub+"3", []string{"15008"}) {
			return &mesh{clientIP: sub + "2", serverIP: sub + "3", outsideIP: sub + "4"}
		}
	}
	tb.Skip("soak: no loopback subnet with 15008 free on .3")
	return nil
}

// soakNode is one in-process ztunnel whose workloads come from an ADS server through
// xds.Client and whose certificates come from an Istio CA through ca.New and certs.Manager,
// as cmd/ztunnel wires them.
type soakNode struct {
	name  string
	proxy *proxy.Proxy
	reg   *prometheus.Registry
	certs *certs.Manager
	ca    ca.Client
	// poller is the node's own, closed by kill: node-b is restarted under a testing.TB
	// whose Cleanup does nothing, so each incarnation must close what it opened.
	poller netpoll.Poller

	stopBG  context.CancelFunc
	bg      sync.WaitGroup
	once    sync.Once
	tb      testing.TB
	socksAt string
}

func startSoakNode(tb testing.TB, name string, cfg proxy.Config, adsAddr, caAddr string, log *accessLog) *soakNode {
	tb.Helper()
	n := &soakNode{name: name, reg: prometheus.NewRegistry(), tb: tb}
	store := state.NewStore()
	met := metrics.New(n.reg, "soak", metrics.WithAccessLog(slog.New(log)))
	xc, err := xds.NewClient(xds.Config{Config: istiogrpc.Config{Address: "http://" + adsAddr}, NodeID: "ztunnel~" + name, Logger: quiet}, store, met)
	if err != nil {
		tb.Fatalf("%s: xds: %v", name, err)
	}
	n.ca, err = ca.New(context.Background(), ca.Config{Provider: "istio", Config: istiogrpc.Config{Address: "http://" + caAddr}, SecretTTL: soakTTL})
	if err != nil {
		tb.Fatalf("%s: ca: %v", name, err)
	}
	n.certs = certs.New(certs.Config{Logger: quiet}, n.ca)
	cfg.Logger = quiet
	wireHBONE(&cfg, met, store)
	if cfg.Poller == nil {
		if perSocket {
			cfg.Poller = netpoll.PerSocket{}
		} else if cfg.Poller, err = netpoll.New(); err != nil {
			tb.Fatalf("%s: poller: %v", name, err)
		}
		n.poller = cfg.Poller
	}
	n.proxy = proxy.New(cfg, store, n.certs, met)
	var listenErr error
	for range 50 { // a restarted node binds its predecessor's 15008
		if listenErr = n.proxy.Listen(); !errors.Is(listenErr, syscall.EADDRINUSE) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if listenErr != nil {
		n.certs.Close()
		n.ca.Close()
		if n.poller != nil {
			n.poller.Close()
		}
		tb.Fatalf("%s: listen: %v", name, listenErr)
	}
	if a, ok := n.proxy.Addrs()[proxy.ListenerSocks5]; ok {
		n.socksAt = a.String()
	}
	ctx, cancel := context.WithCancel(context.Background())
	n.stopBG = cancel
	n.bg.Add(2)
	go func() { defer n.bg.Done(); _ = xc.Run(ctx) }()
	go func() { defer n.bg.Done(); n.proxy.Serve(ctx) }()
	tb.Cleanup(n.kill)
	return n
}

func (n *soakNode) socks(tb testing.TB) string {
	if n.socksAt == "" {
		tb.Fatalf("%s: no SOCKS5 listener", n.name)
	}
	return n.socksAt
}

// kill stops the node as a crash would look to its peers: listeners and every live
// connection close at once (a drain deadline already passed). Later calls do nothing.
func (n *soakNode) kill() {
	n.once.Do(func() {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_ = n.proxy.Shutdown(ctx)
		n.stopBG()
		n.bg.Wait()
		n.certs.Close()
		n.ca.Close()
		if n.poller != nil {
			n.poller.Close()
		}
	})
}

// soakADS is a minimal real delta ADS server: every subscription (a request without a
// response nonce) is answered with the full state of its type; ACKs are read and dropped.
type soakADS struct {
	discoverypb.UnimplementedAggregatedDiscoveryServiceServer
	addr      string
	resources []*discoverypb.Resource // Address resources
	srv       *grpc.Server
	done      chan struct{}
	once      sync.Once
	nonce     atomic.Int64
}

func startSoakADS(tb testing.TB, addr string, res []*discoverypb.Resource) *soakADS {
	tb.Helper()
	var ln net.Listener
	var err error
	for range 50 { // a restarted server binds its predecessor's port
		if ln, err = net.Listen("tcp", addr); err == nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err != nil {
		tb.Fatalf("ads: %v", err)
	}
	// istiod lets clients ping as often as the xDS client does; grpc-go's default policy
	// would answer its keepalives with GOAWAY too_many_pings.
	srv := grpc.NewServer(grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: time.Second, PermitWithoutStream: true}))
	s := &soakADS{addr: ln.Addr().String(), resources: res, srv: srv, done: make(chan struct{})}
	discoverypb.RegisterAggregatedDiscoveryServiceServer(s.srv, s)
	go func() { defer close(s.done); _ = s.srv.Serve(ln) }()
	tb.Cleanup(s.stop)
	return s
}

// stop closes the listener and every stream at once: to the nodes the control plane is gone.
func (s *soakADS) stop() { s.once.Do(func() { s.srv.Stop(); <-s.done }) }

func (s *soakADS) DeltaAggregatedResources(st grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse]) error {
	for {
		req, err := st.Recv()
		if err != nil {
			return nil
		}
		if req.GetResponseNonce() != "" {
			continue
		}
		resp := &discoverypb.DeltaDiscoveryResponse{TypeUrl: req.GetTypeUrl(), Nonce: strconv.FormatInt(s.nonce.Add(1), 10)}
		if req.GetTypeUrl() == xdspb.AddressType {
			resp.Resources = s.resources
		}
		if err := st.Send(resp); err != nil {
			return nil
		}
	}
}

// soakResources are the mesh's two workloads as Address resources.
func soakResources(tb testing.TB, m *mesh) []*discoverypb.Resource {
	tb.Helper()
	var out []*discoverypb.Resource
	for _, w := range []struct{ name, ip, node string }{{"client", m.clientIP, "node-a"}, {"server", m.serverIP, "node-b"}} {
		uid := "Kubernetes//v1/Pod/default/" + w.name
		b, err := proto.Marshal(&workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: &workloadpb.Workload{
			Uid: uid, Name: w.name, Namespace: "default", ServiceAccount: w.name, Node: w.node,
			Addresses:      [][]byte{netip.MustParseAddr(w.ip).AsSlice()},
			TunnelProtocol: workloadpb.TunnelProtocol_HBONE,
		}}})
		if err != nil {
			tb.Fatal(err)
		}
		out = append(out, &discoverypb.Resource{Name: uid, Version: "1", Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: b}})
	}
	return out
}

// --- node A's access log ---
