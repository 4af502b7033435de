// Package xds is the control-plane side of the workload cache: a delta ADS client for Istio's
// Address and Authorization resources, and a local YAML file source. Both decode resources
// into xds/state values outside any lock and apply each push to the state.Store as one Batch.
//
// Wire overview: one gRPC bidi stream envoy.service.discovery.v3.AggregatedDiscoveryService/
// DeltaAggregatedResources. The client opens it with one DeltaDiscoveryRequest per type URL
// (node, type_url, wildcard or on-demand subscriptions, initial_resource_versions of the
// resources it accepted), then answers every DeltaDiscoveryResponse with an ACK
// {type_url, response_nonce}, or a NACK whose error_detail lists "name: reason" for each
// rejected resource while the valid ones in the same push are still applied.
//
// It does not own certificates, the proxy, or the admin server; it only fills the Store.
package xds

import (
	"context"
	"errors"
	"fmt"
	"hash/maphash"
	"io"
	"log/slog"
	"net"
	"net/netip"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"

	"github.com/gozt/gozt/internal/istiogrpc"
	"github.com/gozt/gozt/metrics"
	"github.com/gozt/gozt/xds/state"
	"github.com/gozt/gozt/xds/xdspb"
	"github.com/gozt/gozt/xds/xdspb/discoverypb"
	"github.com/gozt/gozt/xds/xdspb/securitypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

// Timings ztunnel uses.
const (
	connectTimeout    = 5 * time.Second
	keepaliveTime     = 30 * time.Second
	keepaliveTimeout  = 10 * time.Second
	maxRecvMsgSize    = maxPush
	backoffInitial    = 10 * time.Millisecond
	backoffMax        = 15 * time.Second
	quickReconnect    = 10 * time.Millisecond
	tcpKeepaliveIdle  = 300 * time.Second
	tcpKeepaliveIntvl = 75 * time.Second
	tcpKeepaliveCount = 9
)

// maxPush is the largest DeltaDiscoveryResponse the client takes. A control plane need not
// chunk: a wildcard subscription to a mesh of 1,000,000 workloads and 66,666 services is
// one message of 363 MB (about 340 bytes a dual-stack workload), past gRPC's and the Rust
// ztunnel's 200 MiB, and a node refusing it retries for ever. 1 GiB takes that mesh with
// workload records three times larger; streamCodec converts the message as it is walked
// and frees it behind, so the node does not hold it twice over.
const maxPush = 1 << 30

// releaseAfterRemoving is the number of removals from which a push that leaves the store
// smaller than it removed hands the freed memory back to the OS at once.
const releaseAfterRemoving = 10_000

// Config configures the delta ADS client. The zero value of each field is its documented default.
type Config struct {
	// The control plane's endpoint (XDS_ADDRESS, XDS_ROOT_CA, ALT_XDS_HOSTNAME, AUTH_TOKEN,
	// CLUSTER_ID, XDS_HEADER_*), with internal/istiogrpc's defaults: "host:port" is TLS,
	// "http://" plaintext; the root file and the token are read again at each connect.
	istiogrpc.Config
	// NodeID is "ztunnel~IP~pod.ns~ns.svc.cluster.local"; istiod keys the proxy type off it.
	NodeID string
	// Metadata are the node metadata string fields (NAME, NAMESPACE, INSTANCE_IPS, ...).
	Metadata map[string]string
	// OnDemand subscribes to no addresses up front; Demand fetches them as needed.
	OnDemand bool
	// Logger defaults to slog.Default().
	Logger *slog.Logger
	// OnError, if set, is called by Run with the error that ended each failed stream (a
	// node's readiness shows it).
	OnError func(error)
}

// Termination reasons, the values of istio_xds_connection_terminations_total{reason}.
const (
	reasonConnectionError = "ConnectionError"
	reasonError           = "Error"
	reasonReconnect       = "Reconnect"
	reasonComplete        = "Complete"
)

// Client is a delta ADS client feeding a state.Store. Create with NewClient, drive with Run.
type Client struct {
	cfg     Config
	store   *state.Store
	log     *slog.Logger
	metrics *metrics.Metrics // the istio_xds_* families
	ep      *istiogrpc.Endpoint

	synced     chan struct{}
	syncedOnce sync.Once

	sendMu sync.Mutex // serialises Send on the current stream
	stream grpc.BidiStreamingClient[discoverypb.DeltaDiscoveryRequest, discoverypb.DeltaDiscoveryResponse]

	mu       sync.Mutex
	versions map[string]*versionMap     // by type URL
	demanded map[string]struct{}        // on-demand names subscribed so far
	waiters  map[string][]chan struct{} // on-demand names awaited
	seen     map[string]bool            // type URLs with a handled response
}

// NewClient checks cfg and builds a client; it does not connect. It counts into m's xDS
// families (metrics.New declares them with the rest of Istio's); nil m counts into a
// registry of its own that nothing scrapes.
func NewClient(cfg Config, store *state.Store, m *metrics.Metrics) (*Client, error) {
	if store == nil {
		return nil, errors.New("xds: nil store")
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	log := cfg.Logger.With("component", "xds")
	ep, err := istiogrpc.New("XDS", cfg.Config, log)
	if err != nil {
		return nil, err
	}
	if m == nil {
		m = metrics.New(prometheus.NewRegistry(), "")
	}
	return &Client{
		cfg: cfg, store: store, log: log, metrics: m,
		ep:       ep,
		synced:   make(chan struct{}),
		versions: map[string]*versionMap{xdspb.AddressType: {}, xdspb.AuthorizationType: {}},
		demanded: make(map[string]struct{}),
		waiters:  make(map[string][]chan struct{}),
		seen:     make(map[string]bool),
	}, nil
}

// Synced is closed once every non-on-demand type has had its first response handled.
func (c *Client) Synced() <-chan struct{} { return c.synced }

// Run connects, streams and reconnects with ztunnel's backoff until ctx ends; it then returns
// nil. The Store keeps the last good state while disconnected. A stream ending as the one
// before it did, with no response in between, is logged at DEBUG, not WARN: a control
// plane that stays down is one WARN, not one per retry.
func (c *Client) Run(ctx context.Context) error {
	backoff := backoffInitial
	timer := time.NewTimer(0)
	defer timer.Stop()
	<-timer.C
	var warned string // the last error logged at WARN
	for {
		gotResponse, err := c.runStream(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if gotResponse {
			backoff = backoffInitial
			warned = ""
		}
		reason, delay := classify(err, gotResponse, backoff)
		if delay == backoff {
			backoff = min(backoff*2, backoffMax)
		}
		c.metrics.XDSConnectionTerminations.WithLabelValues(reason).Inc()
		if reason != reasonComplete && c.cfg.OnError != nil {
			c.cfg.OnError(err)
		}
		level := slog.LevelWarn
		if msg := fmt.Sprint(err); msg == warned {
			level = slog.LevelDebug
		} else {
			warned = msg
		}
		c.log.Log(ctx, level, "xds stream ended", "reason", reason, "error", err, "retry_in", delay)
		timer.Reset(delay)
		select {
		case <-ctx.Done():
			return nil
		case <-timer.C:
		}
	}
}

// classify maps a stream's end to a termination reason and a retry delay, as the Rust
// ztunnel's src/xds/client.rs does.
func classify(err error, gotResponse bool, backoff time.Duration) (string, time.Duration) {
	if err == nil || errors.Is(err, io.EOF) {
		return reasonComplete, 0
	}
	var ce *connectError
	if errors.As(err, &ce) {
		return reasonConnectionError, backoff
	}
	st, ok := status.FromError(err)
	if !ok {
		return reasonError, backoff
	}
	switch st.Code() {
	case codes.Unknown, codes.Canceled, codes.DeadlineExceeded:
		return reasonReconnect, quickReconnect
	case codes.Unavailable:
		if m := st.Message(); strings.Contains(m, "transport is closing") || strings.Contains(m, "received prior goaway") {
			return reasonReconnect, quickReconnect
		}
		if !gotResponse {
			return reasonConnectionError, backoff
		}
	}
	return reasonError, backoff
}

type connectError struct{ err error }

func (e *connectError) Error() string { return "xds: connect: " + e.err.Error() }
func (e *connectError) Unwrap() error { return e.err }

func (c *Client) dialOptions() []grpc.DialOption {
	dialer := &net.Dialer{
		Timeout: connectTimeout,
		KeepAliveConfig: net.KeepAliveConfig{
			Enable: true, Idle: tcpKeepaliveIdle, Interval: tcpKeepaliveIntvl, Count: tcpKeepaliveCount,
		},
	}
	return []grpc.DialOption{
		grpc.WithTransportCredentials(c.ep.Credentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return dialer.DialContext(ctx, "tcp", addr)
		}),
		grpc.WithKeepaliveParams(keepalive.ClientParameters{Time: keepaliveTime, Timeout: keepaliveTimeout, PermitWithoutStream: true}),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(maxRecvMsgSize)),
		grpc.WithConnectParams(grpc.ConnectParams{MinConnectTimeout: connectTimeout}),
	}
}

func (c *Client) node() *discoverypb.Node {
	n := &discoverypb.Node{Id: c.cfg.NodeID}
	if len(c.cfg.Metadata) > 0 {
		fields := make(map[string]*structpb.Value, len(c.cfg.Metadata))
		for k, v := range c.cfg.Metadata {
			fields[k] = structpb.NewStringValue(v)
		}
		n.Metadata = &structpb.Struct{Fields: fields}
	}
	return n
}

// initialRequests builds the first request of each type for a new stream.
func (c *Client) initialRequests() []*discoverypb.DeltaDiscoveryRequest {
	c.mu.Lock()
	defer c.mu.Unlock()
	var reqs []*discoverypb.DeltaDiscoveryRequest
	for _, typ := range []string{xdspb.AddressType, xdspb.AuthorizationType} {
		r := &discoverypb.DeltaDiscoveryRequest{Node: c.node(), TypeUrl: typ}
		if typ == xdspb.AddressType && c.cfg.OnDemand {
			// "Subscribe to nothing": the wildcard is explicitly removed, then each name we
			// demanded before is asked for again.
			r.ResourceNamesSubscribe = []string{"*"}
			r.ResourceNamesUnsubscribe = []string{"*"}
			for name := range c.demanded {
				r.ResourceNamesSubscribe = append(r.ResourceNamesSubscribe, name)
			}
		}
		if v := c.versions[typ]; v.len() > 0 {
			r.InitialResourceVersions = v.all()
		}
		reqs = append(reqs, r)
	}
	return reqs
}

func (c *Client) send(req *discoverypb.DeltaDiscoveryRequest) error {
	c.sendMu.Lock()
	defer c.sendMu.Unlock()
	if c.stream == nil {
		return errors.New("xds: not connected")
	}
	return c.stream.Send(req)
}

// runStream runs one connection and stream until it fails or ctx ends.
func (c *Client) runStream(ctx context.Context) (gotResponse bool, err error) {
	cc, err := grpc.NewClient(c.ep.Target(), c.dialOptions()...)
	if err != nil {
		return false, &connectError{err}
	}
	defer cc.Close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	sctx, err = c.ep.Outgoing(sctx)
	if err != nil {
		return false, &connectError{err}
	}
	stream, err := discoverypb.NewAggregatedDiscoveryServiceClient(cc).DeltaAggregatedResources(sctx, grpc.ForceCodecV2(newStreamCodec()))
	if err != nil {
		return false, &connectError{err}
	}
	c.sendMu.Lock()
	c.stream = stream
	c.sendMu.Unlock()
	defer func() {
		c.sendMu.Lock()
		c.stream = nil
		c.sendMu.Unlock()
	}()
	for _, req := range c.initialRequests() {
		if err := c.send(req); err != nil {
			if _, rerr := stream.Recv(); rerr != nil {
				err = rerr // the real reason
			}
			return false, err
		}
	}
	for {
		// Decoded and converted by streamCodec as gRPC hands the message over.
		resp := &response{collectNames: c.cfg.OnDemand, held: c.store}
		if err := stream.RecvMsg(resp); err != nil {
			return gotResponse, err
		}
		gotResponse = true
		ack := c.apply(resp)
		if err := c.send(ack); err != nil {
			return gotResponse, err
		}
		c.markSeen(resp.typeURL)
	}
}

func (c *Client) markSeen(typ string) {
	c.mu.Lock()
	c.seen[typ] = true
	done := c.seen[xdspb.AuthorizationType] && (c.cfg.OnDemand || c.seen[xdspb.AddressType])
	c.mu.Unlock()
	if done {
		c.syncedOnce.Do(func() { close(c.synced) })
	}
}

// decoded is the outcome of converting one push, built without any lock held.
type decoded struct {
	batch     state.Batch
	accepted  []nameVersion // in push order
	names     []string      // names and aliases seen, if collected (for on-demand waiters)
	errs      []string      // "name: reason"
	unchanged int           // resources skipped: the store holds them with the same bytes
	collect   bool
	versions  map[string]string // interned versions (packed, if packVersion packs them), up to maxInternedVersions
	in        *interner
	wire      workloadDecoder // one for the push: it reuses its message
	held      *state.Store    // see digest; nil converts every resource
}

// nameVersion is an accepted resource. The name is the converted value's own key string
// (a workload's UID, a service's or policy's key), so the client's version map keeps no
// copy of its own; a packed version is 32 bytes that stand for 64 hex digits (packVersion).
type nameVersion struct {
	name, version string
	packed        bool
}

func newDecoded(collectNames bool, held *state.Store) *decoded {
	return &decoded{collect: collectNames, versions: make(map[string]string), in: newInterner(), held: held}
}

// digestSeed keys the digests of resource bodies; they are compared only within a process.
var digestSeed = maphash.MakeSeed()

// digest is a resource body's hash, never 0 (0 is "unknown" on a state value).
func digest(body []byte) uint64 { return maphash.Bytes(digestSeed, body) | 1 }

// heldDigest is the digest of the value the store holds under name, 0 if none, and name
// as a workload holds it: the version map's key is replaced on every assignment, and a
// string of the push's own would be a second copy of every uid.
func heldDigest(s *state.Store, typ, name string) (uint64, string) {
	switch typ {
	case xdspb.AddressType:
		if w := s.WorkloadByUID(name); w != nil {
			return w.Digest, w.UID
		}
		if svc := s.ServiceByKey(name); svc != nil {
			return svc.Digest, strings.Clone(name)
		}
	case xdspb.AuthorizationType:
		if p := s.Policy(name); p != nil {
			return p.Digest, strings.Clone(name)
		}
	}
	return 0, name
}

// add converts one resource of a typ response into the batch, or lists why not. A resource
// whose body has the bytes of the one the store holds under its name (a control plane
// resending everything on a reconnect or a resync) is only accepted at its new version:
// converting and re-indexing a million unchanged workloads is what stalled the node.
// r's name and version may alias the message (parseResource): what is kept is a copy.
func (d *decoded) add(typ string, r *discoverypb.Resource) {
	name := r.GetName()
	if d.collect {
		d.names = append(d.names, strings.Clone(name))
		d.names = append(d.names, r.GetAliases()...)
	}
	var sum uint64
	if body := r.GetResource(); d.held != nil && body.GetTypeUrl() == typ {
		sum = digest(body.GetValue())
		if held, key := heldDigest(d.held, typ, name); held == sum {
			d.accept(key, r.GetVersion())
			d.unchanged++
			return
		}
	}
	key, err := d.decodeResource(typ, r, sum)
	if err != nil {
		d.errs = append(d.errs, name+": "+strings.TrimPrefix(err.Error(), "xds: "))
		return
	}
	d.accept(key, r.GetVersion())
}

// maxInternedVersions bounds the versions a push shares among its resources. A control plane
// that versions a push as a whole repeats a few; istiod and go-control-plane version each
// resource by a hash of its content, so every one differs, and interning a million of them
// was a million-entry map built for nothing (docs/PERFORMANCE.md, issue 59).
const maxInternedVersions = 64

// accept records name as accepted at version.
func (d *decoded) accept(name, version string) {
	if v, ok := d.versions[version]; ok {
		d.accepted = append(d.accepted, nameVersion{name, v, len(v) != len(version)}) // packed: shorter
		return
	}
	v, packed := packVersion(version)
	if !packed {
		v = strings.Clone(version)
	}
	if len(d.versions) < maxInternedVersions {
		key := v
		if packed {
			key = strings.Clone(version)
		}
		d.versions[key] = v
	}
	d.accepted = append(d.accepted, nameVersion{name, v, packed})
}

// removed records a response's removed names.
func (d *decoded) removed(typ string, names []string) {
	switch typ {
	case xdspb.AddressType:
		d.batch.RemoveAddresses = names
	case xdspb.AuthorizationType:
		d.batch.RemovePolicies = names
	}
	if d.collect {
		d.names = append(d.names, names...)
	}
}

// decodeResource converts r into the batch, the value carrying sum as its Digest, and
// returns its name as the converted value holds it.
func (d *decoded) decodeResource(typ string, r *discoverypb.Resource, sum uint64) (string, error) {
	b := &d.batch
	anyMsg := r.GetResource()
	if anyMsg == nil {
		return "", errors.New("missing resource body")
	}
	if anyMsg.GetTypeUrl() != typ {
		return "", fmt.Errorf("resource type %q in a %q response", anyMsg.GetTypeUrl(), typ)
	}
	switch typ {
	case xdspb.AddressType:
		w, s, err := d.convertAddress(anyMsg.GetValue())
		if err != nil {
			return "", err
		}
		if w != nil {
			if w.UID != r.GetName() {
				return "", fmt.Errorf("workload uid %q differs from resource name", w.UID)
			}
			w.Digest = sum
			b.Workloads = append(b.Workloads, w)
			return w.UID, nil
		}
		if s.Key() != r.GetName() {
			return "", fmt.Errorf("service key %q differs from resource name", s.Key())
		}
		s.Digest = sum
		b.Services = append(b.Services, s)
		return strings.Clone(r.GetName()), nil
	case xdspb.AuthorizationType:
		var a securitypb.Authorization
		if err := proto.Unmarshal(anyMsg.GetValue(), &a); err != nil {
			return "", fmt.Errorf("decode: %w", err)
		}
		p, err := ConvertAuthorization(&a)
		if err != nil {
			return "", err
		}
		if p.Key() != r.GetName() {
			return "", fmt.Errorf("policy key %q differs from resource name", p.Key())
		}
		p.Digest = sum
		b.Policies = append(b.Policies, p)
	}
	return strings.Clone(r.GetName()), nil
}

// convertAddress converts an istio.workload.Address: a workload from the wire directly
// (see wire.go), anything else through proto.Unmarshal.
func (d *decoded) convertAddress(body []byte) (*state.Workload, *state.Service, error) {
	p, ok, err := d.wire.workload(body)
	if err != nil {
		return nil, nil, fmt.Errorf("decode: %w", err)
	}
	if ok {
		w, err := workloadResource(p, d.in)
		return w, nil, err
	}
	var a workloadpb.Address
	if err := proto.Unmarshal(body, &a); err != nil {
		return nil, nil, fmt.Errorf("decode: %w", err)
	}
	return convertAddress(&a, d.in)
}

// handle applies one materialised response and returns its ACK or NACK (tests, benchmarks).
func (c *Client) handle(resp *discoverypb.DeltaDiscoveryResponse) *discoverypb.DeltaDiscoveryRequest {
	return c.apply(fromProto(resp, c.cfg.OnDemand, c.store))
}

// apply applies one decoded response and returns its ACK or NACK.
func (c *Client) apply(resp *response) *discoverypb.DeltaDiscoveryRequest {
	typ := resp.typeURL
	c.metrics.XDSMessages.WithLabelValues(typ).Inc()
	c.metrics.XDSMessageBytes.WithLabelValues(typ).Add(float64(resp.bytes))
	ack := &discoverypb.DeltaDiscoveryRequest{TypeUrl: typ, ResponseNonce: resp.nonce}
	if typ != xdspb.AddressType && typ != xdspb.AuthorizationType {
		c.log.Warn("xds: ignoring unknown type", "type_url", typ)
		return ack // unknown types are still ACKed
	}
	d := resp.d
	if d.unchanged > 0 {
		c.log.Debug("xds: resources resent unchanged", "type_url", typ, "count", d.unchanged)
	}
	c.store.Apply(&d.batch)
	if n := len(resp.removed); n >= releaseAfterRemoving {
		if w, sv, p := c.store.Len(); n > w+sv+p {
			// Most of the store just went (a mesh scaled down, or a namespace deleted):
			// the heap shrinks at the next GC, but the runtime returns the pages to the
			// OS only over minutes. A node's RSS is what its limit and the scheduler see.
			debug.FreeOSMemory()
		}
	}

	c.mu.Lock()
	// A rejected resource keeps the version we hold, if any: the store keeps that one, and
	// on reconnect the server then resends the new one or reports it removed. Not listing
	// it would keep it in the store for good if it went while we were disconnected.
	vers := c.versions[typ]
	vers.setAll(d.accepted)
	vers.remove(resp.removed)
	var wake []chan struct{}
	if typ == xdspb.AddressType {
		for _, n := range d.names {
			wake = append(wake, c.waiters[n]...)
			delete(c.waiters, n)
		}
		for key, ws := range c.waiters {
			if c.satisfied(key) {
				wake = append(wake, ws...)
				delete(c.waiters, key)
			}
		}
	}
	c.mu.Unlock()
	for _, ch := range wake {
		close(ch)
	}
	if len(d.errs) > 0 {
		msg := strings.Join(d.errs, "; ")
		c.log.Warn("xds: rejecting resources", "type_url", typ, "error", msg)
		ack.ErrorDetail = &statuspb.Status{Code: int32(codes.InvalidArgument), Message: msg}
	}
	return ack
}

// satisfied reports whether an on-demand key is now in the store.
func (c *Client) satisfied(key string) bool {
	if c.store.WorkloadByUID(key) != nil || c.store.ServiceByKey(key) != nil {
		return true
	}
	if i := strings.IndexByte(key, '/'); i >= 0 {
		if ip, err := netip.ParseAddr(key[i+1:]); err == nil {
			return c.store.WorkloadByIP(key[:i], ip) != nil || c.store.ServiceByVIP(key[:i], ip, "") != nil
		}
	}
	return false
}

// DemandAddress is Demand for the workload or service at ip on network (the resource
// name "network/IP").
func (c *Client) DemandAddress(ctx context.Context, network string, ip netip.Addr) error {
	return c.Demand(ctx, network+"/"+ip.String())
}

// Demand subscribes to one address resource on demand and waits until the server sends or
// removes it, or ctx ends. Keys are "network/IP", a workload uid or "namespace/hostname".
// Without OnDemand it returns at once: everything is already subscribed.
func (c *Client) Demand(ctx context.Context, key string) error {
	if !c.cfg.OnDemand {
		return nil
	}
	ch := make(chan struct{})
	c.mu.Lock()
	if c.satisfied(key) {
		c.mu.Unlock()
		return nil
	}
	c.waiters[key] = append(c.waiters[key], ch)
	c.demanded[key] = struct{}{}
	c.mu.Unlock()
	// When disconnected the next stream's initial request carries the name.
	if err := c.send(&discoverypb.DeltaDiscoveryRequest{TypeUrl: xdspb.AddressType, ResourceNamesSubscribe: []string{key}}); err != nil {
		c.log.Debug("xds: on-demand request deferred", "key", key, "error", err)
	}
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		c.mu.Lock()
		ws := c.waiters[key]
		for i, w := range ws {
			if w == ch {
				c.waiters[key] = append(ws[:i:i], ws[i+1:]...)
				break
			}
		}
		if len(c.waiters[key]) == 0 {
			delete(c.waiters, key)
		}
		c.mu.Unlock()
		return fmt.Errorf("xds: on-demand %q: %w", key, ctx.Err())
	}
}
