package xds

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"log/slog"
	"math/big"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/logtest"
	"github.com/gozt/gozt/internal/testutil"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
	"github.com/gozt/gozt/xds/xdspb/securitypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

const waitFor = 10 * time.Second // upper bound for network round trips, never hit when passing

// adsServer is a small real delta ADS server: it records requests and lets the test push
// responses on the latest stream.
type adsServer struct {
	discoverypb.UnimplementedAggregatedDiscoveryServiceServer
	grpc    *grpc.Server
	addr    string
	reqs    chan *discoverypb.DeltaDiscoveryRequest
	streams chan grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse]
	md      chan metadata.MD
	done    chan struct{}
	end     chan struct{} // a send ends the current stream cleanly (status OK)
}

func startADS(t *testing.T, addr string, opts ...grpc.ServerOption) *adsServer {
	t.Helper()
	var ln net.Listener
	// A restarted server re-binds the same port; allow the old socket to go.
	testutil.EventuallyNil(t, func() (err error) {
		ln, err = net.Listen("tcp", addr)
		return err
	})
	s := &adsServer{
		grpc: grpc.NewServer(opts...), addr: ln.Addr().String(),
		reqs:    make(chan *discoverypb.DeltaDiscoveryRequest, 100),
		streams: make(chan grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse], 10),
		md:      make(chan metadata.MD, 10),
		done:    make(chan struct{}),
		end:     make(chan struct{}),
	}
	discoverypb.RegisterAggregatedDiscoveryServiceServer(s.grpc, s)
	go func() { defer close(s.done); _ = s.grpc.Serve(ln) }()
	t.Cleanup(s.stop)
	return s
}

func (s *adsServer) stop() { s.grpc.Stop(); <-s.done }

func (s *adsServer) DeltaAggregatedResources(st grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse]) error {
	md, _ := metadata.FromIncomingContext(st.Context())
	s.md <- md
	s.streams <- st
	recvDone := make(chan struct{})
	go func() { // owned by this handler: Recv fails once the handler returns
		defer close(recvDone)
		for {
			req, err := st.Recv()
			if err != nil {
				return
			}
			s.reqs <- req
		}
	}()
	select {
	case <-recvDone:
	case <-s.end:
	}
	return nil
}

func (s *adsServer) stream(t *testing.T) grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse] {
	t.Helper()
	select {
	case st := <-s.streams:
		return st
	case <-time.After(waitFor):
		t.Fatal("no stream")
		return nil
	}
}

func (s *adsServer) req(t *testing.T) *discoverypb.DeltaDiscoveryRequest {
	t.Helper()
	select {
	case r := <-s.reqs:
		return r
	case <-time.After(waitFor):
		t.Fatal("no request")
		return nil
	}
}

// initial reads the two initial requests of a stream, keyed by type URL.
func (s *adsServer) initial(t *testing.T) map[string]*discoverypb.DeltaDiscoveryRequest {
	t.Helper()
	out := map[string]*discoverypb.DeltaDiscoveryRequest{}
	for range 2 {
		r := s.req(t)
		out[r.GetTypeUrl()] = r
	}
	return out
}

func res(t *testing.T, name, typ string, m proto.Message, aliases ...string) *discoverypb.Resource {
	t.Helper()
	b, err := proto.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return &discoverypb.Resource{Name: name, Version: "v-" + name, Aliases: aliases, Resource: &anypb.Any{TypeUrl: typ, Value: b}}
}

func wlRes(t *testing.T, uid, ip string, aliases ...string) *discoverypb.Resource {
	return res(t, uid, xdspb.AddressType, &workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: &workloadpb.Workload{
		Uid: uid, Name: uid, Namespace: "default", Addresses: [][]byte{netip.MustParseAddr(ip).AsSlice()},
		TunnelProtocol: workloadpb.TunnelProtocol_HBONE,
	}}}, aliases...)
}

func svcRes(t *testing.T, host, vip string) *discoverypb.Resource {
	return res(t, "default/"+host, xdspb.AddressType, &workloadpb.Address{Type: &workloadpb.Address_Service{Service: &workloadpb.Service{
		Name: host, Namespace: "default", Hostname: host,
		Addresses: []*workloadpb.NetworkAddress{{Address: netip.MustParseAddr(vip).AsSlice()}},
		Ports:     []*workloadpb.Port{{ServicePort: 80, TargetPort: 8080}},
	}}})
}

func polRes(t *testing.T, name string) *discoverypb.Resource {
	return res(t, "default/"+name, xdspb.AuthorizationType, &securitypb.Authorization{Name: name, Namespace: "default", Scope: securitypb.Scope_NAMESPACE})
}

func push(t *testing.T, st grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse], typ, nonce string, resources []*discoverypb.Resource, removed ...string) {
	t.Helper()
	if err := st.Send(&discoverypb.DeltaDiscoveryResponse{TypeUrl: typ, Nonce: nonce, Resources: resources, RemovedResources: removed}); err != nil {
		t.Fatal(err)
	}
}

func expectAck(t *testing.T, s *adsServer, typ, nonce string) *discoverypb.DeltaDiscoveryRequest {
	t.Helper()
	r := s.req(t)
	if r.GetTypeUrl() != typ || r.GetResponseNonce() != nonce {
		t.Fatalf("got request type %q nonce %q; want ACK of %q %q", r.GetTypeUrl(), r.GetResponseNonce(), typ, nonce)
	}
	return r
}

func runClient(t *testing.T, c *Client) context.CancelFunc {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return cancel
}

func TestClientStream(t *testing.T) {
	leaktest.Check(t)
	srv := startADS(t, "127.0.0.1:0")
	store := state.NewStore()
	reg := prometheus.NewRegistry()
	c, err := NewClient(Config{
		Config:   istiogrpc.Config{Address: "http://" + srv.addr},
		NodeID:   "ztunnel~10.0.0.9~ztunnel-x.istio-system~istio-system.svc.cluster.local",
		Metadata: map[string]string{"NAME": "ztunnel-x", "NODE_NAME": "node-a"},
	}, store, metrics.New(reg, "test"))
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)

	// Initial sync: both types, wildcard, node id and metadata.
	st := srv.stream(t)
	init := srv.initial(t)
	for _, typ := range []string{xdspb.AddressType, xdspb.AuthorizationType} {
		r := init[typ]
		if r == nil {
			t.Fatalf("no initial request for %s", typ)
		}
		if len(r.GetResourceNamesSubscribe())+len(r.GetResourceNamesUnsubscribe())+len(r.GetInitialResourceVersions()) != 0 {
			t.Errorf("initial %s request not plain wildcard: %v", typ, r)
		}
		if r.GetNode().GetId() != "ztunnel~10.0.0.9~ztunnel-x.istio-system~istio-system.svc.cluster.local" ||
			r.GetNode().GetMetadata().GetFields()["NODE_NAME"].GetStringValue() != "node-a" {
			t.Errorf("node = %v", r.GetNode())
		}
	}
	if md := <-srv.md; slices.Compare(md.Get("clusterid"), []string{"Kubernetes"}) != 0 {
		t.Errorf("clusterid metadata = %v", md.Get("clusterid"))
	}
	select {
	case <-c.Synced():
		t.Fatal("synced before any response")
	default:
	}
	push(t, st, xdspb.AddressType, "n1", []*discoverypb.Resource{wlRes(t, "w1", "10.0.0.1"), wlRes(t, "w2", "10.0.0.2"), svcRes(t, "echo", "10.96.0.1")})
	if r := expectAck(t, srv, xdspb.AddressType, "n1"); r.GetErrorDetail() != nil {
		t.Fatalf("NACK of a good push: %v", r.GetErrorDetail())
	}
	push(t, st, xdspb.AuthorizationType, "n2", []*discoverypb.Resource{polRes(t, "p1")})
	expectAck(t, srv, xdspb.AuthorizationType, "n2")
	select {
	case <-c.Synced():
	case <-time.After(waitFor):
		t.Fatal("not synced after both types")
	}
	if store.WorkloadByIP("", netip.MustParseAddr("10.0.0.1")) == nil || store.ServiceByKey("default/echo") == nil || store.Policy("default/p1") == nil {
		t.Fatalf("initial push not applied: %v", store.Dump())
	}

	// Incremental: update w1's IP, remove w2 and the service; unknown types are ACKed.
	push(t, st, xdspb.AddressType, "n3", []*discoverypb.Resource{wlRes(t, "w1", "10.0.0.11")}, "w2", "default/echo")
	expectAck(t, srv, xdspb.AddressType, "n3")
	if store.WorkloadByIP("", netip.MustParseAddr("10.0.0.1")) != nil || store.WorkloadByIP("", netip.MustParseAddr("10.0.0.11")) == nil ||
		store.WorkloadByUID("w2") != nil || store.ServiceByKey("default/echo") != nil {
		t.Fatalf("incremental push not applied: %+v", store.Dump())
	}
	push(t, st, "type.googleapis.com/some.Unknown", "n4", nil)
	if r := expectAck(t, srv, "type.googleapis.com/some.Unknown", "n4"); r.GetErrorDetail() != nil {
		t.Errorf("unknown type NACKed: %v", r.GetErrorDetail())
	}

	// A push with one malformed resource: NACK names it; the others are applied.
	bad := &discoverypb.Resource{Name: "bad", Version: "v", Resource: &anypb.Any{TypeUrl: xdspb.AddressType, Value: []byte{0x0a, 0x05, 0xa2, 0x01, 0x00, 0xff, 0xff}}}
	badIP := res(t, "badip", xdspb.AddressType, &workloadpb.Address{Type: &workloadpb.Address_Workload{Workload: &workloadpb.Workload{Uid: "badip", Addresses: [][]byte{{1, 2, 3}}}}})
	push(t, st, xdspb.AddressType, "n5", []*discoverypb.Resource{bad, wlRes(t, "w3", "10.0.0.3"), badIP})
	r := expectAck(t, srv, xdspb.AddressType, "n5")
	msg := r.GetErrorDetail().GetMessage()
	if !strings.HasPrefix(msg, "bad: ") || !strings.Contains(msg, "; badip: ") || !strings.Contains(msg, "address of 3 bytes") {
		t.Errorf("NACK message = %q; want per-resource \"name: reason\"", msg)
	}
	if store.WorkloadByUID("w3") == nil {
		t.Error("valid resource in a partly bad push not applied")
	}
	if got := counterValue(c.metrics.XDSMessages.WithLabelValues(xdspb.AddressType)); got != 3 {
		t.Errorf("istio_xds_message_total{Address} = %v; want 3", got)
	}
	if got := counterValue(c.metrics.XDSMessageBytes.WithLabelValues(xdspb.AddressType)); got < 100 {
		t.Errorf("istio_xds_message_bytes_total{Address} = %v; want > 100", got)
	}
	if got, _ := testutil.Gather(t, reg).Sum("istio_xds_message_total", map[string]string{"url": xdspb.AddressType}); got != 3 {
		t.Errorf("the registry's istio_xds_message_total{Address} = %v; want 3: the client counts into the families it was handed", got)
	}

	// A bad update of a resource we hold: NACKed, the old one kept (and, below, still
	// claimed at its old version on reconnect, so the server can update or remove it).
	push(t, st, xdspb.AddressType, "n6", []*discoverypb.Resource{{Name: "w3", Version: "v2-w3", Resource: bad.Resource}})
	if r := expectAck(t, srv, xdspb.AddressType, "n6"); !strings.HasPrefix(r.GetErrorDetail().GetMessage(), "w3: ") {
		t.Errorf("bad update of w3: NACK %q", r.GetErrorDetail().GetMessage())
	}
	if store.WorkloadByIP("", netip.MustParseAddr("10.0.0.3")) == nil {
		t.Error("a rejected update dropped the workload it was to replace")
	}

	// Server restart: state is kept while disconnected, the client reconnects and sends the
	// versions it holds (not those of rejected resources or updates).
	addr := srv.addr
	srv.stop()
	testutil.Eventually(t, "a termination counted", func() bool {
		return counterValue(c.metrics.XDSConnectionTerminations.WithLabelValues(reasonReconnect))+counterValue(c.metrics.XDSConnectionTerminations.WithLabelValues(reasonError)) > 0
	})
	if store.WorkloadByUID("w1") == nil || store.Policy("default/p1") == nil {
		t.Fatal("state dropped while disconnected")
	}
	srv2 := startADS(t, addr)
	srv2.stream(t)
	init = srv2.initial(t)
	gotVers := init[xdspb.AddressType].GetInitialResourceVersions()
	if want := map[string]string{"w1": "v-w1", "w3": "v-w3"}; !maps(gotVers, want) {
		t.Errorf("initial_resource_versions = %v; want %v", gotVers, want)
	}
	if got := init[xdspb.AuthorizationType].GetInitialResourceVersions(); !maps(got, map[string]string{"default/p1": "v-default/p1"}) {
		t.Errorf("authorization initial_resource_versions = %v", got)
	}
}

func maps(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func TestClientOnDemand(t *testing.T) {
	leaktest.Check(t)
	srv := startADS(t, "127.0.0.1:0")
	store := state.NewStore()
	c, err := NewClient(Config{Config: istiogrpc.Config{Address: "http://" + srv.addr}, OnDemand: true}, store, nil)
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	st := srv.stream(t)
	init := srv.initial(t)
	if r := init[xdspb.AddressType]; slices.Compare(r.GetResourceNamesSubscribe(), []string{"*"}) != 0 || slices.Compare(r.GetResourceNamesUnsubscribe(), []string{"*"}) != 0 {
		t.Errorf("on-demand initial Address request = %v; want subscribe/unsubscribe [*]", r)
	}
	if r := init[xdspb.AuthorizationType]; len(r.GetResourceNamesSubscribe()) != 0 {
		t.Errorf("authorization must stay wildcard: %v", r)
	}
	push(t, st, xdspb.AuthorizationType, "a1", nil)
	expectAck(t, srv, xdspb.AuthorizationType, "a1")
	select { // Address is on-demand, so Authorization alone syncs
	case <-c.Synced():
	case <-time.After(waitFor):
		t.Fatal("not synced")
	}

	got := make(chan error, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), waitFor)
		defer cancel()
		got <- c.DemandAddress(ctx, "", netip.MustParseAddr("10.0.0.5"))
	}()
	r := srv.req(t)
	if r.GetTypeUrl() != xdspb.AddressType || slices.Compare(r.GetResourceNamesSubscribe(), []string{"/10.0.0.5"}) != 0 {
		t.Fatalf("on-demand request = %v", r)
	}
	select {
	case err := <-got:
		t.Fatalf("Demand returned before the resource arrived: %v", err)
	default:
	}
	push(t, st, xdspb.AddressType, "d1", []*discoverypb.Resource{wlRes(t, "w5", "10.0.0.5", "/10.0.0.5")})
	expectAck(t, srv, xdspb.AddressType, "d1")
	if err := <-got; err != nil {
		t.Fatalf("Demand: %v", err)
	}
	if store.WorkloadByIP("", netip.MustParseAddr("10.0.0.5")) == nil {
		t.Fatal("demanded workload not in store")
	}
	// Already present: no request, immediate return.
	if err := c.Demand(context.Background(), "w5"); err != nil {
		t.Fatal(err)
	}
	// A name the server never sends: the caller's context bounds the wait.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := c.Demand(ctx, "/10.0.0.77"); err == nil || !strings.Contains(err.Error(), "deadline") {
		t.Errorf("Demand of a missing name = %v; want deadline error", err)
	}
}

func selfSigned(t *testing.T, dir string) (tls.Certificate, string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "istiod"},
		DNSNames: []string{"istiod.istio-system.svc"}, NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		IsCA: true, BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	certPEM := string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, certPEM
}

func TestClientTLSAndHeaders(t *testing.T) {
	leaktest.Check(t)
	dir := t.TempDir()
	cert, rootPEM := selfSigned(t, dir)
	srv := startADS(t, "127.0.0.1:0", grpc.Creds(credentials.NewServerTLSFromCert(&cert)))
	tokenFile := filepath.Join(dir, "token")
	if err := os.WriteFile(tokenFile, []byte("tok-1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	rootFile := filepath.Join(dir, "root.pem")
	if err := os.WriteFile(rootFile, []byte(rootPEM), 0o600); err != nil {
		t.Fatal(err)
	}
	c, err := NewClient(Config{
		Config: istiogrpc.Config{
			Address: srv.addr, RootCA: rootFile, AltHostname: "istiod.istio-system.svc", // no scheme: TLS
			TokenFile: tokenFile, ClusterID: "c1", Headers: map[string]string{"X-Extra": "v"},
		},
	}, state.NewStore(), nil)
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	srv.stream(t)
	md := <-srv.md
	if got := md.Get("authorization"); slices.Compare(got, []string{"Bearer tok-1"}) != 0 {
		t.Errorf("authorization = %v", got)
	}
	if got := md.Get("clusterid"); slices.Compare(got, []string{"c1"}) != 0 {
		t.Errorf("clusterid = %v", got)
	}
	if got := md.Get("x-extra"); slices.Compare(got, []string{"v"}) != 0 {
		t.Errorf("x-extra = %v", got)
	}
	srv.initial(t)

	// The wrong server name never gets a stream: TLS verification is on.
	bad, err := NewClient(Config{Config: istiogrpc.Config{Address: "https://" + srv.addr, RootCA: rootPEM}}, state.NewStore(), nil)
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, bad)
	waitConnectionErrors(t, bad, 2, "a bad server name")
	select {
	case <-srv.streams:
		t.Fatal("stream opened despite failing server verification")
	default:
	}
}

func TestClientConfigErrors(t *testing.T) {
	for _, cfg := range []Config{
		{},
		{Config: istiogrpc.Config{Address: "ftp://x:1"}},
		{Config: istiogrpc.Config{Address: "https://x:1", RootCA: "/nonexistent/root.pem"}},
		{Config: istiogrpc.Config{Address: "https://x:1", RootCA: "-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----"}},
	} {
		if _, err := NewClient(cfg, state.NewStore(), nil); err == nil || !strings.HasPrefix(err.Error(), "xds: ") {
			t.Errorf("NewClient(%+v) = %v; want an xds: error", cfg, err)
		}
	}
	if _, err := NewClient(Config{Config: istiogrpc.Config{Address: "http://x:1"}}, state.NewStore(), nil); err != nil {
		t.Errorf("plaintext config rejected: %v", err)
	}
}

func TestClassify(t *testing.T) {
	for _, tc := range []struct {
		err    error
		got    bool
		reason string
		delay  time.Duration
	}{
		{nil, true, reasonComplete, 0},
		{&connectError{os.ErrNotExist}, false, reasonConnectionError, time.Second},
		{statusErr(1, "x"), true, reasonReconnect, quickReconnect}, // Canceled
		{statusErr(4, "x"), true, reasonReconnect, quickReconnect}, // DeadlineExceeded
		{statusErr(14, "transport is closing"), true, reasonReconnect, quickReconnect},
		{statusErr(14, "received prior goaway"), true, reasonReconnect, quickReconnect},
		{statusErr(14, "connection refused"), false, reasonConnectionError, time.Second},
		{statusErr(7, "denied"), true, reasonError, time.Second},
	} {
		reason, delay := classify(tc.err, tc.got, time.Second)
		if reason != tc.reason || delay != tc.delay {
			t.Errorf("classify(%v) = %s %v; want %s %v", tc.err, reason, delay, tc.reason, tc.delay)
		}
	}
}

func statusErr(code uint32, msg string) error { return status.Error(codes.Code(code), msg) }

// waitConnectionErrors waits until c has counted n ConnectionError terminations.
func waitConnectionErrors(t *testing.T, c *Client, n float64, what string) {
	t.Helper()
	testutil.Eventually(t, fmt.Sprintf("%v connection errors counted for %s", n, what), func() bool {
		return counterValue(c.metrics.XDSConnectionTerminations.WithLabelValues(reasonConnectionError)) >= n
	})
}

func counterValue(c prometheus.Counter) float64 {
	var m dto.Metric
	if err := c.Write(&m); err != nil {
		panic(err)
	}
	return m.GetCounter().GetValue()
}

func TestClientReconnectAfterCleanEnd(t *testing.T) {
	leaktest.Check(t)
	srv := startADS(t, "127.0.0.1:0")
	c, err := NewClient(Config{Config: istiogrpc.Config{Address: "http://" + srv.addr}, OnDemand: true}, state.NewStore(), nil)
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	st := srv.stream(t)
	srv.initial(t)
	go func() { _ = c.Demand(context.Background(), "default/echo.svc") }()
	srv.req(t) // the on-demand subscription
	push(t, st, xdspb.AddressType, "d1", []*discoverypb.Resource{svcRes(t, "echo.svc", "10.96.0.1")})
	expectAck(t, srv, xdspb.AddressType, "d1")

	srv.end <- struct{}{} // status OK: ztunnel reconnects at once
	srv.stream(t)
	init := srv.initial(t)
	r := init[xdspb.AddressType]
	if !slices.Contains(r.GetResourceNamesSubscribe(), "default/echo.svc") || r.GetInitialResourceVersions()["default/echo.svc"] != "v-default/echo.svc" {
		t.Errorf("reconnect request = %v; want the demanded name resubscribed with its version", r)
	}
	if got := counterValue(c.metrics.XDSConnectionTerminations.WithLabelValues(reasonComplete)); got != 1 {
		t.Errorf("terminations{Complete} = %v; want 1", got)
	}
}

// TestClientTokenFile: AUTH_TOKEN is "ignored if missing", as the help says: with no file
// the stream opens without authorization (istiod's plaintext 15010 asks for none) and one
// WARN names the path; a path that exists but cannot be read is an error.
func TestClientTokenFile(t *testing.T) {
	leaktest.Check(t)
	srv := startADS(t, "127.0.0.1:0")
	tok := filepath.Join(t.TempDir(), "istio-token")
	logs := &logtest.Recorder{}
	c, err := NewClient(Config{Config: istiogrpc.Config{Address: "http://" + srv.addr, TokenFile: tok}, Logger: logs.Logger()}, state.NewStore(), nil)
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	srv.stream(t)
	if got := (<-srv.md).Get("authorization"); len(got) != 0 {
		t.Errorf("authorization = %q with no token file; want none", got)
	}
	if w := logs.Lines(slog.LevelWarn); len(w) != 1 || !strings.Contains(w[0], tok) {
		t.Errorf("warnings = %q; want one naming %s", w, tok)
	}

	if err := os.WriteFile(tok, []byte("tok-1\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	srv.end <- struct{}{} // the client reconnects at once and reads the token again
	srv.stream(t)
	if got := (<-srv.md).Get("authorization"); slices.Compare(got, []string{"Bearer tok-1"}) != 0 {
		t.Errorf("authorization = %q once the file exists; want Bearer tok-1", got)
	}

	if err := os.Remove(tok); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(tok, 0o700); err != nil {
		t.Fatal(err)
	}
	srv.end <- struct{}{}
	testutil.EventuallyNil(t, func() error {
		warns := logs.Lines(slog.LevelWarn)
		if !slices.ContainsFunc(warns, func(l string) bool {
			return strings.Contains(l, "xds: AUTH_TOKEN") && strings.Contains(l, "is a directory")
		}) {
			return fmt.Errorf("no token read error logged for a directory; warnings: %q", warns)
		}
		return nil
	})
	select {
	case <-srv.streams:
		t.Error("stream opened with an unreadable token file")
	default:
	}
}

// TestClientWarnsOncePerError: a control plane that stays unreachable is one WARN, not one
// per retry; every failed attempt still reaches OnError (readiness shows the latest).
func TestClientWarnsOncePerError(t *testing.T) {
	leaktest.Check(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	logs := &logtest.Recorder{}
	errs := make(chan error, 100)
	c, err := NewClient(Config{
		Config: istiogrpc.Config{Address: "http://" + dead},
		Logger: logs.Logger(),
		OnError: func(err error) {
			select {
			case errs <- err:
			default:
			}
		},
	}, state.NewStore(), nil)
	if err != nil {
		t.Fatal(err)
	}
	runClient(t, c)
	for i := range 4 { // retries 10, 20, 40 ms apart
		select {
		case err := <-errs:
			if !strings.Contains(err.Error(), dead) {
				t.Errorf("OnError(%v); want the connect error naming %s", err, dead)
			}
		case <-time.After(waitFor):
			t.Fatalf("OnError called %d times; want 4", i)
		}
	}
	if w := logs.Lines(slog.LevelWarn); len(w) != 1 {
		t.Errorf("%d WARNs after 4 failed attempts with the same error; want 1:\n%s", len(w), strings.Join(w, "\n"))
	}
}

// TestClientRoots: the endpoint's roots through the client, on an address with no scheme
// (TLS): inline PEM verifies, SYSTEM is the OS roots (which do not hold this test's), and a
// root file is read again when the client reconnects, so a rotated root needs no restart.
func TestClientRoots(t *testing.T) {
	leaktest.Check(t)
	dir := t.TempDir()
	oldCert, oldPEM := selfSigned(t, dir)
	newCert, newPEM := selfSigned(t, dir)
	var mu sync.Mutex
	serving := &oldCert
	srv := startADS(t, "127.0.0.1:0", grpc.Creds(credentials.NewTLS(&tls.Config{
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			mu.Lock()
			defer mu.Unlock()
			return serving, nil
		},
	})))
	const alt = "istiod.istio-system.svc"
	newC := func(rootCA string) *Client {
		c, err := NewClient(Config{Config: istiogrpc.Config{Address: srv.addr, RootCA: rootCA, AltHostname: alt}}, state.NewStore(), nil)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}

	stop := runClient(t, newC(oldPEM))
	srv.stream(t)
	if got := (<-srv.md).Get("clusterid"); slices.Compare(got, []string{"Kubernetes"}) != 0 {
		t.Errorf("default clusterid = %q; want Kubernetes", got)
	}
	srv.initial(t)
	stop()

	system := newC("SYSTEM")
	runClient(t, system)
	waitConnectionErrors(t, system, 1, "RootCA SYSTEM (the OS does not hold the test's root)")

	rootFile := filepath.Join(dir, "root.pem")
	if err := os.WriteFile(rootFile, []byte(oldPEM), 0o600); err != nil {
		t.Fatal(err)
	}
	runClient(t, newC(rootFile))
	srv.stream(t)
	srv.initial(t)
	mu.Lock()
	serving = &newCert
	mu.Unlock()
	if err := os.WriteFile(rootFile, []byte(newPEM), 0o600); err != nil {
		t.Fatal(err)
	}
	srv.end <- struct{}{} // the client reconnects at once, to the server's new certificate
	srv.stream(t)
	srv.initial(t)
	select {
	case <-srv.streams:
		t.Error("SYSTEM client opened a stream")
	default:
	}
}

// A resource resent with the bytes the store holds (a control plane resending everything)
// is accepted at its new version without being converted again: the stored value stays and
// the version listed on reconnect moves. Changed bytes replace the value.
func TestUnchangedResourceKeepsValue(t *testing.T) {
	store := state.NewStore()
	c, err := NewClient(Config{Config: istiogrpc.Config{Address: "http://127.0.0.1:1"}}, store, nil)
	if err != nil {
		t.Fatal(err)
	}
	w, s, p := wlRes(t, "w1", "10.0.0.1"), svcRes(t, "svc1", "10.96.0.1"), polRes(t, "p1")
	for _, typ := range []string{xdspb.AddressType, xdspb.AuthorizationType} {
		rs := []*discoverypb.Resource{w, s}
		if typ == xdspb.AuthorizationType {
			rs = []*discoverypb.Resource{p}
		}
		if ack := c.handle(&discoverypb.DeltaDiscoveryResponse{TypeUrl: typ, Nonce: "1", Resources: rs}); ack.GetErrorDetail() != nil {
			t.Fatal(ack.GetErrorDetail())
		}
	}
	w0, s0, p0 := store.WorkloadByUID("w1"), store.ServiceByKey("default/svc1"), store.Policy("default/p1")
	if w0 == nil || s0 == nil || p0 == nil || w0.Digest == 0 || s0.Digest == 0 || p0.Digest == 0 {
		t.Fatalf("first push: %v %v %v", w0, s0, p0)
	}
	again := func(r *discoverypb.Resource) *discoverypb.Resource {
		c := proto.Clone(r).(*discoverypb.Resource)
		c.Version = "v2"
		return c
	}
	changed := wlRes(t, "w1", "10.0.0.9")
	changed.Version = "v3"
	c.handle(&discoverypb.DeltaDiscoveryResponse{TypeUrl: xdspb.AddressType, Nonce: "2", Resources: []*discoverypb.Resource{again(w), again(s)}})
	c.handle(&discoverypb.DeltaDiscoveryResponse{TypeUrl: xdspb.AuthorizationType, Nonce: "2", Resources: []*discoverypb.Resource{again(p)}})
	if store.WorkloadByUID("w1") != w0 || store.ServiceByKey("default/svc1") != s0 || store.Policy("default/p1") != p0 {
		t.Error("a resource resent unchanged was converted again")
	}
	for k := range c.versions[xdspb.AddressType].strs {
		if k == w0.UID && unsafe.StringData(k) != unsafe.StringData(w0.UID) {
			t.Error("the version map keeps a copy of the uid, not the workload's own string")
		}
	}
	for _, r := range c.initialRequests() {
		for name, v := range r.GetInitialResourceVersions() {
			if v != "v2" {
				t.Errorf("%s: version %q listed on reconnect; want v2", name, v)
			}
		}
	}
	c.handle(&discoverypb.DeltaDiscoveryResponse{TypeUrl: xdspb.AddressType, Nonce: "3", Resources: []*discoverypb.Resource{changed}})
	if got := store.WorkloadByUID("w1"); got == w0 || got == nil || got.Addresses[0] != netip.MustParseAddr("10.0.0.9") {
		t.Errorf("a changed resource kept the old value: %v", got)
	}
	if store.WorkloadByIP("", netip.MustParseAddr("10.0.0.1")) != nil {
		t.Error("the old address is still indexed")
	}
}
