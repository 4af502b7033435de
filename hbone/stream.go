package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Stream is one CONNECT stream; it behaves like a TCP connection: Read/Write, CloseWrite
// for a half-close (END_STREAM), Close for an abort (RST_STREAM CANCEL), deadlines.
type Stream struct {
	c    *conn
	id   uint32
	cond sync.Cond // L = &c.mu; signalled on data, window, reset, deadline, close
	wmu  sync.Mutex
	rmu  sync.Mutex

	// guarded by c.mu
	rb          recvBuf
	respFields  []hpack.HeaderField // client: the response's regular header fields
	status      int
	gotResp     bool // client: response HEADERS arrived; server: always true
	sendAvail   int64
	recvAvail   int64
	unacked     int64
	recvEnd     bool // peer sent END_STREAM
	sentEnd     bool // we sent (or are sending) END_STREAM
	done        bool // no longer counted as open; removed from c.streams
	localClosed bool
	readBusy    bool // a WriteTo holds a slice of rb
	waitBusy    bool // a WriteTo waits for the frame reader's direct write to finish
	waitConn    bool
	rerr        error // what Read returns once the buffer is empty (nil: keep waiting)
	werr        error
	dl          *deadlines // nil until a deadline is set: a proxy's streams have none

	// Direct delivery to a TCP consumer (see conn.writeDirectLocked), guarded by c.mu:
	// the consumer's socket, and the bytes written to it so far.
	sink        syscall.RawConn
	directTotal int64

	// DeliverTo state, guarded by c.mu: where to write, whom to tell at the end, and
	// whether a drain goroutine is running.
	dst          *net.TCPConn
	deliverDone  func(int64, error)
	deliverTotal int64
	delivering   bool

	// Server side, guarded by c.mu: pending until the handler answers (a reset before
	// that is an early reset, limits.go); cancel ends the Request's context.
	pending bool
	// unearned: its handler spent one of the connection's stream starts (limits.go), which
	// the stream gives back at its first byte either way, or when it ends; guarded by c.mu.
	unearned bool
	cancel   context.CancelCauseFunc

	rstWritten bool // guarded by c.wmu
}

// deadlines are a stream's read and write deadlines and their timers, guarded by c.mu.
// They are apart from the Stream because a proxied stream never sets one, and a proxy
// holds a stream per idle connection: without them (56 B) and the frame reader's
// direct-write fields (now conn's), a Stream is 320 B instead of 416.
type deadlines struct {
	rdl, wdl time.Time
	rt, wt   *time.Timer
}

var (
	_ net.Conn      = (*Stream)(nil)
	_ io.ReaderFrom = (*Stream)(nil)
	_ io.WriterTo   = (*Stream)(nil)
)

// peerResetLocked records the peer's RST_STREAM. After the peer's END_STREAM its data is
// whole and reads still end in io.EOF (RFC 9113 §8.1: NO_ERROR there means "stop sending").
// Before it, whatever the code, the rest of the data is gone: what was queued is read,
// then a *ResetError, so a proxy resets its client rather than make a cut stream look
// complete with a FIN. (The Rust ztunnel turns resets into FINs, istio/ztunnel#1483.)
func (s *Stream) peerResetLocked(code http2.ErrCode) {
	switch {
	case s.recvEnd: // readErrLocked returns io.EOF once the queue is empty
	case code == http2.ErrCodeRefusedStream && !s.gotResp:
		s.rerr = fmt.Errorf("%w: %w", errRefused, &ResetError{Code: code})
	default:
		s.rerr = &ResetError{Code: code}
	}
	// A write after it fails with EPIPE, as a TCP write after the peer's reset does; the
	// *ResetError in it tells a proxy which reset it was (proxy's tcpReset).
	s.werr = fmt.Errorf("%w: %w", &ResetError{Code: code}, syscall.EPIPE)
	s.c.streamDoneLocked(s)
	s.signalLocked()
}

// readErrLocked is what a reader with an empty buffer gets, or nil to wait.
func (s *Stream) readErrLocked() error {
	if s.localClosed {
		return net.ErrClosed
	}
	if s.recvEnd {
		return io.EOF
	}
	if s.rerr != nil {
		return s.rerr
	}
	if s.c.err != nil {
		return s.c.err
	}
	if s.dl != nil && !s.dl.rdl.IsZero() && !time.Now().Before(s.dl.rdl) {
		return os.ErrDeadlineExceeded
	}
	return nil
}

func (s *Stream) writeErrLocked() error {
	switch {
	case s.localClosed:
		return net.ErrClosed
	case s.werr != nil:
		return s.werr
	case s.sentEnd:
		return errors.New("hbone: write after CloseWrite")
	case s.c.err != nil:
		return s.c.err
	case s.dl != nil && !s.dl.wdl.IsZero() && !time.Now().Before(s.dl.wdl):
		return os.ErrDeadlineExceeded
	}
	return nil
}

// Read reads data the peer sent; io.EOF after the peer's END_STREAM, a *ResetError after
// a reset that came before it.
func (s *Stream) Read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	s.rmu.Lock()
	defer s.rmu.Unlock()
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	for s.rb.n == 0 {
		if err := s.readErrLocked(); err != nil {
			return 0, err
		}
		s.cond.Wait()
	}
	if s.localClosed {
		return 0, net.ErrClosed
	}
	n := s.rb.read(p)
	c.consumedLocked(s, n)
	return n, nil
}

// signalLocked wakes the stream's waiters after a change on its read side (data, end,
// reset, close, deadline) and, under DeliverTo, starts a drain goroutine when there is
// work for one.
func (s *Stream) signalLocked() {
	s.cond.Broadcast()
	s.kickLocked()
}

// Write sends p as DATA frames as the flow-control windows allow.
func (s *Stream) Write(p []byte) (int, error) {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	return s.write(p)
}

func (s *Stream) write(p []byte) (int, error) {
	c := s.c
	total := 0
	for len(p) > 0 {
		n, err := s.reserveSend(int64(len(p)))
		if err != nil {
			return total, err
		}
		reset := s.beginData()
		if !reset {
			err = c.writeDataWLocked(s.id, p[:n])
		}
		if err := s.endData(n, reset, err); err != nil {
			return total, err
		}
		total += int(n)
		p = p[n:]
	}
	return total, nil
}

// waitSendWindow waits until the stream and its connection both have send window, or
// returns the error that ends the stream's writes.
func (s *Stream) waitSendWindow() error {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		if err := s.writeErrLocked(); err != nil {
			return err
		}
		if s.sendAvail > 0 && c.sendConnAvail > 0 {
			return nil
		}
		s.waitWindowLocked()
	}
}

// reserveSend waits until the windows allow a DATA frame and takes up to want bytes of
// them (at most a frame's worth).
func (s *Stream) reserveSend(want int64) (int64, error) {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		if err := s.writeErrLocked(); err != nil {
			return 0, err
		}
		if n := min(want, int64(c.peerMaxFrame), s.sendAvail, c.sendConnAvail); n > 0 {
			s.sendAvail -= n
			c.sendConnAvail -= n
			if s.unearned {
				c.earnedLocked(s)
			}
			return n, nil
		}
		s.waitWindowLocked()
	}
}

// beginData takes the connection's write lock for one DATA frame of the stream's, whose
// bytes reserveSend granted, and reports whether the stream was reset meanwhile: then
// nothing is written, and endData gives the bytes back.
func (s *Stream) beginData() (reset bool) {
	s.c.lockWrite()
	return s.rstWritten
}

// endData releases the write lock beginData took and settles the frame of n reserved
// bytes: an error writing it (err) or flushing closes the connection; a reset stream
// returns its n bytes to the connection's window and ends the write.
func (s *Stream) endData(n int64, reset bool, err error) error {
	c := s.c
	if ferr := c.unlockWrite(); err == nil {
		err = ferr
	}
	if err != nil {
		return c.writeFailed("write", err)
	}
	if reset {
		return s.unsent(n)
	}
	return nil
}

// waitWindowLocked waits for a change that may have opened a window (or ended the stream);
// a waiter for the connection's window is counted so WINDOW_UPDATE on 0 wakes it.
func (s *Stream) waitWindowLocked() {
	c := s.c
	if c.sendConnAvail <= 0 {
		s.waitConn = true
		c.connWaiters++
	}
	s.cond.Wait()
	if s.waitConn {
		s.waitConn = false
		c.connWaiters--
	}
}

// unsent is write's way out when RST_STREAM went out before its DATA (a Close or a
// reset won the write lock): the peer will not count those n bytes against the
// connection window, so they go back to it. It returns the error that ends the write.
func (s *Stream) unsent(n int64) error {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	c.sendConnAvail += n
	c.wakeConnWaitersLocked()
	if err := s.writeErrLocked(); err != nil {
		return err
	}
	return errors.New("hbone: write: stream reset")
}

// CloseWrite sends END_STREAM; data from the peer keeps flowing.
func (s *Stream) CloseWrite() error {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	c := s.c
	c.mu.Lock()
	if s.sentEnd {
		c.mu.Unlock()
		return nil
	}
	if err := s.writeErrLocked(); err != nil {
		c.mu.Unlock()
		return err
	}
	s.sentEnd = true
	c.mu.Unlock()
	c.lockWrite()
	var err error
	if !s.rstWritten {
		err = c.fr.WriteData(s.id, true, nil)
	}
	if ferr := c.unlockWrite(); err == nil {
		err = ferr
	}
	if err != nil {
		return c.writeFailed("close write", err)
	}
	c.mu.Lock()
	c.maybeDoneLocked(s)
	c.mu.Unlock()
	return nil
}

// Close ends the stream; if either direction has not finished it sends RST_STREAM(CANCEL).
// Idempotent.
func (s *Stream) Close() error { return s.closeCode(http2.ErrCodeCancel) }

// Reset ends the stream as Close does, with RST_STREAM(code) if either direction has not
// finished: a proxy whose TCP peer reset its connection sends CONNECT_ERROR (RFC 9113
// §8.5), which the peer's proxy turns back into a TCP reset. After Close, a no-op.
func (s *Stream) Reset(code http2.ErrCode) error { return s.closeCode(code) }

func (s *Stream) closeCode(code http2.ErrCode) error {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if s.localClosed {
		return nil
	}
	s.localClosed = true
	if !s.done {
		c.queueLocked(ctrlOp{kind: opRST, id: s.id, val: uint32(code), s: s})
		c.streamDoneLocked(s)
	}
	if s.rb.n > 0 {
		c.releaseConnLocked(int64(s.rb.n))
	}
	if !s.readBusy {
		s.rb.free()
	}
	if s.dl != nil {
		if s.dl.rt != nil {
			s.dl.rt.Stop()
		}
		if s.dl.wt != nil {
			s.dl.wt.Stop()
		}
	}
	s.signalLocked()
	return nil
}

// Header is the response's headers on the client side (nil on the server side, where the
// request's are in Request.Header). It builds a new map on each call: a stream keeps only
// the decoded fields, a few bytes where a map would hold hundreds for the stream's life.
func (s *Stream) Header() http.Header {
	if s.respFields == nil {
		return nil
	}
	h := make(http.Header, len(s.respFields))
	for _, hf := range s.respFields {
		k := http.CanonicalHeaderKey(hf.Name)
		h[k] = append(h[k], hf.Value)
	}
	return h
}

// LocalAddr is the local address of the underlying HTTP/2 connection.
func (s *Stream) LocalAddr() net.Addr { return s.c.nc.LocalAddr() }

// RemoteAddr is the peer address of the underlying HTTP/2 connection.
func (s *Stream) RemoteAddr() net.Addr { return s.c.nc.RemoteAddr() }

// SetDeadline sets both the read and write deadlines.
func (s *Stream) SetDeadline(t time.Time) error {
	s.SetReadDeadline(t)
	return s.SetWriteDeadline(t)
}

// SetReadDeadline works like net.Conn's: a blocked Read returns os.ErrDeadlineExceeded.
func (s *Stream) SetReadDeadline(t time.Time) error {
	s.setDeadline(false, t)
	return nil
}

// SetWriteDeadline bounds waiting for flow-control window. A frame already being written
// to the socket is bounded only by the connection's own health (PING timeout).
func (s *Stream) SetWriteDeadline(t time.Time) error {
	s.setDeadline(true, t)
	return nil
}

func (s *Stream) setDeadline(write bool, t time.Time) {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if s.dl == nil {
		if t.IsZero() {
			return // none set, none to clear
		}
		s.dl = new(deadlines)
	}
	dl, tm := &s.dl.rdl, &s.dl.rt
	if write {
		dl, tm = &s.dl.wdl, &s.dl.wt
	}
	*dl = t
	if *tm != nil {
		(*tm).Stop()
	}
	if t.IsZero() {
		return
	}
	d := time.Until(t)
	if d <= 0 {
		s.signalLocked()
		return
	}
	if *tm == nil {
		*tm = time.AfterFunc(d, s.wake)
	} else {
		(*tm).Reset(d)
	}
}

func (s *Stream) wake() {
	s.c.mu.Lock()
	s.signalLocked()
	s.c.mu.Unlock()
}
