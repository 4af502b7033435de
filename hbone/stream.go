package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"reflect"
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
	rdl, wdl    time.Time
	rt, wt      *time.Timer

	// Direct delivery to a TCP consumer (see conn.writeDirectLocked); guarded by c.mu
	// except direct/directN, owned by the frame reader while readBusy.
	sink        syscall.RawConn
	sinkFn      func(fd uintptr) bool
	direct      []byte
	directN     int
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
	// the stream gives back at its first byte either way; guarded by c.mu.
	unearned bool
	cancel   context.CancelCauseFunc

	rstWritten bool // guarded by c.wmu
}

// sinkWrite is one non-blocking write(2) of s.direct (the socket is non-blocking; returning
// true means "do not wait for writability").
func (s *Stream) sinkWrite(fd uintptr) bool {
	n, err := syscall.Write(int(fd), s.direct)
	if err != nil {
		n = 0
	}
	s.directN = n
	return true
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
	s.werr = fmt.Errorf("hbone: write: stream reset by peer (%s): %w", code, syscall.EPIPE)
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
	if !s.rdl.IsZero() && !time.Now().Before(s.rdl) {
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
	case !s.wdl.IsZero() && !time.Now().Before(s.wdl):
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

// directDelivery enables the frame reader's direct write to a WriteTo's TCP socket;
// a variable so tests and benchmarks can compare both paths.
var directDelivery = true

// WriteTo copies the stream's data to w until EOF without an intermediate buffer: the
// received chunks are written to w directly.
func (s *Stream) WriteTo(w io.Writer) (int64, error) {
	s.rmu.Lock()
	defer s.rmu.Unlock()
	c := s.c
	var total int64
	var sink syscall.RawConn
	if tc, ok := w.(*net.TCPConn); ok && directDelivery {
		sink, _ = tc.SyscallConn()
	}
	c.mu.Lock()
	if sink != nil {
		s.sink, s.sinkFn, s.directTotal = sink, s.sinkWrite, 0
	}
	for {
		for s.rb.n == 0 {
			if err := s.readErrLocked(); err != nil {
				total += s.endDirectLocked()
				c.mu.Unlock()
				if err == io.EOF {
					err = nil
				}
				return total, err
			}
			s.cond.Wait()
		}
		if s.localClosed {
			c.mu.Unlock()
			return total, net.ErrClosed
		}
		b := s.rb.peek()
		s.readBusy = true
		c.mu.Unlock()
		n, err := w.Write(b)
		c.mu.Lock()
		s.readBusy = false
		if s.localClosed {
			s.rb.free()
			total += s.endDirectLocked() + int64(n)
			c.mu.Unlock()
			return total, net.ErrClosed
		}
		s.rb.advance(n)
		c.consumedLocked(s, n)
		total += int64(n)
		if err != nil {
			total += s.endDirectLocked()
			c.mu.Unlock()
			return total, err
		}
	}
}

// DeliverTo copies the stream's data to tc like WriteTo, but with no goroutine waiting
// for it: the connection's frame reader writes each DATA payload straight to tc, and only
// when tc cannot take it all (or the stream ends with data still queued) does a
// short-lived goroutine start to write the rest and step back. An idle proxied connection
// thus costs no goroutine stack for this direction.
//
// When the stream's data ends, done is called once, with no lock held, with the bytes
// written and nil at the peer's END_STREAM, else the
// error (a reset, a lost connection, Close, a failed write to tc). It may run on the
// connection's frame reader, so it must not block: half-closing or closing tc and a
// buffered channel send are fine.
// On a connection already closed, done runs before DeliverTo returns. DeliverTo neither
// half-closes nor closes tc; done decides. Read and WriteTo must not be called until done
// has run.
func (s *Stream) DeliverTo(tc *net.TCPConn, done func(n int64, err error)) error {
	sink, err := tc.SyscallConn()
	if err != nil {
		return fmt.Errorf("hbone: deliver: %w", err)
	}
	if !s.rmu.TryLock() {
		return errors.New("hbone: deliver: stream is already being read")
	}
	c := s.c
	c.mu.Lock()
	s.dst, s.deliverDone, s.deliverTotal = tc, done, 0
	if c.closed {
		// The connection's owner may have stopped waiting for drain goroutines, so
		// deliver what is queued here.
		s.delivering = true
		c.mu.Unlock()
		s.drain()
		return nil
	}
	if directDelivery {
		s.sink, s.sinkFn, s.directTotal = sink, s.sinkWrite, 0
	}
	s.kickLocked()
	c.mu.Unlock()
	return nil
}

// signalLocked wakes the stream's waiters after a change on its read side (data, end,
// reset, close, deadline) and, under DeliverTo, starts a drain goroutine when there is
// work for one.
func (s *Stream) signalLocked() {
	s.cond.Broadcast()
	s.kickLocked()
}

func (s *Stream) kickLocked() {
	if s.deliverDone == nil || s.delivering || (s.rb.n == 0 && s.readErrLocked() == nil) {
		return
	}
	s.delivering = true
	// Counted in the connection's WaitGroup: closeWith, which ends every stream under
	// c.mu, starts the last of these before the connection's owner waits, and DeliverTo
	// on a closed connection drains on its caller's goroutine.
	s.c.wg.Add(1)
	go s.drainCounted()
}

// drainCounted is drain on its own goroutine, which the connection's owner waits for.
func (s *Stream) drainCounted() {
	defer s.c.wg.Done()
	s.drain()
}

// drain writes buffered data to DeliverTo's socket until the buffer is empty, then exits
// (the frame reader writes directly again), or, once the stream's data has ended, calls
// done.
func (s *Stream) drain() {
	c := s.c
	c.mu.Lock()
	var err error
	for {
		if s.localClosed {
			err = net.ErrClosed
			break
		}
		if s.rb.n == 0 {
			if err = s.readErrLocked(); err == nil {
				s.delivering = false
				c.mu.Unlock()
				return
			}
			s.waitDirectLocked()
			if s.rb.n > 0 && !s.localClosed {
				continue // what that write left over
			}
			if err == io.EOF {
				err = nil
			}
			break
		}
		b := s.rb.peek()
		s.readBusy = true
		c.mu.Unlock()
		n, werr := s.dst.Write(b)
		c.mu.Lock()
		s.readBusy = false
		s.deliverTotal += int64(n)
		if s.localClosed {
			s.rb.free()
			err = net.ErrClosed
			break
		}
		s.rb.advance(n)
		c.consumedLocked(s, n)
		if werr != nil {
			err = werr
			break
		}
	}
	total := s.deliverTotal + s.endDirectLocked()
	done := s.deliverDone
	s.dst, s.deliverDone, s.deliverTotal = nil, nil, 0
	c.mu.Unlock()
	s.rmu.Unlock()
	done(total, err)
}

// waitDirectLocked waits for a direct write of the frame reader's in flight to finish
// (writeDirectLocked wakes us when waitBusy is set).
func (s *Stream) waitDirectLocked() {
	for s.readBusy {
		s.waitBusy = true
		s.cond.Wait()
	}
}

// endDirectLocked stops the frame reader's direct writes, once one in flight has finished,
// and returns the bytes they wrote.
func (s *Stream) endDirectLocked() int64 {
	s.waitDirectLocked()
	n := s.directTotal
	s.sink, s.sinkFn, s.directTotal = nil, nil, 0
	return n
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
		c.closeWith(err)
		return fmt.Errorf("hbone: write: %w", err)
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

// ReadFrom copies r into the stream until r's EOF (it does not CloseWrite). Reads grow
// from 16 KiB to 1 MiB while they fill their buffers, so bulk data leaves as large DATA
// frames while request/response traffic borrows 16 KiB.
// From a TCP socket it borrows its buffer only once the socket is readable, so an idle
// proxied connection holds no copy buffer at all (see readFromPoll).
func (s *Stream) ReadFrom(r io.Reader) (int64, error) {
	s.wmu.Lock()
	defer s.wmu.Unlock()
	if rc := pollable(r); rc != nil {
		if s.c.kt.conn != nil && spliceSend {
			return s.readFromSplice(rc)
		}
		return s.readFromPoll(rc)
	}
	var total int64
	var cb copyBuf
	defer cb.release()
	for {
		buf := cb.get()
		n, err := r.Read(buf)
		cb.adapt(n)
		if n > 0 {
			if _, werr := s.write(buf[:n]); werr != nil {
				return total, werr
			}
			total += int64(n)
		}
		if err == io.EOF {
			return total, nil
		}
		if err != nil {
			return total, err
		}
	}
}

// pollReads enables readFromPoll; a variable so tests and benchmarks can compare both paths.
var pollReads = true

// pollable returns the raw connection of a *net.TCPConn, also when it arrives wrapped by
// the net package's own io.Copy helper (TCPConn.WriteTo hands ReadFrom a struct that
// embeds the conn and adds nothing to Read), or nil. Any other type that embeds a
// *net.TCPConn is refused: it may buffer bytes its Read returns before the socket's.
func pollable(r io.Reader) syscall.RawConn {
	if !pollReads {
		return nil
	}
	var sc syscall.Conn
	switch c := r.(type) {
	case *net.TCPConn:
		sc = c
	default:
		if reflect.TypeOf(r).String() != "net.tcpConnWithoutWriteTo" {
			return nil
		}
		if sc, _ = r.(syscall.Conn); sc == nil {
			return nil
		}
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil
	}
	return rc
}

// readFromPoll is ReadFrom for a TCP socket: it waits for readability through the
// runtime poller with no buffer held, then borrows a pooled one for a single read(2) and
// returns it after the frame is written. Deadlines and Close on the socket still end the
// wait (the poller reports them).
func (s *Stream) readFromPoll(rc syscall.RawConn) (int64, error) {
	var total int64
	// cb is released by hand on every return: a defer here grows the idle goroutine's stack
	// past 4 KiB (TestIdleConnectionStacks).
	var cb copyBuf
	var n int
	var rerr error
	read := func(fd uintptr) bool {
		buf := cb.get()
		for {
			n, rerr = syscall.Read(int(fd), buf)
			if rerr != syscall.EINTR {
				break
			}
		}
		if rerr == syscall.EAGAIN {
			cb.release() // idle: wait for readability without a buffer
			return false
		}
		return true
	}
	for {
		// Wait for window before borrowing a buffer too, so a stream its peer does not
		// read (a zero window, held forever) holds no copy buffer either.
		if err := s.waitSendWindow(); err != nil {
			return total, err
		}
		err := rc.Read(read)
		if err == nil && rerr != nil {
			err = os.NewSyscallError("read", rerr)
		}
		if err != nil {
			cb.release()
			return total, err
		}
		if n <= 0 { // orderly shutdown by the peer
			cb.release()
			return total, nil
		}
		_, werr := s.write(cb.cur[:n])
		cb.release()
		cb.adapt(n)
		if werr != nil {
			return total, werr
		}
		total += int64(n)
	}
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
		c.closeWith(err)
		return fmt.Errorf("hbone: close write: %w", err)
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
	if s.rt != nil {
		s.rt.Stop()
	}
	if s.wt != nil {
		s.wt.Stop()
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
	s.setDeadline(&s.rdl, &s.rt, t)
	return nil
}

// SetWriteDeadline bounds waiting for flow-control window. A frame already being written
// to the socket is bounded only by the connection's own health (PING timeout).
func (s *Stream) SetWriteDeadline(t time.Time) error {
	s.setDeadline(&s.wdl, &s.wt, t)
	return nil
}

func (s *Stream) setDeadline(dl *time.Time, tm **time.Timer, t time.Time) {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
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
