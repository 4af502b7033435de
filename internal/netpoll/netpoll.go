// Package netpoll is the node's socket poller: it waits on sockets for their owners and
// hands over what arrives. A proxy's listeners, a DNS proxy's sockets and a proxied
// connection gone quiet are all watched through one Poller, which cmd/ztunnel makes once
// per node and hands to every proxy and DNS proxy.
//
// It accepts connections, reads datagrams and reports readability; it does not serve
// them, nor open or close sockets: stopping a watch leaves the socket open, and its owner
// closes it.
//
// Two implementations, one contract:
//
//   - New's, on Linux: one epoll set and one goroutine for every socket of the node
//     (epoll_linux.go). In-pod mode opens seven sockets per pod and a node holds a few
//     hundred pods, mostly idle; a goroutine blocked in Accept or ReadFrom on each would
//     keep its stack and read buffer. Idle proxied connections park in it too
//     (WatchReadable), so they hold no goroutine either.
//   - PerSocket: a goroutine per watched socket, blocked in Accept or ReadFrom; New's
//     elsewhere, the zero value's choice of a proxy or DNS proxy given none, and the
//     other half of the tests on Linux. It cannot watch readability without a goroutine,
//     so it does not (Parks is false): a quiet connection keeps the goroutine copying it.
//
// Either way a failed accept or read (out of file descriptors, say) is reported to the
// callback and retried after a delay that doubles from 5 ms to 1 s (backoff.go), rather
// than at once: the connection stays queued, so retrying at once would spin.
package netpoll

import (
	"net"
	"net/netip"
	"syscall"
)

// Poller waits on sockets. Callbacks run on the poller's goroutines and must not block:
// they hand work to goroutines of their own.
type Poller interface {
	// Watch calls accepted with each connection ln accepts (a *net.TCPConn; the epoll
	// poller's have no keepalive, as if ln were made with KeepAlive -1, as a proxy's
	// listeners are), or with the error of a failed accept, until stop is called; once stop
	// has returned it calls it no more. stop leaves ln open, and is idempotent. A listener
	// that is a Gate takes connections only while it has room.
	Watch(ln net.Listener, accepted func(net.Conn, error)) (stop func(), err error)
	// WatchPacket calls read with each datagram pc receives (b is valid only during the
	// call, and holds at most 64 KiB), its sender and the address it was sent to (when pc
	// reports it: sockopt.SetRecvDst; else the zero Addr), or with the error of a failed
	// read, as Watch does. pc must be a *net.UDPConn.
	WatchPacket(pc net.PacketConn, read func(b []byte, from netip.AddrPort, to netip.Addr, err error)) (stop func(), err error)
	// WatchReadable calls r.Ready once, not blocking, when r's socket is readable, its
	// peer has shut down its write side, or it has an error or hang-up pending, unless
	// CancelReadable is called first with the token it returns. The readiness already
	// there at the call counts. Ready is called with the socket out of the watch, so it
	// may watch it again. A socket closed while watched gets no call: its owner cancels.
	// Where Parks is false it fails with errors.ErrUnsupported.
	WatchReadable(r Readable) (token uint64, err error)
	// CancelReadable ends WatchReadable's watch of token, and reports whether it came
	// before the watch's Ready (which then never comes).
	CancelReadable(token uint64) bool
	// Parks reports whether WatchReadable waits without a goroutine, so that a caller
	// gains by giving up its own goroutine while a socket is quiet.
	Parks() bool
	// Close releases the poller once every watch has stopped; watches still open stop
	// being served (their stop stays safe to call). It is idempotent.
	Close() error
}

// Readable is a socket WatchReadable watches, and its owner's callback. An owner that
// parks many quiet connections implements it on a record it keeps anyway, so that a
// watch costs no closure.
type Readable interface {
	syscall.Conn
	Ready()
}

// Gate is what a watched listener implements to hold accepts back (hbone's AdmitListener,
// its handshake backpressure): while it has no room, its connections wait in the
// kernel's backlog. The epoll poller accepts on the socket itself, asks Room before each
// accept and Refuses after it; PerSocket calls the listener's Accept, which must wait for
// room and refuse by itself.
type Gate interface {
	// Room reports whether another connection may be accepted now; if not, wake is called
	// once, from another goroutine and never during Room, when there may be room.
	Room(wake func()) bool
	// Refuses reports whether a connection from src (as the kernel gave it: an IPv4 peer of
	// an IPv6 listener is IPv4-mapped), just accepted, is to be refused: the
	// epoll poller hands it to Hold before it becomes a net.Conn (no dup, no socket option,
	// no callback), and Accepted is not told of it.
	Refuses(src netip.AddrPort) bool
	// Hold takes a connection Refuses refused: reset sends it an RST (SO_LINGER 0) and
	// closes it, and the gate calls it once, at once or later (hbone holds a refused
	// connection until its handshake deadline, so that its client does not dial again at
	// once).
	Hold(reset func())
	// Accepted tells the gate that a connection was accepted after Room said yes, and kept.
	Accepted()
}

// maxDatagram is the read buffer of a packet socket: the largest UDP payload.
const maxDatagram = 65535
