package hbone

// Kernel TLS, the send side (kread.go is the receive side): DATA frames written into the
// kernel TLS socket, from user space in one writev(2) with the buffered frames, or spliced
// TCP socket → pipe → kernel TLS socket (Stream.ReadFrom), with the pipes' free list.

import (
	"io"
	"sync"
	"syscall"

	"github.com/gozt/gozt/internal/ktls"
)

// writeKernelDataWLocked is writeDataWLocked in kernel TLS. Not inlined: its frame would
// grow the user-space path's, whose TLS writes keep an idle copy goroutine's stack within
// 4 KiB (TestIdleConnectionStacks).
//
//go:noinline
func (c *conn) writeKernelDataWLocked(id uint32, p []byte) error {
	c.kt.copiedOut.Add(int64(len(p)))
	if len(p) <= smallData {
		return c.fr.WriteData(id, false, p)
	}
	c.kt.iov[0], c.kt.iov[1], c.kt.iov[2] = c.bc.buf, c.dataHeaderWLocked(id, len(p)), p
	c.kt.bufs = c.kt.iov[:]
	_, err := c.kt.bufs.WriteTo(c.kt.conn.NetConn())
	c.bc.buf = c.bc.buf[:0]
	c.kt.iov = [3][]byte{}
	return err
}

// pipes keeps idle splice pipes for reuse: each is two file descriptors and two syscalls
// to make, and a sync.Pool would drop them without closing them.
var pipes struct {
	mu   sync.Mutex
	free []*ktls.Splicer
}

const maxIdlePipes = 32

func getPipe() (*ktls.Splicer, error) {
	pipes.mu.Lock()
	if n := len(pipes.free); n > 0 {
		sp := pipes.free[n-1]
		pipes.free[n-1] = nil
		pipes.free = pipes.free[:n-1]
		pipes.mu.Unlock()
		return sp, nil
	}
	pipes.mu.Unlock()
	return ktls.NewSplicer()
}

// putPipe keeps sp for reuse if it is empty, else closes it.
func putPipe(sp *ktls.Splicer) {
	if sp == nil {
		return
	}
	pipes.mu.Lock()
	if sp.Buffered() == 0 && len(pipes.free) < maxIdlePipes {
		pipes.free = append(pipes.free, sp)
		sp = nil
	}
	pipes.mu.Unlock()
	if sp != nil {
		sp.Close()
	}
}

// spliceSend enables readFromSplice; a variable so tests and benchmarks can compare both
// paths.
var spliceSend = true

// spliceMax bounds one fill of the pipe (its size, when the kernel grants it).
const spliceMax = 1 << 20

// readFromSplice is readFromPoll for a kernel TLS connection: each DATA payload moves TCP
// socket → pipe → kernel TLS socket with splice(2), never through user space. Like
// readFromPoll's buffer, the pipe is borrowed only while the socket has data. A read
// deadline on the socket ends it as it ends readFromPoll, with os.ErrDeadlineExceeded and
// nothing lost: the runtime checks the deadline before fill runs and while it waits, never
// between a fill and its frames, and the pipe is empty whenever it waits (the proxy's idle
// copies rely on it to park, TestKernelTLSReadFromDeadline).
func (s *Stream) readFromSplice(rc syscall.RawConn) (int64, error) {
	var total int64
	var sp *ktls.Splicer
	var ferr, perr error
	fill := func(fd uintptr) bool {
		if sp == nil {
			if sp, perr = getPipe(); perr != nil {
				return true
			}
		}
		_, ferr = sp.FillFD(int(fd), spliceMax)
		if ferr == syscall.EAGAIN {
			putPipe(sp) // idle: wait without a pipe
			sp = nil
			return false
		}
		return true
	}
	for {
		// As readFromPoll: a stream its peer does not read holds no pipe.
		if sp != nil && !s.sendWindowOpen() {
			putPipe(sp)
			sp = nil
		}
		if err := s.waitSendWindow(); err != nil {
			putPipe(sp)
			return total, err
		}
		err := rc.Read(fill)
		if perr != nil {
			// No pipe (out of file descriptors?): copy through user space instead.
			k, err := s.readFromPoll(rc)
			return total + k, err
		}
		if err == nil {
			err = ferr
		}
		if err == io.EOF {
			putPipe(sp)
			return total, nil
		}
		if err != nil {
			putPipe(sp)
			return total, err
		}
		k, err := s.writeSpliced(sp)
		total += k
		if err != nil {
			putPipe(sp) // closed if the reset left bytes in it
			return total, err
		}
	}
}

// sendWindowOpen reports whether a DATA frame could go out now.
func (s *Stream) sendWindowOpen() bool {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	return s.sendAvail > 0 && c.sendConnAvail > 0
}

// writeSpliced sends what sp holds as DATA frames as the windows allow.
func (s *Stream) writeSpliced(sp *ktls.Splicer) (int64, error) {
	c := s.c
	var sent int64
	for sp.Buffered() > 0 {
		k, err := s.reserveSend(int64(sp.Buffered()))
		if err != nil {
			return sent, err
		}
		reset := s.beginData()
		if !reset {
			err = c.spliceDataWLocked(s.id, sp, int(k))
		}
		if err := s.endData(k, reset, err); err != nil {
			return sent, err
		}
		sent += k
	}
	return sent, nil
}

// spliceDataWLocked writes one DATA frame of n bytes from sp: the buffered frames and the
// 9-byte header with MSG_MORE, so the kernel keeps the record open, then the payload
// spliced into the same record.
func (c *conn) spliceDataWLocked(id uint32, sp *ktls.Splicer, n int) error {
	c.bc.buf = append(c.bc.buf, c.dataHeaderWLocked(id, n)...)
	_, err := c.kt.conn.WriteMore(c.bc.buf)
	c.bc.buf = c.bc.buf[:0]
	if err != nil {
		return err
	}
	c.kt.spl, c.kt.splLeft, c.kt.splErr = sp, n, nil
	err = c.kt.rc.Write(c.kt.spliceFn)
	c.kt.spl = nil
	c.kt.splicedOut.Add(int64(n - c.kt.splLeft))
	if err == nil {
		err = c.kt.splErr
	}
	return err
}

// spliceWrite is spliceDataWLocked's poll callback (made once per connection: a closure
// per frame would allocate): it moves c.kt.splLeft bytes of c.kt.spl into the socket, waiting
// while the socket's send buffer is full.
func (c *conn) spliceWrite(fd uintptr) bool {
	for c.kt.splLeft > 0 {
		m, err := c.kt.spl.DrainFD(int(fd), c.kt.splLeft)
		if err == syscall.EAGAIN {
			return false
		}
		if err != nil {
			c.kt.splErr = err
			return true
		}
		c.kt.splLeft -= m
	}
	return true
}
