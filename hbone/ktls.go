package hbone

// Kernel TLS: after crypto/tls's handshake the record layer moves to the kernel
// (internal/ktls) when it can take it; DATA payloads then move by splice(2).

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/gozt/gozt/internal/ktls"
)

// tlsStart is one connection's TLS from its handshake to the frames' first byte.
type tlsStart struct {
	raw  net.Conn
	bc   *bufConn // under crypto/tls (records coalesced on the user-space path)
	tc   *tls.Conn
	h    *ktls.Handoff // nil: kernel TLS is not tried
	info TLSInfo
}

// kernelMemo remembers, for a Pool or Server, that the kernel has no TLS ULP, so its
// connections stop asking for a while: each refused setsockopt(TCP_ULP) can make the
// kernel run modprobe.
type kernelMemo struct {
	noneUntil atomic.Int64 // unix nanoseconds
}

const kernelRetry = time.Minute

var errKernelMemo = errors.New("the kernel refused TCP_ULP tls on an earlier connection")

// kernelAvailable is ktls.Available; a variable so that tests on a kernel without kernel
// TLS can take the fallback after the handshake too.
var kernelAvailable = ktls.Available

// startTLS prepares the handshake over raw: through internal/ktls when kernel TLS is
// worth trying, else crypto/tls as before.
func startTLS(raw net.Conn, cfg *tls.Config, server bool, hc *Config, memo *kernelMemo) *tlsStart {
	t := &tlsStart{raw: raw, bc: &bufConn{Conn: raw}, info: TLSInfo{Server: server}}
	tcp := tcpOf(raw)
	switch {
	case hc.DisableKernelTLS:
		t.info.Reason = "disabled"
	case tcp == nil:
		t.info.Reason = string(ktls.ReasonNotTCP)
	case time.Now().UnixNano() < memo.noneUntil.Load():
		t.info.Reason, t.info.Err = string(ktls.ReasonNoKernelTLS), errKernelMemo
	default:
		// Asked before the handshake, so a connection the kernel cannot take runs exactly
		// the user-space path from its start.
		if err := kernelAvailable(tcp); err != nil {
			t.fallback(err, memo)
		} else if server {
			t.tc, t.h = ktls.Server(t.bc, cfg)
		} else {
			t.tc, t.h = ktls.Client(t.bc, cfg)
		}
	}
	if t.tc == nil {
		if server {
			t.tc = tls.Server(t.bc, cfg)
		} else {
			t.tc = tls.Client(t.bc, cfg)
		}
	}
	return t
}

// fallback notes why the connection stays in user space (err is a *ktls.FallbackError).
func (t *tlsStart) fallback(err error, memo *kernelMemo) {
	var fe *ktls.FallbackError
	if !errors.As(err, &fe) {
		t.info.Reason, t.info.Err = string(ktls.ReasonNoKernelTLS), err
		return
	}
	t.info.Reason, t.info.Err = string(fe.Reason), fe.Err
	if fe.Reason == ktls.ReasonNoKernelTLS || fe.Reason == ktls.ReasonNotSupported {
		memo.noneUntil.Store(time.Now().Add(kernelRetry).UnixNano())
	}
}

func (t *tlsStart) handshake(ctx context.Context) error {
	if t.h != nil {
		return t.h.Handshake(ctx)
	}
	return t.tc.HandshakeContext(ctx)
}

// finish switches to kernel TLS if it can, tells hc.OnTLS, and returns what frames go
// through (always a coalescing bufConn) and the kernel TLS conn (nil on the user-space
// path). An error means the connection is unusable.
func (t *tlsStart) finish(hc *Config, memo *kernelMemo) (nc net.Conn, bc *bufConn, kc *ktls.Conn, err error) {
	if t.h != nil {
		kc, err = t.h.Enable()
		var fe *ktls.FallbackError
		switch {
		case err == nil:
			t.info.Kernel = true
		case errors.As(err, &fe) && fe.Unusable:
			return nil, nil, nil, err
		case fe != nil:
			t.fallback(fe, memo)
		default:
			return nil, nil, nil, err
		}
	}
	if hc.OnTLS != nil {
		hc.OnTLS(t.info)
	}
	if kc != nil {
		bc = &bufConn{Conn: &kernelConn{Conn: kc, raw: t.raw}, buffering: true}
		return bc, bc, kc, nil
	}
	t.bc.buffering = true
	return t.tc, t.bc, nil, nil
}

// kernelConn is the kernel TLS conn with the addresses of the raw conn it replaced (a
// redirected connection's LocalAddr is the address the client dialed).
type kernelConn struct {
	*ktls.Conn
	raw net.Conn
}

func (k *kernelConn) LocalAddr() net.Addr  { return k.raw.LocalAddr() }
func (k *kernelConn) RemoteAddr() net.Addr { return k.raw.RemoteAddr() }

// tcpOf is the socket under c: c itself or what a ktls.TCPWrapper wraps.
func tcpOf(c net.Conn) *net.TCPConn {
	switch c := c.(type) {
	case *net.TCPConn:
		return c
	case ktls.TCPWrapper:
		return c.TCP()
	}
	return nil
}

// TCP makes bufConn a ktls.TCPWrapper: it does not buffer until the handshake is over.
func (b *bufConn) TCP() *net.TCPConn { return tcpOf(b.Conn) }

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

// KernelTLS reports whether the stream's connection runs in kernel TLS.
func (s *Stream) KernelTLS() bool { return s.c.kc != nil }

// KernelTLSBytes is what the stream's connection has moved so far by each path (zero
// on the user-space path).
func (s *Stream) KernelTLSBytes() KernelTLSBytes { return s.c.kernelBytes() }

func (c *conn) kernelBytes() KernelTLSBytes {
	return KernelTLSBytes{
		SplicedOut: c.splicedOut.Load(), CopiedOut: c.copiedOut.Load(),
		SplicedIn: c.splicedIn.Load(), CopiedIn: c.copiedIn.Load(),
	}
}

// reportKernelEnd tells OnKernelTLSEnd what a kernel TLS connection moved; its owner
// calls it once the connection's goroutines have exited.
func (c *conn) reportKernelEnd() {
	if c.kc != nil && c.cfg.OnKernelTLSEnd != nil {
		c.cfg.OnKernelTLSEnd(c.kernelBytes())
	}
}

// spliceSend enables readFromSplice; a variable so tests and benchmarks can compare both
// paths.
var spliceSend = true

// spliceMax bounds one fill of the pipe (its size, when the kernel grants it).
const spliceMax = 1 << 20

// readFromSplice is readFromPoll for a kernel TLS connection: each DATA payload moves TCP
// socket → pipe → kernel TLS socket with splice(2), never through user space. Like
// readFromPoll's buffer, the pipe is borrowed only while the socket has data.
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
	_, err := c.kc.WriteMore(c.bc.buf)
	c.bc.buf = c.bc.buf[:0]
	if err != nil {
		return err
	}
	c.spl, c.splLeft, c.splErr = sp, n, nil
	err = c.krc.Write(c.splFn)
	c.spl = nil
	c.splicedOut.Add(int64(n - c.splLeft))
	if err == nil {
		err = c.splErr
	}
	return err
}

// spliceWrite is spliceDataWLocked's poll callback (made once per connection: a closure
// per frame would allocate): it moves c.splLeft bytes of c.spl into the socket, waiting
// while the socket's send buffer is full.
func (c *conn) spliceWrite(fd uintptr) bool {
	for c.splLeft > 0 {
		m, err := c.spl.DrainFD(int(fd), c.splLeft)
		if err == syscall.EAGAIN {
			return false
		}
		if err != nil {
			c.splErr = err
			return true
		}
		c.splLeft -= m
	}
	return true
}
