package hbone

// Kernel TLS, its start: the handshake through internal/ktls, the move of the record layer
// to the kernel after it, the fallback to crypto/tls, and what a connection reports. The
// send side is ksend.go, the receive side kread.go.
//
// On the connections whose handshake this package runs (Pool's dials, ServeTLS) the kernel
// is asked first: ktls.Available installs the TLS ULP, which leaves the socket plain TCP
// until keys arrive. If it has kernel TLS (tls.ko), the handshake goes through
// internal/ktls, and after it (and the ALPN check) the record layer moves to the kernel if
// it also has the cipher suite. Config.DisableKernelTLS turns this off, and so does FIPS
// 140-3 mode (internal/ktls refuses with "fips": records stay in Go's module). Where the
// kernel cannot, the connection runs in crypto/tls (from its start, when the kernel said
// no before the handshake), and Config.OnTLS hears why in one word (no_kernel_tls,
// cipher, ...); a kernel that refused the ULP is not asked again for a minute (each
// refusal can run modprobe).
//
// In kernel TLS a DATA payload moves by splice(2), never through user space: from a TCP
// socket into the connection (Stream.ReadFrom, ksend.go) and from the connection into a
// DeliverTo socket (the frame reader, kread.go); other writes go through the coalescing
// buffer, a large user-space payload joining it in one writev(2). Stream.KernelTLSBytes
// counts the bytes spliced and copied each way. Each connection's frame reader keeps a
// pipe (two descriptors); a stream borrows one from a free list only while it sends.
//
// Kernel TLS here follows no KeyUpdate, so only a connection whose peer promised never to
// send one moves to it: the peer negotiated NextProtoNoKeyUpdate ("gozt-h2", HTTP/2 from
// gozt) rather than "h2" (the Rust ztunnel's rustls sends KeyUpdates). Every other
// connection stays in crypto/tls, which follows them, with TLSInfo.Reason
// "peer_may_update_keys", and reads as one that never tried (ktls.Handoff.Decline ends its
// handshake's record-by-record reads). A KeyUpdate that arrives anyway ends the connection
// (its streams fail; the pool dials a new one), and so does any alert; keylimit.go counts
// the records each key protects. closeWith closes the socket, not the kernel TLS conn,
// whose close_notify would bypass the write lock.

import (
	"context"
	"crypto/tls"
	"errors"
	"net"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/net/http2"

	"github.com/gozt/gozt/internal/ktls"
)

// kernelTLS is a connection's kernel TLS state, grouped by who may touch it. conn.kt.conn
// nil means the connection runs in crypto/tls (or the caller's TLS) and the rest is unused.
type kernelTLS struct {
	// Set by newConn, then read-only.
	conn     *ktls.Conn            // the kernel handles TLS records
	reader   *kernelReader         // what the Framer reads from (kread.go)
	rc       syscall.RawConn       // conn's socket, for the send splice (ksend.go)
	spliceFn func(fd uintptr) bool // spliceWrite, bound once: a closure per frame would allocate

	// DATA payload bytes by path (KernelTLSBytes); atomic, from any goroutine.
	splicedOut, copiedOut, splicedIn, copiedIn atomic.Int64

	// The send side's scratch, under conn.wmu (ksend.go).
	iov     [3][]byte   // buffered frames, DATA header, payload
	bufs    net.Buffers // over iov; a field, so writev's argument does not escape per call
	spl     *ktls.Splicer
	splLeft int
	splErr  error
}

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
	t := &tlsStart{raw: raw, bc: &bufConn{Conn: raw, count: true}, info: TLSInfo{Server: server}}
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

// NextProtoNoKeyUpdate is the ALPN protocol by which gozt tells its HBONE peer it will
// never initiate a TLS KeyUpdate: HTTP/2, exactly as "h2", from a peer that keeps its keys.
// A Pool offers it before "h2"; a Server selects it when its tls.Config lists it (gozt's
// certificate manager does). Only a connection that negotiated it moves to kernel TLS: the
// kernel follows no KeyUpdate (see internal/ktls), and a peer that may send one — the Rust
// ztunnel's rustls does at its confidentiality limit, update_requested included — would end
// the connection and every stream on it. With such a peer crypto/tls keeps the records and
// follows its KeyUpdates both ways, so no stream is lost. A later gozt that sends KeyUpdates
// must stop offering this protocol (or follow them under kernel TLS).
const NextProtoNoKeyUpdate = "gozt-h2"

// reasonPeerMayRekey is TLSInfo.Reason for a connection kept in user space because its
// peer did not promise NextProtoNoKeyUpdate.
const reasonPeerMayRekey = "peer_may_update_keys"

// negotiatedH2 reports whether tc negotiated HTTP/2, and whether with a peer that keeps
// its keys (NextProtoNoKeyUpdate).
func negotiatedH2(tc *tls.Conn) (h2, keepsKeys bool) {
	switch tc.ConnectionState().NegotiatedProtocol {
	case NextProtoNoKeyUpdate:
		return true, true
	case http2.NextProtoTLS:
		return true, false
	}
	return false, false
}

// finish switches to kernel TLS if it can and the peer keeps its keys, tells hc.OnTLS, and
// returns what frames go through (always a coalescing bufConn) and the kernel TLS conn (nil
// on the user-space path). An error means the connection is unusable.
func (t *tlsStart) finish(hc *Config, memo *kernelMemo) (nc net.Conn, bc *bufConn, kc *ktls.Conn, err error) {
	if _, keepsKeys := negotiatedH2(t.tc); t.h != nil && !keepsKeys {
		// The ULP stays installed without keys: a plain socket under crypto/tls, which
		// from now on reads it in bulk, not record by record.
		t.h.Decline()
		t.h = nil
		t.info.Reason = reasonPeerMayRekey
	}
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
	if t.tc.ConnectionState().Version == tls.VersionTLS13 {
		t.bc.tx.keys = &sendKeys{}
	}
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

// KernelTLS reports whether the stream's connection runs in kernel TLS.
func (s *Stream) KernelTLS() bool { return s.c.kt.conn != nil }

// KernelTLSBytes is what the stream's connection has moved so far by each path (zero
// on the user-space path).
func (s *Stream) KernelTLSBytes() KernelTLSBytes { return s.c.kernelBytes() }

func (c *conn) kernelBytes() KernelTLSBytes {
	return KernelTLSBytes{
		SplicedOut: c.kt.splicedOut.Load(), CopiedOut: c.kt.copiedOut.Load(),
		SplicedIn: c.kt.splicedIn.Load(), CopiedIn: c.kt.copiedIn.Load(),
	}
}

// reportKernelEnd tells OnKernelTLSEnd what a kernel TLS connection moved; its owner
// calls it once the connection's goroutines have exited.
func (c *conn) reportKernelEnd() {
	if c.kt.conn != nil && c.cfg.OnKernelTLSEnd != nil {
		c.cfg.OnKernelTLSEnd(c.kernelBytes())
	}
}
