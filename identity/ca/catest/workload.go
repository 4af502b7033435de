package catest

import (
	"crypto/x509"
	"net"
	"path/filepath"
	"sync"
	"testing"

	"github.com/spiffe/go-spiffe/v2/proto/spiffe/workload"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/gozt/gozt/identity/ca"
)

// Agent is a SPIFFE Workload API server (the part of a SPIRE agent a workload talks to) on a
// unix socket, streaming whatever X.509 context the test sets.
type Agent struct {
	workload.UnimplementedSpiffeWorkloadAPIServer
	Socket string // path of the unix socket

	srv  *grpc.Server
	done chan struct{}
	once sync.Once

	mu      sync.Mutex
	resp    *workload.X509SVIDResponse
	changed chan struct{}
	streams int
}

// StartAgent serves the Workload API on a socket in a fresh temporary directory until tb ends.
// Nothing is sent until the first Set.
func StartAgent(tb testing.TB) *Agent {
	tb.Helper()
	sock := filepath.Join(tb.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		tb.Fatal(err)
	}
	a := &Agent{Socket: sock, srv: grpc.NewServer(), done: make(chan struct{}), changed: make(chan struct{})}
	workload.RegisterSpiffeWorkloadAPIServer(a.srv, a)
	go func() {
		defer close(a.done)
		a.srv.Serve(ln)
	}()
	tb.Cleanup(a.Stop)
	return a
}

// Stop stops the server and waits for it; it is idempotent.
func (a *Agent) Stop() {
	a.once.Do(func() {
		a.srv.Stop()
		<-a.done
	})
}

// Streams returns how many FetchX509SVID streams were opened.
func (a *Agent) Streams() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.streams
}

// Set pushes SVIDs (their Roots become the trust domain bundle) and federated bundles keyed
// by trust domain name to every open stream and later ones.
func (a *Agent) Set(tb testing.TB, svids []*ca.Issued, federated map[string][]*x509.Certificate) {
	tb.Helper()
	resp := &workload.X509SVIDResponse{FederatedBundles: map[string][]byte{}}
	for _, s := range svids {
		id, err := s.Identity()
		if err != nil {
			tb.Fatal(err)
		}
		key, err := x509.MarshalPKCS8PrivateKey(s.Certificate.PrivateKey)
		if err != nil {
			tb.Fatal(err)
		}
		var chain, bundle []byte
		for _, c := range s.Certificate.Certificate {
			chain = append(chain, c...)
		}
		for _, r := range s.Roots {
			bundle = append(bundle, r.Raw...)
		}
		resp.Svids = append(resp.Svids, &workload.X509SVID{SpiffeId: id.String(), X509Svid: chain, X509SvidKey: key, Bundle: bundle})
	}
	for td, roots := range federated {
		var b []byte
		for _, r := range roots {
			b = append(b, r.Raw...)
		}
		resp.FederatedBundles["spiffe://"+td] = b
	}
	a.mu.Lock()
	a.resp = resp
	close(a.changed)
	a.changed = make(chan struct{})
	a.mu.Unlock()
}

// FetchX509SVID streams the current context and every later one, as an agent does.
func (a *Agent) FetchX509SVID(_ *workload.X509SVIDRequest, stream grpc.ServerStreamingServer[workload.X509SVIDResponse]) error {
	md, _ := metadata.FromIncomingContext(stream.Context())
	if v := md.Get("workload.spiffe.io"); len(v) != 1 || v[0] != "true" {
		return status.Error(codes.InvalidArgument, "security header missing from request")
	}
	a.mu.Lock()
	a.streams++
	a.mu.Unlock()
	for {
		a.mu.Lock()
		resp, ch := a.resp, a.changed
		a.mu.Unlock()
		if resp != nil {
			if err := stream.Send(resp); err != nil {
				return err
			}
		}
		select {
		case <-ch:
		case <-stream.Context().Done():
			return nil
		}
	}
}
