// Command xdscontrol is a delta ADS server built as a user of go-control-plane builds one: a
// cache.LinearCache per type (Istio's istio.workload.Address and istio.security.Authorization),
// muxed by type URL and served by go-control-plane's server over plain gRPC. It is the control
// plane nobody here wrote that internal/scaletest runs beside its own (issue 59). It is a
// module and a process of its own: go-control-plane's Envoy protos and gozt's xds/xdspb both
// register envoy.service.discovery.v3's names, and go-control-plane stays out of gozt's go.mod.
//
// It listens on -addr, prints "ready ADDR" and takes commands on standard input, one line each,
// some followed by records (a uvarint length and that many bytes each):
//
//	update TYPE N M      N records of (name, body) to set, M records of a name to delete, as
//	                     one UpdateResources call; replies "pushed TYPE NONCE START ACK NACK"
//	                     once the client has answered the response the update caused, or
//	                     "pushed TYPE - 0 0 -" when the cache sent none (nothing changed);
//	                     before any client, "pushed TYPE - 0 0 -" at once
//	drop                 closes every client connection (a control plane restart)
//
// and reports, unasked: "answered TYPE NONCE RESOURCES BYTES START" for a response to a
// subscription (the first request of a type on a stream), "acked NONCE AT NACK" for each
// response the client answered, "stream VERSIONS" when a stream subscribes to addresses,
// listing that many initial resource versions. Times are Unix nanoseconds; START is when the
// response's first byte went to gRPC, after it was marshalled; NACK is "-" or the error's
// message, quoted. A NONCE is "S.N": the server's nonce N on its S-th stream (nonces restart
// with each stream). It exits when standard input closes.
package main

import (
	"bufio"
	"context"
	"encoding/binary"
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	discoverygrpc "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/envoyproxy/go-control-plane/pkg/cache/v3"
	"github.com/envoyproxy/go-control-plane/pkg/server/v3"
	"google.golang.org/grpc"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/protobuf/proto"

	"github.com/gozt/gozt/xds/xdspb/securitypb"
	"github.com/gozt/gozt/xds/xdspb/workloadpb"
)

const (
	addressType       = "type.googleapis.com/istio.workload.Address"
	authorizationType = "type.googleapis.com/istio.security.Authorization"
)

// ackWait bounds how long an update waits for its response to be sent and answered (a 1M
// push on a loaded 2-core machine took over two minutes).
const ackWait = 10 * time.Minute

func main() {
	addr := flag.String("addr", "127.0.0.1:0", "address to serve delta ADS on")
	flag.Parse()
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatalf("xdscontrol: %v", err)
	}
	c := newControl()
	// A reconnecting client lists every version it holds: at 1M workloads about 110 MB,
	// past gRPC's 4 MiB default.
	srv := grpc.NewServer(grpc.MaxRecvMsgSize(1<<30), grpc.StreamInterceptor(c.intercept),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: time.Second, PermitWithoutStream: true}))
	discoverygrpc.RegisterAggregatedDiscoveryServiceServer(srv, server.NewServer(context.Background(), c.mux(), server.CallbackFuncs{}))
	go func() { _ = srv.Serve(&trackingListener{Listener: ln, c: c}) }()
	c.printf("ready %s", ln.Addr())
	if err := c.commands(bufio.NewReaderSize(os.Stdin, 1<<20)); err != nil && err != io.EOF {
		log.Fatalf("xdscontrol: %v", err)
	}
	srv.Stop()
}

// control owns the caches and what the test is told.
type control struct {
	caches map[string]*cache.LinearCache

	outMu sync.Mutex // serialises lines on stdout
	out   *bufio.Writer

	streams atomic.Int64 // streams opened so far

	mu    sync.Mutex
	conns map[net.Conn]struct{}
	sent  map[string]chan sent     // type URL -> responses sent, while an update waits
	acks  map[string]chan ackEvent // "S.N" nonce -> where its answer goes, until it comes
}

type sent struct {
	nonce string
	start time.Time
	ack   <-chan ackEvent
}

type ackEvent struct {
	at   time.Time
	nack string
}

func newControl() *control {
	return &control{
		caches: map[string]*cache.LinearCache{addressType: cache.NewLinearCache(addressType), authorizationType: cache.NewLinearCache(authorizationType)},
		out:    bufio.NewWriter(os.Stdout),
		conns:  map[net.Conn]struct{}{}, sent: map[string]chan sent{}, acks: map[string]chan ackEvent{},
	}
}

func (c *control) mux() cache.Cache {
	caches := map[string]cache.Cache{}
	for typ, lc := range c.caches {
		caches[typ] = lc
	}
	return &cache.MuxCache{
		Classify:      func(r *cache.Request) string { return r.GetTypeUrl() },
		ClassifyDelta: func(r *cache.DeltaRequest) string { return r.GetTypeUrl() },
		Caches:        caches,
	}
}

func (c *control) printf(format string, args ...any) {
	c.outMu.Lock()
	defer c.outMu.Unlock()
	fmt.Fprintf(c.out, format+"\n", args...)
	if err := c.out.Flush(); err != nil {
		log.Fatalf("xdscontrol: stdout: %v", err)
	}
}

// commands runs the commands on r until it ends.
func (c *control) commands(r *bufio.Reader) error {
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			return err
		}
		f := strings.Fields(line)
		switch {
		case len(f) == 1 && f[0] == "drop":
			c.dropAll()
		case len(f) == 4 && f[0] == "update":
			if err := c.update(r, f[1], f[2], f[3]); err != nil {
				return err
			}
		default:
			return fmt.Errorf("bad command %q", strings.TrimSpace(line))
		}
	}
}

func (c *control) update(r *bufio.Reader, typ, nUpd, nRem string) error {
	lc := c.caches[typ]
	n, err1 := strconv.Atoi(nUpd)
	m, err2 := strconv.Atoi(nRem)
	if lc == nil || err1 != nil || err2 != nil {
		return fmt.Errorf("bad update %s %s %s", typ, nUpd, nRem)
	}
	upd := make(map[string]types.Resource, n)
	for range n {
		name, err := record(r)
		if err != nil {
			return err
		}
		body, err := record(r)
		if err != nil {
			return err
		}
		var msg proto.Message = &workloadpb.Address{}
		if typ == authorizationType {
			msg = &securitypb.Authorization{}
		}
		if err := proto.Unmarshal(body, msg); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		upd[string(name)] = msg
	}
	rem := make([]string, 0, m)
	for range m {
		name, err := record(r)
		if err != nil {
			return err
		}
		rem = append(rem, string(name))
	}
	// With a client subscribed, its wildcard watch is open once it has answered the last
	// response; an update that changes something sends a response and closes the watch.
	watched := c.waitWatch(lc)
	ch := make(chan sent, 1)
	if watched {
		c.mu.Lock()
		c.sent[typ] = ch
		c.mu.Unlock()
		defer func() {
			c.mu.Lock()
			delete(c.sent, typ)
			c.mu.Unlock()
		}()
	}
	if err := lc.UpdateResources(upd, rem); err != nil {
		return err
	}
	if !watched || lc.NumWildcardWatches() > 0 {
		c.printf("pushed %s - 0 0 -", typ)
		return nil
	}
	var s sent
	select {
	case s = <-ch:
	case <-time.After(ackWait):
		return fmt.Errorf("update of %s: nothing sent within %v", typ, ackWait)
	}
	var a ackEvent
	select {
	case a = <-s.ack:
	case <-time.After(ackWait):
		return fmt.Errorf("response %s not answered within %v", s.nonce, ackWait)
	}
	c.printf("pushed %s %s %d %d %s", typ, s.nonce, s.start.UnixNano(), a.at.UnixNano(), a.nack)
	return nil
}

// waitWatch waits, bounded, until lc has a wildcard watch, and reports whether it has: a
// client that just answered a response has its next watch opened by the server's stream
// goroutine a moment later. Without a client it returns false at once.
func (c *control) waitWatch(lc *cache.LinearCache) bool {
	c.mu.Lock()
	clients := len(c.conns)
	c.mu.Unlock()
	if clients == 0 {
		return false
	}
	for deadline := time.Now().Add(ackWait); time.Now().Before(deadline); time.Sleep(time.Millisecond) {
		if lc.NumWildcardWatches() > 0 {
			return true
		}
	}
	return false
}

// record reads one uvarint-length-prefixed record.
func record(r *bufio.Reader) ([]byte, error) {
	n, err := binary.ReadUvarint(r)
	if err != nil {
		return nil, err
	}
	b := make([]byte, n)
	_, err = io.ReadFull(r, b)
	return b, err
}

func (c *control) dropAll() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for conn := range c.conns {
		conn.Close()
		delete(c.conns, conn)
	}
}

// trackingListener records the connections it accepts, for drop.
type trackingListener struct {
	net.Listener
	c *control
}

func (l *trackingListener) Accept() (net.Conn, error) {
	conn, err := l.Listener.Accept()
	if err == nil {
		l.c.mu.Lock()
		l.c.conns[conn] = struct{}{}
		l.c.mu.Unlock()
	}
	return conn, err
}

// intercept watches the ADS stream's messages: it marshals each response before noting when
// it went out (so START is the first byte, not the start of a marshal), and notes each answer.
func (c *control) intercept(srv any, ss grpc.ServerStream, _ *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
	return handler(srv, &watchedStream{ServerStream: ss, c: c, id: c.streams.Add(1), subscribed: map[string]bool{}, answered: map[string]bool{}})
}

type watchedStream struct {
	grpc.ServerStream
	c          *control
	id         int64
	subscribed map[string]bool // type URLs subscribed on this stream (the receiving goroutine's)
	answered   map[string]bool // type URLs whose first response went out (the sending goroutine's)
}

func (s *watchedStream) SendMsg(m any) error {
	resp, ok := m.(*discoverygrpc.DeltaDiscoveryResponse)
	if !ok {
		return s.ServerStream.SendMsg(m)
	}
	size := proto.Size(resp)
	var pm grpc.PreparedMsg
	if err := pm.Encode(s.ServerStream, resp); err != nil {
		return err
	}
	typ, nonce := resp.GetTypeUrl(), s.nonce(resp.GetNonce())
	ack := make(chan ackEvent, 1)
	s.c.mu.Lock()
	s.c.acks[nonce] = ack
	ch := s.c.sent[typ]
	s.c.mu.Unlock()
	start := time.Now()
	if !s.answered[typ] {
		s.answered[typ] = true
		s.c.printf("answered %s %s %d %d %d", typ, nonce, len(resp.GetResources()), size, start.UnixNano())
	}
	if ch != nil {
		select {
		case ch <- sent{nonce, start, ack}:
		default:
		}
	}
	return s.ServerStream.SendMsg(&pm)
}

func (s *watchedStream) RecvMsg(m any) error {
	if err := s.ServerStream.RecvMsg(m); err != nil {
		return err
	}
	req, ok := m.(*discoverygrpc.DeltaDiscoveryRequest)
	if !ok {
		return nil
	}
	if n := req.GetResponseNonce(); n != "" {
		n = s.nonce(n)
		a := ackEvent{at: time.Now(), nack: "-"}
		if d := req.GetErrorDetail(); d != nil {
			a.nack = strconv.Quote(d.GetMessage())
		}
		s.c.printf("acked %s %d %s", n, a.at.UnixNano(), a.nack)
		s.c.mu.Lock()
		ch := s.c.acks[n]
		delete(s.c.acks, n)
		s.c.mu.Unlock()
		if ch != nil {
			ch <- a
		}
		return nil
	}
	if typ := req.GetTypeUrl(); !s.subscribed[typ] {
		s.subscribed[typ] = true
		if typ == addressType {
			s.c.printf("stream %d", len(req.GetInitialResourceVersions()))
		}
	}
	return nil
}

// nonce is the server's nonce n as reported: "S.N".
func (s *watchedStream) nonce(n string) string { return strconv.FormatInt(s.id, 10) + "." + n }
