package proxy

import (
	"errors"
	"io"
	"net"
	"sync"
	"syscall"

	"github.com/gozt/gozt/hbone"
	"golang.org/x/net/http2"
)

// halfCloser is a connection whose write side can be shut on its own: *net.TCPConn (FIN)
// and *hbone.Stream (END_STREAM).
type halfCloser interface {
	net.Conn
	CloseWrite() error
}

// handOff registers a connection (tc, or a fresh record) for the drain deadline, then
// copies between client and server on a new tracked goroutine and returns at once. When
// the copy ends, done gets copyBoth's result; then both ends are closed and the record
// removed. A TCP socket ↔ HBONE stream pair and a TCP ↔ TCP pair go to handOffParkable
// instead, whose copy gives up its goroutines while idle (idle.go).
//
// Why a new goroutine: a proxied connection's goroutine lives as long as the connection,
// mostly waiting, and a goroutine's stack never shrinks below what its deepest call needed
// until a GC. The setup (routing, policy, TLS, HPACK, metrics) grows the accepting
// goroutine's stack; with the copy's own TLS writes on top it needs 8 KiB. Started fresh,
// the copy fits in 4 KiB (29.5 -> 21.6 KiB per idle proxied connection, both nodes).
func (p *Proxy) handOff(client, server halfCloser, tc *liveConn, done func(received, sent int64, err error)) {
	if tc == nil {
		tc = &liveConn{}
	}
	tc.client, tc.server = client, server
	if s := p.parkable(client, server); s != nil {
		p.handOffParkable(client, server, tc, s, done)
		return
	}
	remove := p.conns.add(tc)
	tc.closeWith(client, server)
	p.conns.goEvenDraining(func() {
		defer remove()
		defer client.Close()
		defer server.Close()
		done(copyBoth(client, server, !p.cfg.DisableResetPropagation))
	})
}

// handOffParkable is handOff for a pair parkable made s for (a TCP socket ↔ HBONE stream
// in either TLS, or TCP ↔ TCP), whose directions give up their goroutines while idle
// (idle.go). The tracker's count for the copy is held from here until the copy completes,
// whether goroutines run it or it is parked, so drain waits for parked connections too.
func (p *Proxy) handOffParkable(client, server halfCloser, tc *liveConn, s *parkCopy, done func(received, sent int64, err error)) {
	tc.copy = s
	remove := p.conns.add(tc)
	s.finish = func(received, sent int64, err error) {
		done(received, sent, err)
		server.Close()
		client.Close()
		remove()
		p.conns.wg.Done()
	}
	tc.closeWith(client, server, s) // s last: it unparks after the socket's close
	p.conns.wg.Add(1)
	go s.start()
}

// copyBoth moves bytes both ways until both directions have ended, propagating each
// half-close (EOF on one side becomes FIN/END_STREAM on the other while the opposite
// direction keeps flowing). It returns the bytes copied client→server (received) and
// server→client (sent). Resets and EOFs are clean ends, not errors; any other error aborts
// both directions. It closes neither connection; the caller does.
//
// Plain TCP legs stay *net.TCPConn so io.Copy splices them; hbone.Stream implements
// ReaderFrom/WriterTo so the HTTP/2 leg takes its own fast path.
//
// With resets, a TCP peer's reset is carried as a reset (RFC 9113 §8.5): to an HBONE
// stream as RST_STREAM(CONNECT_ERROR), which the peer's proxy turns back into a reset of
// its TCP leg, and to a TCP leg as a reset (abort). The copy still ends without an error,
// as a reset did before: the peer went away, the proxy did not fail.
func copyBoth(client, server halfCloser, resets bool) (received, sent int64, err error) {
	if st, ok := server.(*hbone.Stream); ok {
		if tc, ok := client.(*net.TCPConn); ok {
			return copyStream(tc, st, resets)
		}
	}
	if st, ok := client.(*hbone.Stream); ok {
		if tc, ok := server.(*net.TCPConn); ok {
			sent, received, err = copyStream(tc, st, resets)
			return received, sent, err
		}
	}
	up := func() error {
		var err error
		received, err = copyHalf(server, client, resets)
		return err
	}
	down := func() error {
		var err error
		sent, err = copyHalf(client, server, resets)
		return err
	}
	var wg sync.WaitGroup
	var bgErr error
	wg.Add(1)
	go func() {
		defer wg.Done()
		if bgErr = up(); bgErr != nil {
			abort(client, server)
		}
	}()
	fgErr := down()
	if fgErr != nil {
		abort(client, server)
	}
	wg.Wait()
	return received, sent, errors.Join(bgErr, fgErr)
}

// copyStream is copyBoth between a TCP socket and an HBONE stream on one goroutine: the
// caller's copies the socket into the stream while the stream's frame reader delivers the
// other way (hbone.Stream.DeliverTo), so an idle proxied connection holds one goroutine
// stack, not two. It returns the bytes copied tc→st and st→tc.
func copyStream(tc *net.TCPConn, st *hbone.Stream, resets bool) (toStream, fromStream int64, err error) {
	type result struct {
		n   int64
		err error
	}
	downc := make(chan result, 1)
	derr := st.DeliverTo(tc, func(n int64, err error) {
		if resets && tcpReset(err) {
			resetBoth(tc, st) // tc's peer reset it: so does the stream's
			downc <- result{n, nil}
			return
		}
		if err = endHalf(tc, err); err != nil {
			abort(tc, st) // unblock the other direction
		}
		downc <- result{n, err}
	})
	if derr != nil {
		return 0, 0, derr
	}
	// ReadFrom directly: io.Copy would reach it through five frames of the net package's
	// WriteTo plumbing, all on the stack under every TLS write this goroutine makes.
	toStream, uerr := st.ReadFrom(tc)
	if resets && tcpReset(uerr) {
		resetBoth(tc, st)
		uerr = nil
	} else if uerr = endHalf(st, uerr); uerr != nil {
		abort(tc, st)
	}
	down := <-downc
	return toStream, down.n, errors.Join(down.err, uerr)
}

// copyHalf copies src to dst, then half-closes dst; with resets, a reset of src's or
// dst's TCP peer resets both.
func copyHalf(dst, src halfCloser, resets bool) (int64, error) {
	n, err := io.Copy(dst, src)
	if resets && tcpReset(err) {
		resetBoth(dst, src)
		return n, nil
	}
	return n, endHalf(dst, err)
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
