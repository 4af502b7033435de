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
	"net/netip"
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
	dialHeld atomic.Bool // it holds a place of its peer's PeerDials (admission.go)
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
	cfg    ServerConfig
	h      Handler
	kernel kernelMemo
	adm    *admission // per-source and per-identity budgets (admission.go); has its own lock

	mu       sync.Mutex
	raws     map[net.Conn]*conn // every connection inside ServeConn, from before its handshake; nil until it serves HTTP/2
	hands    list.List          // handshaking: conns in their handshake, oldest first (MaxHandshakes)
	lns      map[net.Listener]struct{}
	shutdown bool
	idle     chan struct{} // closed when the last conn leaves during Shutdown
}

// NewServer returns a server calling h for every valid CONNECT.
func NewServer(cfg ServerConfig, h Handler) *Server {
	s := &Server{cfg: cfg.withDefaults(), h: h, raws: make(map[net.Conn]*conn), lns: make(map[net.Listener]struct{})}
	s.adm = newAdmission(&s.cfg)
	return s
}

// ServeTLS runs the TLS server handshake itself over raw (a TCP conn) so that outgoing
// TLS records are coalesced into fewer writes; otherwise it is ServeConn.
//
// raw is a *net.TCPConn, or a connection over one whose Read and Write go straight to
// it and that returns it from a TCP() *net.TCPConn method, for kernel TLS (ktls.go).
func (s *Server) ServeTLS(ctx context.Context, raw net.Conn, cfg *tls.Config) error {
	return s.serve(ctx, raw, nil, startTLS(raw, cfg, true, &s.cfg.Config, &s.kernel))
}

// ServeConn serves HTTP/2 on c until the connection ends. c is usually a *tls.Conn (the
// handshake runs here); a plain conn is served as h2c with a zero peer identity.
// A clean end (peer closed, Shutdown, Close) returns nil.
func (s *Server) ServeConn(ctx context.Context, c net.Conn) error {
	return s.serve(ctx, c, c, nil)
}

// serve serves raw: through nc (ServeConn), or through the TLS that ts starts (ServeTLS),
// in three phases: admit (the server's and the source's budgets, before anything is
// read), handshake (TLS, kernel TLS, the client preface), run (HTTP/2 until the end).
func (s *Server) serve(ctx context.Context, raw, nc net.Conn, ts *tlsStart) error {
	a, err := s.admit(ctx, raw)
	if err != nil {
		return err
	}
	defer a.leave()
	nc, bc, kc, err := s.handshake(ctx, a, nc, ts)
	if err != nil {
		raw.Close()
		return err
	}
	a.handshook()
	return s.run(ctx, a, nc, bc, kc)
}

// admitted is a connection inside serve: what admit began, which leave ends.
type admitted struct {
	s     *Server
	raw   net.Conn
	src   netip.Addr // its source IP (invalid if not IP)
	relay bool       // src relays other clients' connections (AdmissionConfig.SourceRelays)
	wait  time.Duration
	// hctx ends when the connection is evicted past MaxHandshakes: a handshake waiting for
	// the gate stops waiting, rather than keep its goroutine until it gets a place only to
	// fail.
	hctx    context.Context
	hand    *list.Element     // its place in Server.hands while in its handshake
	release func(failed bool) // gives its source's handshake place back
	pending bool              // counted in the accept side's pending (admit.go)
	failed  bool              // its handshake has not succeeded (yet)
	undo    []func()          // what leave runs, last first
}

// admit counts raw in the accept side's pending, spends its source's budgets (a refused
// connection costs an accept and a close, no key exchange) and enters it in the server's
// connections and its handshake list, evicting the oldest handshake past MaxHandshakes.
// On error raw is closed and nothing is left to undo.
func (s *Server) admit(ctx context.Context, raw net.Conn) (*admitted, error) {
	if s.isShutdown() {
		raw.Close()
		return nil, errClosed
	}
	a := &admitted{s: s, raw: raw, src: sourceOf(raw), failed: true}
	s.adm.room.enter()
	a.pending = true
	a.onLeave(a.leavePending)
	a.relay = s.isRelay(a.src)
	release, wait, reason, ok := s.adm.admitSource(a.src, a.relay)
	if !ok {
		refuse(raw)
		s.notifyDrop(reason)
		a.leave()
		return nil, fmt.Errorf("hbone: %s refused before its handshake: %v", raw.RemoteAddr(), reason)
	}
	a.release, a.wait = release, wait
	a.onLeave(func() { release(a.failed) })
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		raw.Close()
		a.leave()
		return nil, errClosed
	}
	s.raws[raw] = nil
	hctx, hstop := context.WithCancel(ctx)
	a.hctx = hctx
	a.onLeave(hstop)
	a.hand = s.hands.PushBack(handshaking{raw, hstop})
	evict := s.oldestPastLimitLocked()
	s.mu.Unlock()
	a.onLeave(func() { s.handshakeOver(a.hand) }) // a no-op once handshook
	a.onLeave(func() { s.forget(raw) })
	if evict != nil {
		evict.raw.Close()
		evict.stop()
		s.notifyDrop(DropHandshakeEvicted)
	}
	stop := context.AfterFunc(ctx, func() { raw.Close() })
	a.onLeave(func() { stop() })
	return a, nil
}

// isRelay reports whether src relays other clients' connections
// (AdmissionConfig.SourceRelays).
func (s *Server) isRelay(src netip.Addr) bool {
	return src.IsValid() && s.cfg.Admission.SourceRelays != nil && s.cfg.Admission.SourceRelays(src)
}

// refusedAtAccept reports whether a connection from src is to be refused as soon as it is
// accepted, its source being past a budget admit would refuse it for, and counts the
// refusal (admission.refusal).
func (s *Server) refusedAtAccept(src netip.Addr) bool {
	reason, no := s.adm.refusal(src, s.isRelay(src))
	if no {
		s.notifyDrop(reason)
	}
	return no
}

// onLeave adds f to what leave runs.
func (a *admitted) onLeave(f func()) { a.undo = append(a.undo, f) }

// leave ends what admit began, in the reverse order.
func (a *admitted) leave() {
	for i := len(a.undo) - 1; i >= 0; i-- {
		a.undo[i]()
	}
	a.undo = nil
}

// leavePending takes the connection off the accept side's pending, once.
func (a *admitted) leavePending() {
	if a.pending {
		a.pending = false
		a.s.adm.room.left()
	}
}

// handshook ends the handshake phase well: the connection leaves the handshake list and
// the accept side's pending, and its source's handshake place is given back as a success.
func (a *admitted) handshook() {
	a.s.handshakeOver(a.hand)
	a.leavePending()
	a.failed = false
	a.release(false)
}

// handshake runs the TLS handshake (through the handshake gate, admission.go) and the move to
// kernel TLS for ServeTLS, or the handshake of a *tls.Conn for ServeConn, and reads the
// client preface, all within DialTimeout. It returns what serves HTTP/2: nc, with its
// coalescing buffer (bc) or kernel TLS conn (kc) for ServeTLS.
func (s *Server) handshake(ctx context.Context, a *admitted, nc net.Conn, ts *tlsStart) (_ net.Conn, bc *bufConn, kc *ktls.Conn, err error) {
	raw := a.raw
	raw.SetDeadline(time.Now().Add(s.cfg.DialTimeout))
	if a.wait > 0 && !sleepCtx(a.hctx, a.wait) {
		return nil, nil, nil, errClosed
	}
	handshake := func(ctx context.Context) error { return nil }
	var tc *tls.Conn
	if ts != nil {
		tc, handshake = ts.tc, ts.handshake
		if s.adm.gate != nil {
			// Only so many handshakes compute at once (admission.go); the connection reads
			// through the gate until its handshake is over, then straight through it.
			g := &gatedConn{Conn: raw, f: s.adm, ctx: a.hctx}
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
			return nil, nil, nil, fmt.Errorf("hbone: tls handshake with %s: %w", raw.RemoteAddr(), &HandshakeError{err})
		}
		if h2, _ := negotiatedH2(tc); !h2 {
			return nil, nil, nil, fmt.Errorf("hbone: %s negotiated ALPN %q, want h2", raw.RemoteAddr(), tc.ConnectionState().NegotiatedProtocol)
		}
	}
	if ts != nil {
		if nc, bc, kc, err = ts.finish(&s.cfg.Config, &s.kernel); err != nil {
			return nil, nil, nil, fmt.Errorf("hbone: kernel TLS for %s: %w", raw.RemoteAddr(), err)
		}
	}
	var preface [len(http2.ClientPreface)]byte
	if _, err := io.ReadFull(nc, preface[:]); err != nil || string(preface[:]) != http2.ClientPreface {
		if err == nil {
			err = errors.New("bad client preface")
		}
		return nil, nil, nil, fmt.Errorf("hbone: preface from %s: %w", raw.RemoteAddr(), err)
	}
	raw.SetDeadline(time.Time{})
	return nc, bc, kc, nil
}

// run serves HTTP/2 on a handshaken connection until it ends: the peer identity's budgets
// first (PeerConnRate, and the identity's streams for the others), then the frame reader
// on this goroutine and the writer on its own.
func (s *Server) run(ctx context.Context, a *admitted, nc net.Conn, bc *bufConn, kc *ktls.Conn) error {
	raw := a.raw
	c := newConn(s.cfg.conn(), true, nc, bc, kc)
	c.handler = s.h
	c.onCalm = func() { s.adm.calmed(a.src, c.peerBudget) }
	if !c.peer.IsZero() { // h2c or no client certificate: no identity to count by
		ps, wait, ok := s.adm.admitPeer(c.peer, a.relay)
		if !ok {
			raw.Close()
			s.notifyDrop(DropPeerConnRate)
			return fmt.Errorf("hbone: %s (%v) refused: %v", raw.RemoteAddr(), c.peer, DropPeerConnRate)
		}
		c.peerBudget = ps
		defer func() {
			c.mu.Lock()
			n := c.budgetStreams
			c.budgetStreams, c.budgetDone = 0, true
			c.mu.Unlock()
			s.adm.leavePeer(ps, n)
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

// isShutdown reports whether Shutdown or Close has run.
func (s *Server) isShutdown() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.shutdown
}

// forget takes raw off the server's connections; during Shutdown the last one to go tells
// it the server is idle.
func (s *Server) forget(raw net.Conn) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.raws, raw)
	if s.idle != nil && len(s.raws) == 0 {
		select {
		case <-s.idle:
		default:
			close(s.idle)
		}
	}
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
// goroutine, accepting only while the server has room (Admit). It returns when ln fails or
// ctx ends, after its connections have ended.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	s.mu.Lock()
	if s.shutdown {
		s.mu.Unlock()
		return errClosed
	}
	al := s.Admit(ln)
	s.lns[al] = struct{}{} // Shutdown closes it, which also ends a wait for room
	s.mu.Unlock()
	stop := context.AfterFunc(ctx, func() { al.Close() })
	defer stop()
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		nc, err := al.Accept()
		if err != nil {
			s.mu.Lock()
			delete(s.lns, al)
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

// Shutdown stops accepting, sends GOAWAY on every connection, lets open streams finish
// until ctx ends, then closes everything.
func (s *Server) Shutdown(ctx context.Context) error {
	s.adm.hold.close()
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
	s.adm.hold.close()
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
