package scaletest

import (
	"errors"
	"hash/fnv"
	"math/rand/v2"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/proto"

	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
)

// controlPlane is a delta ADS server serving one node a mesh, as the harness drives it:
// adsServer (ours, in the test's process) or xdsControl (go-control-plane's, a process of
// its own).
type controlPlane interface {
	// push sends an update of one type's resources and removals and returns the time from
	// the response's first byte to the client's ACK; errUnchanged if the server sent nothing.
	push(typ string, update []*discoverypb.Resource, remove []string) (time.Duration, error)
	// drop ends the current stream as a control plane restart would.
	drop()
	// answeredAcked is typ's last subscription answer and when its ACK arrived (zero if not yet).
	answeredAcked(typ string) (answer, time.Time)
	// reconnectVersions is how many resource versions the current stream's Address
	// subscription listed.
	reconnectVersions() int
	stop()
}

// errUnchanged is a push the server answered with nothing: it holds every resource at the
// version it holds already (go-control-plane's versions are hashes of the content).
var errUnchanged = errors.New("scaletest: the server sent nothing (unchanged)")

// shape is how our server frames and versions what it sends.
type shape int

const (
	// shapeOwn sends in the mesh's order (workloads, then services), versions as generated
	// ("1", then each push's generation).
	shapeOwn shape = iota
	// shapeIstiod sends as istiod's delta xDS does (pilot/pkg/xds/workload.go, delta.go): one
	// response per push, however large; workloads then services, each in map order
	// (krt collections' List); each Address at a version that hashes its content
	// (xxhash64 in hex there, FNV-1a 64 here); Authorization at no version.
	shapeIstiod
)

func (sh shape) String() string {
	if sh == shapeIstiod {
		return "istiod"
	}
	return "gozt"
}

// reshape returns rs as sh sends them: for istiod's, copies in a random order at
// content-hash versions. rs is not changed (meshes are shared between runs).
func (sh shape) reshape(typ string, rs []*discoverypb.Resource) []*discoverypb.Resource {
	if sh != shapeIstiod {
		return rs
	}
	out := make([]*discoverypb.Resource, len(rs))
	for i, r := range rs {
		v := ""
		if typ == xdspb.AddressType {
			h := fnv.New64a()
			h.Write(r.GetResource().GetValue())
			v = strconv.FormatUint(h.Sum64(), 16)
		}
		out[i] = &discoverypb.Resource{Name: r.Name, Version: v, Resource: r.Resource}
	}
	rand.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// adsServer is a real delta ADS server over gRPC, ours: it holds each type's resources by
// name, answers a wildcard subscription with what the client lacks (initial_resource_versions
// honoured: resources it holds at the same version are not resent, ones it holds that are
// gone are listed as removed), pushes deltas on request and records when each nonce is
// ACKed. It serves one node.
type adsServer struct {
	discoverypb.UnimplementedAggregatedDiscoveryServiceServer
	addr  string
	shape shape
	srv   *grpc.Server
	done  chan struct{}
	recv  sync.WaitGroup // the streams' receive loops

	mu       sync.Mutex
	res      map[string][]*discoverypb.Resource // type URL -> resources in send order
	names    map[string]map[string]int          // type URL -> name -> index in res
	cur      *adsStream
	streams  chan *adsStream // each new stream, for tests that wait for a reconnect
	acks     map[string]chan error
	nonce    int
	answered map[string]answer    // type URL -> the last subscription's answer
	ackedAt  map[string]time.Time // nonce -> when its ACK arrived
}

// answer is when a subscription's answer began to be sent, its nonce and its size.
type answer struct {
	start     time.Time
	nonce     string
	resources int
	bytes     int
}

type adsStream struct {
	st     grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse]
	sendMu sync.Mutex
	kill   chan struct{}
	once   sync.Once
	// initialVersions is how many resource versions the client's Address subscription listed.
	initialVersions int
}

// startADS serves m shaped as sh on a loopback port of the test's own namespace, plaintext.
func startADS(m *mesh, sh shape) (*adsServer, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	return serveADS(m, sh, ln)
}

// serveADS serves m shaped as sh on ln with the server options given (TLS for the Rust
// ztunnel, which speaks only https to its control plane).
func serveADS(m *mesh, sh shape, ln net.Listener, opts ...grpc.ServerOption) (*adsServer, error) {
	addrs := slices.Clone(m.addresses) // pushes change the server's lists, and the next node gets m afresh
	if sh == shapeIstiod {
		addrs = append(sh.reshape(xdspb.AddressType, m.addresses[:m.workloads]), sh.reshape(xdspb.AddressType, m.addresses[m.workloads:])...)
	}
	s := &adsServer{
		addr: ln.Addr().String(), shape: sh, done: make(chan struct{}),
		res:   map[string][]*discoverypb.Resource{xdspb.AddressType: addrs, xdspb.AuthorizationType: slices.Clone(sh.reshape(xdspb.AuthorizationType, m.policies))},
		names: map[string]map[string]int{}, acks: map[string]chan error{}, answered: map[string]answer{}, ackedAt: map[string]time.Time{},
		streams: make(chan *adsStream, 16),
	}
	for typ, rs := range s.res {
		idx := make(map[string]int, len(rs))
		for i, r := range rs {
			idx[r.Name] = i
		}
		s.names[typ] = idx
	}
	// A reconnecting client's first request lists every resource version it holds: at 1M
	// workloads about 70 MB, past gRPC's 4 MiB default.
	s.srv = grpc.NewServer(append([]grpc.ServerOption{grpc.MaxRecvMsgSize(1 << 30),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: time.Second, PermitWithoutStream: true})}, opts...)...)
	discoverypb.RegisterAggregatedDiscoveryServiceServer(s.srv, s)
	go func() { defer close(s.done); _ = s.srv.Serve(ln) }()
	return s, nil
}

func (s *adsServer) stop() {
	s.srv.Stop()
	<-s.done
	s.recv.Wait()
}

func (s *adsServer) DeltaAggregatedResources(st grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse]) error {
	as := &adsStream{st: st, kill: make(chan struct{})}
	s.mu.Lock()
	s.cur = as
	s.mu.Unlock()
	select {
	case s.streams <- as:
	default:
	}
	reqs := make(chan *discoverypb.DeltaDiscoveryRequest)
	s.recv.Add(1)
	go s.receive(st, reqs)
	for {
		var req *discoverypb.DeltaDiscoveryRequest
		select {
		case <-as.kill:
			return errors.New("scaletest: stream dropped")
		case <-st.Context().Done():
			return nil
		case req = <-reqs:
		}
		if req == nil {
			return nil
		}
		if n := req.GetResponseNonce(); n != "" {
			s.ack(n, req)
			continue
		}
		if err := s.answer(as, req); err != nil {
			return err
		}
	}
}

// receive forwards the stream's requests until it ends, then sends nil.
func (s *adsServer) receive(st grpc.BidiStreamingServer[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse], reqs chan<- *discoverypb.DeltaDiscoveryRequest) {
	defer s.recv.Done()
	for {
		req, err := st.Recv()
		if err != nil {
			req = nil
		}
		select {
		case reqs <- req:
		case <-st.Context().Done():
			return
		}
		if req == nil {
			return
		}
	}
}

func (s *adsServer) ack(nonce string, req *discoverypb.DeltaDiscoveryRequest) {
	s.mu.Lock()
	s.ackedAt[nonce] = time.Now()
	ch := s.acks[nonce]
	delete(s.acks, nonce)
	s.mu.Unlock()
	if ch == nil {
		return
	}
	if d := req.GetErrorDetail(); d != nil {
		ch <- errors.New("NACK: " + d.GetMessage())
		return
	}
	ch <- nil
}

// answer sends a subscription what the client lacks of its type.
func (s *adsServer) answer(as *adsStream, req *discoverypb.DeltaDiscoveryRequest) error {
	typ := req.GetTypeUrl()
	have := req.GetInitialResourceVersions()
	s.mu.Lock()
	resp := &discoverypb.DeltaDiscoveryResponse{TypeUrl: typ}
	for _, r := range s.res[typ] {
		if v, ok := have[r.Name]; !ok || v != r.Version {
			resp.Resources = append(resp.Resources, r)
		}
	}
	for name := range have {
		if _, ok := s.names[typ][name]; !ok {
			resp.RemovedResources = append(resp.RemovedResources, name)
		}
	}
	if typ == xdspb.AddressType {
		as.initialVersions = len(have)
	}
	s.mu.Unlock()
	a := answer{resources: len(resp.Resources), bytes: proto.Size(resp)}
	_, start, err := s.send(as, resp)
	s.mu.Lock()
	a.nonce, a.start = resp.Nonce, start
	s.answered[typ] = a
	s.mu.Unlock()
	return err
}

// send sends resp with a fresh nonce and returns the channel its ACK (nil) or NACK arrives
// on and when its first byte went out: it is marshalled first, so that the server's own
// marshalling (a second at 1M) is not counted as the client's.
func (s *adsServer) send(as *adsStream, resp *discoverypb.DeltaDiscoveryResponse) (<-chan error, time.Time, error) {
	ch := make(chan error, 1)
	s.mu.Lock()
	s.nonce++
	resp.Nonce = strconv.Itoa(s.nonce)
	s.acks[resp.Nonce] = ch
	s.mu.Unlock()
	as.sendMu.Lock()
	defer as.sendMu.Unlock()
	var pm grpc.PreparedMsg
	if err := pm.Encode(as.st, resp); err != nil {
		return ch, time.Time{}, err
	}
	start := time.Now()
	return ch, start, as.st.SendMsg(&pm)
}

// push updates or adds resources of one type, removes names, sends the delta on the
// current stream and returns when the client has ACKed it.
func (s *adsServer) push(typ string, update []*discoverypb.Resource, remove []string) (time.Duration, error) {
	update = s.shape.reshape(typ, update)
	s.mu.Lock()
	idx := s.names[typ]
	for _, r := range update {
		if i, ok := idx[r.Name]; ok {
			s.res[typ][i] = r
		} else {
			idx[r.Name] = len(s.res[typ])
			s.res[typ] = append(s.res[typ], r)
		}
	}
	if len(remove) > 0 {
		gone := make(map[string]bool, len(remove))
		for _, n := range remove {
			gone[n] = true
		}
		kept := s.res[typ][:0]
		for _, r := range s.res[typ] {
			if !gone[r.Name] {
				kept = append(kept, r)
			}
		}
		clear(s.res[typ][len(kept):])
		s.res[typ] = kept
		clear(idx)
		for i, r := range kept {
			idx[r.Name] = i
		}
	}
	as := s.cur
	s.mu.Unlock()
	if as == nil {
		return 0, errors.New("scaletest: no stream")
	}
	ch, start, err := s.send(as, &discoverypb.DeltaDiscoveryResponse{TypeUrl: typ, Resources: update, RemovedResources: remove})
	if err != nil {
		return 0, err
	}
	select {
	case err = <-ch:
	case <-time.After(10 * time.Minute): // a 1M push on a loaded 2-core machine took over 2
		err = errors.New("scaletest: no ACK within 10m")
	}
	return time.Since(start), err
}

// drop ends the current stream as a control plane restart would.
func (s *adsServer) drop() {
	s.mu.Lock()
	as := s.cur
	s.cur = nil
	s.mu.Unlock()
	if as != nil {
		as.once.Do(func() { close(as.kill) })
	}
}

func (s *adsServer) answeredAcked(typ string) (answer, time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	a := s.answered[typ]
	return a, s.ackedAt[a.nonce]
}

func (s *adsServer) reconnectVersions() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cur == nil {
		return 0
	}
	return s.cur.initialVersions
}
