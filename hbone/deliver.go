package hbone

// The stream's receive side handed to a consumer: WriteTo, where the caller's goroutine
// writes what arrives, and DeliverTo, where the connection's frame reader writes each DATA
// payload straight to a TCP socket and a short-lived goroutine drains only what the socket
// could not take. Both share the frame reader's direct write (conn.writeDirectLocked).

import (
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
)

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
		s.sink, s.directTotal = sink, 0
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
		s.sink, s.directTotal = sink, 0
	}
	s.kickLocked()
	c.mu.Unlock()
	return nil
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
	s.sink, s.directTotal = nil, 0
	return n
}

// writeSink is one non-blocking write(2) of c.direct (the socket is non-blocking; returning
// true means "do not wait for writability"). newConn makes c.sinkWrite of it once.
func (c *conn) writeSink(fd uintptr) bool {
	n, err := syscall.Write(int(fd), c.direct)
	if err != nil {
		n = 0
	}
	c.directN = n
	return true
}
