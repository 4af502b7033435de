package proxy

// The copy: every proxied connection is a TCP socket paired with an HBONE stream or with
// another TCP socket, and one engine, parkCopy, copies each pair both ways. Its rules for
// how a direction ends (half-close, a reset carried as a reset, a failure as an abort) and
// what the access log counts are here; idle.go has how a quiet direction gives up its
// goroutine (parking), which it does only where the proxy's poller parks (epoll).

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/gozt/gozt/hbone"
	"github.com/gozt/gozt/metrics"
	"golang.org/x/net/http2"
)

// halfCloser is a connection whose write side can be shut on its own: *net.TCPConn (FIN)
// and *hbone.Stream (END_STREAM).
type halfCloser interface {
	net.Conn
	CloseWrite() error
}

// handOff registers tc for the drain deadline, then copies between client and server on a
// new tracked goroutine and returns at once. When the copy ends, tc.finish records it (the
// bytes copied client→server, received, and server→client, sent, and the copy's failure,
// if any) in tc.rec, which the caller has opened, closes both ends and removes the record.
// client and server are each a *net.TCPConn or an *hbone.Stream, not both streams.
//
// Why a new goroutine: a proxied connection's goroutine lives as long as the connection,
// mostly waiting, and a goroutine's stack never shrinks below what its deepest call needed
// until a GC. The setup (routing, policy, TLS, HPACK, metrics) grows the accepting
// goroutine's stack; with the copy's own TLS writes on top it needs 8 KiB. Started fresh,
// the copy fits in 4 KiB (29.5 -> 21.6 KiB per idle proxied connection, both nodes).
//
// The tracker's count for the copy is held from here until the copy completes, whether
// goroutines run it or it is parked, so drain waits for parked connections too.
func (p *Proxy) handOff(tc *liveConn, client, server halfCloser) {
	tc.client, tc.server = client, server
	if !tc.copy.init(p, tc, client, server) {
		client.Close()
		server.Close()
		p.record(tc, 0, 0, fmt.Errorf("proxy: cannot copy %T to %T", client, server))
		return
	}
	// From here a close (drain deadline, policy) closes both ends and unparks the copy.
	p.conns.add(tc)
	p.conns.wg.Add(1)
	go tc.copy.start()
}

// record closes the connection's record: inbound, a connection a policy change closed is
// recorded as denied; outbound, a failure is logged at DEBUG too.
func (p *Proxy) record(tc *liveConn, received, sent int64, err error) {
	flag := ""
	if tc.denied.Load() {
		flag, err = metrics.FlagDeny, errors.New("connection closed due to policy change")
	}
	tc.rec.Close(sent, received, flag, err)
	if err != nil && !tc.inbound {
		p.log.Debug("proxy: outbound", "src", tc.client.RemoteAddr(), "dst", tc.originalDst(), "err", err)
	}
}

// finish is the end of a handed-off connection, once its copy has completed: the record,
// both closes and the tracker's removal.
func (tc *liveConn) finish(received, sent int64, err error) {
	p := tc.copy.p
	p.record(tc, received, sent, err)
	tc.server.Close()
	tc.client.Close()
	p.conns.remove(tc)
	p.conns.wg.Done()
}

// A pump (one direction of a parkCopy that reads a TCP socket) is in one of these states.
const (
	copyRunning uint8 = iota // a goroutine reads the socket (or is about to)
	copyParked               // in the poller: no goroutine
	copyEnded                // the direction is over
)

// parkCopy copies a TCP socket ↔ HBONE stream pair (in user-space or kernel TLS) or a
// TCP ↔ TCP pair both ways until both directions have ended, propagating each half-close
// (EOF on one side becomes FIN/END_STREAM on the other while the opposite direction keeps
// flowing). Resets and EOFs are clean ends, not errors; any other error aborts both
// directions.
//
// Each direction that reads a TCP socket is a pump, on a goroutine of its own. A stream
// pair has one pump (socket → stream); its other direction is the stream's frame reader's
// (hbone.Stream.DeliverTo, which writes each DATA payload straight into the socket), with
// no goroutine. A TCP pair has two, each splicing (TCPConn.ReadFrom). Whichever direction
// ends last completes the connection (complete), once.
//
// Where the proxy's poller parks (idle.go), a pump gives up its goroutine while its
// socket is quiet and takes a fresh one when the socket becomes readable; elsewhere
// (netpoll.PerSocket) it keeps it, and nothing sweeps.
type parkCopy struct {
	p      *Proxy
	resets bool
	parks  bool // the pumps park while idle: the poller parks (and tests have not turned it off)
	flip   bool // a stream pair whose socket is the server leg: received and sent swap
	// conn is the connection the copy is part of, whose finish ends it: the record, the
	// closes, the tracker.
	conn *liveConn

	// up copies the client's socket into the server leg, or (flip) the server's socket
	// into the stream; down the other way: a pump in a TCP pair, DeliverTo's in a stream
	// pair (only its results used).
	up, down pump
	st       *hbone.Stream // the stream of a stream pair; nil in a TCP pair

	// pending counts the directions not yet over; the one that takes it to 0 completes.
	pending atomic.Int32

	mu      sync.Mutex
	closing bool // guarded by mu: the sockets are being closed; never park again
}

// pump is one direction of a parkCopy that reads a TCP socket, into an HBONE stream
// (Stream.ReadFrom: user-space reads, or in kernel TLS a splice into the kernel TLS
// socket) or into the other socket (TCPConn.ReadFrom: a splice). A past read deadline ends
// either without losing a byte and with the bytes moved counted: the deadline is checked
// before a read or splice, or when one found nothing.
type pump struct {
	c   *parkCopy
	src *net.TCPConn // read; what parks in the poller; what it writes to is dst's
	// The direction's results: written by the goroutine running it (one at a time: park
	// and Ready hand it over under c.mu), or by DeliverTo's callback, read by complete
	// after pending.
	n   int64
	err error

	state  uint8  // guarded by c.mu: copyRunning, copyParked, copyEnded
	sweeps uint8  // guarded by c.mu: sweeps seen running since the last wake-up
	token  uint64 // guarded by c.mu: the poller's watch, while parked
}

// dst is what the pump writes to: the stream of a stream pair, else the other socket.
// Worked out rather than kept: every held connection would carry it twice.
func (pm *pump) dst() halfCloser {
	s := pm.c
	switch {
	case s.st != nil:
		return s.st
	case pm == &s.up:
		return s.down.src
	default:
		return s.up.src
	}
}

// init sets up s, part of conn, for handOff's pair; false if the pair is not a TCP socket
// and an HBONE stream (in either TLS: in kernel TLS Stream.ReadFrom splices the socket into
// the stream, and the sweep's past read deadline ends the splice as it ends a read), or two
// TCP sockets.
func (s *parkCopy) init(p *Proxy, conn *liveConn, client, server halfCloser) bool {
	ctc, _ := client.(*net.TCPConn)
	stc, _ := server.(*net.TCPConn)
	cst, _ := client.(*hbone.Stream)
	sst, _ := server.(*hbone.Stream)
	switch {
	case ctc != nil && stc != nil:
		s.up.src, s.down.src = ctc, stc
	case ctc != nil && sst != nil:
		s.st, s.up.src, s.down.state = sst, ctc, copyEnded // down is DeliverTo's
	case stc != nil && cst != nil:
		s.st, s.up.src, s.down.state, s.flip = cst, stc, copyEnded, true
	default:
		return false
	}
	s.p, s.conn = p, conn
	s.resets, s.parks = !p.cfg.DisableResetPropagation, parkIdle && p.cfg.Poller.Parks()
	s.up.c, s.down.c = s, s
	// A fresh pump's read is woken at the first sweep, a resumed one's at the second
	// (idle.go). Setup has just moved the connection's first bytes, so a new connection
	// that goes quiet at once, as most idle ones do, parks 100-200 ms after its start
	// instead of 200-300. During a burst of setups that is a third fewer copies running at
	// once, each a goroutine: the runtime keeps every goroutine it ever ran at once (480 B
	// each, never freed), besides their freed stacks. The price is one woken read per
	// connection still busy at that sweep.
	s.up.sweeps, s.down.sweeps = 1, 1
	return true
}

// start runs the copy on the caller's goroutine (a tracked one handOff started) until
// the up direction ends or parks; a TCP pair's down direction starts on its own.
func (s *parkCopy) start() {
	s.pending.Store(2)
	if s.st != nil {
		if err := s.st.DeliverTo(s.up.src, s.downDone); err != nil {
			s.mu.Lock()
			s.up.state = copyEnded
			s.mu.Unlock()
			s.conn.finish(0, 0, err)
			return
		}
	}
	if s.parks {
		s.mu.Lock()
		s.p.setRunning(&s.up, true)
		if s.st == nil {
			s.p.setRunning(&s.down, true)
		}
		s.mu.Unlock()
	}
	if s.st == nil {
		go s.down.run()
	}
	s.up.run()
}

// run copies the socket into dst until the socket's data ends (end) or it parks.
func (pm *pump) run() {
	for {
		var n int64
		var err error
		if st := pm.c.st; st != nil {
			n, err = st.ReadFrom(pm.src)
		} else {
			n, err = pm.dst().(*net.TCPConn).ReadFrom(pm.src)
		}
		pm.n += n
		if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
			if pm.idle(n == 0) {
				return // parked: Ready resumes on another goroutine
			}
			continue
		}
		pm.end(err)
		return
	}
}

// end ends the direction: a clean end half-closes dst; a TCP peer's reset (with resets)
// resets both legs (RFC 9113 §8.5: to an HBONE stream as RST_STREAM(CONNECT_ERROR), which
// the peer's proxy turns back into a reset of its TCP leg), and the copy still ends
// without an error: the peer went away, the proxy did not fail. A failure aborts both.
// Either of those resumes the other direction if it is parked, to find its socket closed.
func (pm *pump) end(err error) {
	s := pm.c
	if s.resets && tcpReset(err) {
		resetBoth(pm.src, pm.dst())
		err = nil
		s.unpark()
	} else if err = endHalf(pm.dst(), err); err != nil {
		abort(pm.src, pm.dst())
		s.unpark()
	}
	pm.err = err
	s.mu.Lock()
	pm.state = copyEnded
	if s.parks {
		s.p.setRunning(pm, false)
	}
	s.mu.Unlock()
	if s.pending.Add(-1) == 0 {
		s.complete()
	}
}

// downDone is DeliverTo's callback, on the stream's frame reader (or DeliverTo's caller):
// the stream → socket direction is over. Closing the socket unparks the other direction.
func (s *parkCopy) downDone(n int64, err error) {
	tc := s.up.src
	if s.resets && tcpReset(err) {
		resetBoth(tc, s.st) // tc's peer reset it: so does the stream's
		err = nil
		s.unpark()
	} else if err = endHalf(tc, err); err != nil {
		abort(tc, s.st) // unblock the other direction
		s.unpark()
	}
	s.down.n, s.down.err = n, err
	if s.pending.Add(-1) == 0 {
		go s.complete() // not on the frame reader: done records metrics and logs
	}
}

// complete runs once, after both directions: handOff's done, closes and removal.
func (s *parkCopy) complete() {
	received, sent := s.up.n, s.down.n
	if s.flip {
		received, sent = sent, received
	}
	s.conn.finish(received, sent, errors.Join(s.down.err, s.up.err))
}

// tcpReset reports whether err is a TCP peer's reset of one of the copy's sockets
// (ECONNRESET reading, ECONNRESET or EPIPE writing), not an HBONE connection's failure.
// A stream's write after its peer's RST_STREAM fails with EPIPE too: resetting both legs
// is right for it as well when the peer carried its own TCP peer's reset (CONNECT_ERROR)
// or asked us to stop sending (NO_ERROR). Any other code (CANCEL from a node that closed
// the stream: shut down, a policy change) is the stream's failure, never a clean end.
// A read's *hbone.ResetError wraps neither errno.
func tcpReset(err error) bool {
	if err == nil || err == io.EOF || errors.Is(err, hbone.ErrConnClosed) || peerAbandoned(err) {
		return false
	}
	return errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE)
}

// peerAbandoned reports a stream write that failed because the peer reset the stream with
// a code that neither carries a TCP reset nor ends the stream cleanly.
func peerAbandoned(err error) bool {
	var re *hbone.ResetError
	return errors.As(err, &re) && re.Code != http2.ErrCodeConnect && re.Code != http2.ErrCodeNo
}

// resetBoth ends both legs with a reset: RST_STREAM(CONNECT_ERROR) on an HBONE stream
// (RFC 9113 §8.5), a TCP reset (SO_LINGER 0) on a socket.
func resetBoth(a, b net.Conn) {
	for _, c := range []net.Conn{a, b} {
		if st, ok := c.(*hbone.Stream); ok {
			st.Reset(http2.ErrCodeConnect)
		}
	}
	abort(a, b)
}

// endHalf ends one direction whose copy into dst returned err: a clean end half-closes
// dst. It returns what is not a clean end, of the copy or of the half-close, else nil.
func endHalf(dst halfCloser, err error) error {
	if err != nil && !cleanEnd(err) {
		return err
	}
	if err := dst.CloseWrite(); err != nil && !cleanEnd(err) {
		return err
	}
	return nil
}

// abort unblocks the other direction after a failure, and tells a TCP peer so with a reset
// rather than a FIN: after a failure (the HBONE connection lost mid-stream, say) a FIN would
// make a truncated stream look complete.
func abort(a, b net.Conn) {
	for _, c := range []net.Conn{a, b} {
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetLinger(0)
		}
		c.Close()
	}
}

// refuse closes a client connection the proxy accepted but cannot serve (no route, a
// failed dial, a policy denial): with a reset, unless reset propagation is off, so the
// client sees a failure where a FIN would pass for a server that answered nothing.
func (p *Proxy) refuse(c *net.TCPConn) {
	if !p.cfg.DisableResetPropagation {
		c.SetLinger(0)
	}
	c.Close()
}

// cleanEnd reports errors that mean "the peer went away", which a proxy treats as the end
// of the stream rather than a failure. An HBONE stream whose connection broke under it did
// not end: its error wraps the socket's (a reset, say) but is a failure, never clean.
func cleanEnd(err error) bool {
	if errors.Is(err, hbone.ErrConnClosed) || peerAbandoned(err) {
		return false
	}
	return errors.Is(err, io.EOF) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) ||
		errors.Is(err, syscall.ENOTCONN) || // shutdown(2) of a socket its peer has reset
		errors.Is(err, io.ErrUnexpectedEOF)
}
