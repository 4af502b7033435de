package hbone

import (
	"container/list"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/ktls"
	"golang.org/x/net/http2"
)

// Request is one CONNECT request handed to the Handler. The handler answers it exactly
// once with Accept or Reject.
type Request struct {
	Authority             string      // validated host:port (IP or DNS name); bad ones got 400 before the handler
	Header                http.Header // request headers (baggage, forwarded, traceparent, ...)
	Peer                  identity.ID // from the verified TLS peer leaf (zero if none)
	LocalAddr, RemoteAddr net.Addr    // of the underlying connection

	s        *Stream
	ctx      context.Context
	answered atomic.Bool
	dialHeld atomic.Bool // it holds a place of its peer's PeerDials (fair.go)
}

// Accept sends 200 with h and returns the stream.
func (r *Request) Accept(h http.Header) (*Stream, error) {
	if r.answered.Swap(true) {
		return nil, errors.New("hbone: request already answered")
	}
	r.leaveDial()
	s := r.s
	c := s.c
	c.lockWrite()
	c.mu.Lock()
	cerr, gone := c.err, s.done
	s.pending = false
	c.mu.Unlock()
	if gone && cerr == nil { // reset before we answered: the connection is fine
		c.unlockWrite()
		return nil, fmt.Errorf("hbone: accept: %w", ErrPeerReset)
	}
	var err error
	if cerr != nil {
		err = cerr
	} else if !s.rstWritten {
		err = c.writeHeadersWLocked(s.id, false, http.StatusOK, "", h)
	}
	if ferr := c.unlockWrite(); err == nil {
		err = ferr
	}
	if err != nil {
		c.closeWith(err)
		return nil, fmt.Errorf("hbone: accept: %w", err)
	}
	return s, nil
}

// Reject answers with code and END_STREAM, then resets the request direction (NO_ERROR)
// so the client stops sending.
func (r *Request) Reject(code int) {
	if r.answered.Swap(true) {
		return
	}
	r.leaveDial()
	s := r.s
	c := s.c
	c.lockWrite()
	c.mu.Lock()
	gone := s.done // reset (by the peer, mostly): no frame may follow on a closed stream
	c.mu.Unlock()
	var err error
	if !s.rstWritten && !gone {
		err = c.writeHeadersWLocked(s.id, true, code, "", nil)
	}
	c.mu.Lock()
	s.sentEnd = true
	s.pending = false
	if !s.recvEnd && !s.done && err == nil {
		s.rstWritten = true
		err = c.fr.WriteRSTStream(s.id, http2.ErrCodeNo)
	}
	c.streamDoneLocked(s)
	s.localClosed = true
	c.releaseConnLocked(int64(s.rb.n)) // early data nobody will read
	s.rb.free()
	c.mu.Unlock()
	if ferr := c.unlockWrite(); err == nil {
		err = ferr
	}
	if err != nil {
		c.closeWith(err)
	}
}

// Handler is called in its own goroutine per CONNECT stream; it must call Accept or
// Reject (if it returns without either, the server answers 503).
type Handler func(r *Request)

// Server is the HBONE server side: it serves HTTP/2 on accepted (TLS) connections and
// yields each CONNECT stream to the handler.
type Server struct {
	cfg    Config
	h      Handler
	kernel kernelMemo
	fair   *fairness // per-source and per-identity budgets (fair.go); has its own lock

	mu       sync.Mutex
	raws     map[net.Conn]*conn // every connection inside ServeConn, from before its handshake; nil until it serves HTTP/2
	hands    list.List          // handshaking: conns in their handshake, oldest first (MaxHandshakes)
	lns      map[net.Listener]struct{}
	shutdown bool
	idle     chan struct{} // closed when the last conn leaves during Shutdown
}

// NewServer returns a server calling h for every valid CONNECT.
func NewServer(cfg Config, h Handler) *Server {
	s := &Server{cfg: cfg.withDefaults(), h: h, raws: make(map[net.Conn]*conn), lns: make(map[net.Listener]struct{})}
	s.fair = newFairness(&s.cfg)
	return s
}

// ServeTLS runs the TLS server handshake itself over raw (a TCP conn) so that outgoing
// TLS records are coalesced into fewer writes; otherwise it is ServeConn.
//
// raw is a *net.TCPConn, or a ktls.TCPWrapper around one, for kernel TLS (see doc.go).
func (s *Server) ServeTLS(ctx context.Context, raw net.Conn, cfg *tls.Config) error {
	return s.serve(ctx, raw, nil, startTLS(raw, cfg, true, &s.cfg, &s.kernel))
}

// ServeConn serves HTTP/2 on c until the connection ends. c is usually a *tls.Conn (the
// handshake runs here); a plain conn is served as h2c with a zero peer identity.
// A clean end (peer closed, Shutdown, Close) returns nil.
func (s *Server) ServeConn(ctx context.Context, c net.Conn) error {
	return s.serve(ctx, c, c, nil)
}

// serve serves raw: through nc (ServeConn), or through the TLS that ts starts (ServeTLS).
func (s *Server) serve(ctx context.Context, raw, nc net.Conn, ts *tlsStart) error {
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		raw.Close()
		return errClosed
	}
	s.mu.Unlock()
	s.fair.enterPending()
	var leftPending sync.Once
	defer leftPending.Do(s.fair.leftPending)
	// The source's budgets, before anything is read: a refused connection costs an
	// accept and a close, no key exchange.
	src := sourceOf(raw)
	relay := src.IsValid() && s.cfg.SourceRelays != nil && s.cfg.SourceRelays(src)
	release, wait, reason, ok := s.fair.admitSource(src, relay)
	if !ok {
		refuse(raw)
		s.notifyDrop(reason)
		return fmt.Errorf("hbone: %s refused before its handshake: %v", raw.RemoteAddr(), reason)
	}
	handshakeFailed := true
	defer func() { release(handshakeFailed) }()
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		raw.Close()
		return errClosed
	}
	s.raws[raw] = nil
	// hctx ends when the connection is evicted: a handshake waiting for the gate stops
	// waiting, rather than keep its goroutine until it gets a place only to fail.
	hctx, hstop := context.WithCancel(ctx)
	defer hstop()
	hand, evict := s.hands.PushBack(handshaking{raw, hstop}), s.oldestPastLimitLocked()
	s.mu.Unlock()
	if evict != nil {
		evict.raw.Close()
		evict.stop()
		s.notifyDrop(DropHandshakeEvicted)
	}
	defer s.handshakeOver(hand)
	defer func() {
		s.mu.Lock()
		delete(s.raws, raw)
		if s.idle != nil && len(s.raws) == 0 {
			select {
			case <-s.idle:
			default:
				close(s.idle) // Shutdown: the last connection has ended
			}
		}
		s.mu.Unlock()
	}()
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	defer stop()
	raw.SetDeadline(time.Now().Add(s.cfg.DialTimeout))
	if wait > 0 && !sleepCtx(hctx, wait) {
		raw.Close()
		return errClosed
	}
	handshake := func(ctx context.Context) error { return nil }
	var tc *tls.Conn
	if ts != nil {
		tc, handshake = ts.tc, ts.handshake
		if s.fair.gate != nil {
			// Only so many handshakes compute at once (fair.go); the connection reads
			// through the gate until its handshake is over, then straight through it.
			g := &gatedConn{Conn: raw, f: s.fair, ctx: hctx}
			ts.bc.Conn = g
			handshake = func(ctx context.Context) error {
				err := ts.handshake(ctx)
				g.done()
				return err
			}
		}
	} else if c, ok := nc.(*tls.Conn); ok {
		tc, handshake = c, c.HandshakeContext
	}
	if tc != nil {
		if err := handshake(ctx); err != nil {
			raw.Close()
			return fmt.Errorf("hbone: tls handshake with %s: %w", raw.RemoteAddr(), &HandshakeError{err})
		}
		if p := tc.ConnectionState().NegotiatedProtocol; p != http2.NextProtoTLS {
			raw.Close()
			return fmt.Errorf("hbone: %s negotiated ALPN %q, want h2", raw.RemoteAddr(), p)
		}
	}
	var bc *bufConn
	var kc *ktls.Conn
	if ts != nil {
		var err error
		if nc, bc, kc, err = ts.finish(&s.cfg, &s.kernel); err != nil {
			raw.Close()
			return fmt.Errorf("hbone: kernel TLS for %s: %w", raw.RemoteAddr(), err)
		}
	}
	var preface [len(http2.ClientPreface)]byte
	if _, err := io.ReadFull(nc, preface[:]); err != nil || string(preface[:]) != http2.ClientPreface {
		raw.Close()
		if err == nil {
			err = errors.New("bad client preface")
		}
		return fmt.Errorf("hbone: preface from %s: %w", raw.RemoteAddr(), err)
	}
	raw.SetDeadline(time.Time{})
	s.handshakeOver(hand)
	leftPending.Do(s.fair.leftPending)
	handshakeFailed = false
	release(false)
	c := newConn(s.cfg, true, nc, bc, kc)
	c.handler = s.h
	c.onCalm = func() { s.fair.calmed(src, c.fair) }
	if !c.peer.IsZero() { // h2c or no client certificate: no identity to count by
		ps, wait, ok := s.fair.admitPeer(c.peer, relay)
		if !ok {
			raw.Close()
			s.notifyDrop(DropPeerConnRate)
			return fmt.Errorf("hbone: %s (%v) refused: %v", raw.RemoteAddr(), c.peer, DropPeerConnRate)
		}
		c.fair = ps
		defer func() {
			c.mu.Lock()
			n := c.fairStreams
			c.fairStreams, c.fairDone = 0, true
			c.mu.Unlock()
			s.fair.leavePeer(ps, n)
		}()
		if wait > 0 && !sleepCtx(ctx, wait) {
			raw.Close()
			return errClosed
		}
	}
	c.ctx, c.cancelCtx = context.WithCancelCause(ctx)
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		raw.Close()
		return errClosed
	}
	s.raws[raw] = c
	s.mu.Unlock()
	cstop := context.AfterFunc(ctx, func() { c.closeWith(ctx.Err()) })
	defer cstop()
	if err := c.writePreface(); err != nil {
		c.closeWith(err)
		return fmt.Errorf("hbone: settings to %s: %w", raw.RemoteAddr(), err)
	}
	c.wg.Add(1)
	go c.writeLoop()
	c.fail(c.readLoop())
	c.wg.Wait()
	c.reportKernelEnd()
	c.mu.Lock()
	cause := c.cause
	if c.calmErr != nil && cause == nil { // drained after the calm GOAWAY
		cause = c.calmErr
	}
	c.mu.Unlock()
	var ce connError
	if errors.As(cause, &ce) || errors.Is(cause, errPingTimeout) {
		return fmt.Errorf("hbone: serve %s: %w", raw.RemoteAddr(), cause)
	}
	return nil // the peer or we closed the connection
}

// sleepCtx waits for d or ctx's end, and reports whether d passed.
func sleepCtx(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}

// oldestPastLimitLocked takes the oldest connection in its handshake off the list when
// more than MaxHandshakes are, for the caller to close. A stalled handshake (slowloris,
// or a connection that never starts TLS) is the oldest, while an honest one ends in
// milliseconds, so honest clients still get through a flood of them.
func (s *Server) oldestPastLimitLocked() *handshaking {
	if s.hands.Len() <= s.cfg.MaxHandshakes {
		return nil
	}
	h := s.hands.Remove(s.hands.Front()).(handshaking)
	return &h
}

// handshaking is a connection in its handshake: its raw conn and what ends the wait of
// its handshake for the gate.
type handshaking struct {
	raw  net.Conn
	stop context.CancelFunc
}

// handshakeOver takes a connection off the handshake list; once is enough.
func (s *Server) handshakeOver(e *list.Element) {
	s.mu.Lock()
	s.hands.Remove(e) // a no-op once removed
	s.mu.Unlock()
}

func (s *Server) notifyDrop(r DropReason) {
	if s.cfg.OnDrop != nil {
		s.cfg.OnDrop(r)
	}
}

// Serve accepts connections from ln (which yields TLS conns) and serves each in its own
// goroutine. It returns when ln fails or ctx ends, after its connections have ended.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		return errClosed
	}
	s.lns[ln] = struct{}{}
	s.mu.Unlock()
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		s.WaitAccept(ctx)
		nc, err := ln.Accept()
		if err != nil {
			s.mu.Lock()
			delete(s.lns, ln)
			shut := s.shutdown
			s.mu.Unlock()
			if shut || ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("hbone: accept: %w", err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			s.ServeConn(ctx, nc)
		}()
	}
}

// WaitAccept returns when the server can take another connection, or when ctx ends. An
// accept loop calls it before each Accept: past 2 × MaxHandshakes connections that are
// not serving HTTP/2 yet (in their handshake, or evicted and on their way out), and until
// the connection let in before has started, the connections wait in the kernel's backlog
// (costing nothing, their handshake deadline not yet running) instead of in goroutines.
// It does not wait for handshakes queued for the CPU (the gate): past MaxHandshakes the
// oldest are evicted unserved, so the newest, an honest client's, still gets in.
func (s *Server) WaitAccept(ctx context.Context) { s.fair.waitRoom(ctx) }

// Shutdown stops accepting, sends GOAWAY on every connection, lets open streams finish
// until ctx ends, then closes everything.
func (s *Server) Shutdown(ctx context.Context) error {
	s.mu.Lock()
	s.shutdown = true
	if s.idle == nil {
		s.idle = make(chan struct{})
	}
	idle := s.idle
	for ln := range s.lns {
		ln.Close()
	}
	conns := s.connsLocked(true)
	empty := len(s.raws) == 0
	s.mu.Unlock()
	for _, c := range conns {
		c.startDrain()
	}
	if empty {
		return nil
	}
	select {
	case <-idle:
		return nil
	case <-ctx.Done():
		s.Close()
		return ctx.Err()
	}
}

// CloseMatching closes every connection serving HTTP/2 whose TLS handshake match returns an
// error for (a peer certificate revoked since, say), with that error as the cause its
// streams and handlers see, and returns how many it closed. match must not block.
func (s *Server) CloseMatching(match func(tls.ConnectionState) error) int {
	s.mu.Lock()
	conns := s.connsLocked(false)
	s.mu.Unlock()
	return closeMatching(conns, match)
}

// Close closes every connection and listener now. Idempotent.
func (s *Server) Close() error {
	s.mu.Lock()
	s.shutdown = true
	for ln := range s.lns {
		ln.Close()
	}
	conns := s.connsLocked(false)
	for raw := range s.raws {
		raw.Close()
	}
	s.mu.Unlock()
	for _, c := range conns {
		c.closeWith(errClosed)
	}
	return nil
}

// connsLocked returns the connections serving HTTP/2; with closeOthers it closes those
// still in their handshake (s.mu held).
func (s *Server) connsLocked(closeOthers bool) []*conn {
	conns := make([]*conn, 0, len(s.raws))
	for raw, c := range s.raws {
		if c != nil {
			conns = append(conns, c)
		} else if closeOthers {
			raw.Close()
		}
	}
	return conns
}
