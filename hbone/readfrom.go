package hbone

// The stream's send side fed from a reader: ReadFrom, with readFromPoll for a TCP socket
// (no copy buffer held while the socket is idle); the kernel-TLS splice path is
// readFromSplice in ksend.go.

import (
	"io"
	"net"
	"os"
	"reflect"
	"syscall"
)

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
// wait (the poller reports them). A read deadline ends it with os.ErrDeadlineExceeded
// having lost nothing: every byte read has been written to the stream, and the socket is
// not read once the deadline has passed (the proxy's idle copies rely on it to park).
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
