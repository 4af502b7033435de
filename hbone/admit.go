package hbone

// Handshakes (server): at most MaxHandshakes connections are in their TLS handshake (and
// preface) at once, each for at most DialTimeout; past the limit the oldest is closed
// (Server.oldestPastLimitLocked). A connection that never starts TLS or stalls halfway
// (slowloris) is the oldest, while an honest handshake takes milliseconds, so a flood of
// them delays no honest client; each costs about 6.5 KiB of heap, a goroutine and a socket
// until then, and an evicted one waiting for the CPU (HandshakeWorkers, admission.go)
// stops waiting at once.
//
// The accept side's backpressure: past 2 × MaxHandshakes connections not yet serving
// HTTP/2 (in their handshake, or evicted and on their way out), and until the goroutine of
// the connection let in last has started, a Server's listeners take no more. The rest
// wait in the kernel's backlog, where they cost nothing and their handshake deadline has
// not started, instead of in goroutines. It does not wait for handshakes queued for the
// CPU (the gate): that would make the backlog first come, first served, and a full one
// drops SYNs, while eviction sheds the oldest unserved, so the newest, an honest
// client's, still gets in.
//
// It reaches every accept loop through AdmitListener: a goroutine blocked in Accept waits
// there, and a poller that accepts on the socket itself (internal/netpoll's epoll) asks Room
// first. A connection whose source is past its per-source budgets (admission.go) is
// refused there too, as it is accepted, before any goroutine, socket option or TLS state
// is spent on it, and held until its handshake deadline before its RST (hold.go).
//
// Turns: work for connections not yet served (accepting, refusing, handshaking) yields to
// the goroutines serving established ones. Go's scheduler runs a goroutine woken by
// another next, on the waker's P and in its time slice; the accept loop and each
// connection's serving goroutine wake each other, and each handshake wakes the next at the
// gate, so under a flood of stalled handshakes such chains held a P for up to the
// runtime's 10 ms time slice while an honest stream's reader, queued there by the
// netpoller, waited (docs/PERFORMANCE.md, "A stalled-handshake flood"). The AdmitListener
// yields after each refusal and each wait for room, a handshake that waited for the gate
// yields once it has its place, and internal/netpoll's epoll loop yields after each round.

import (
	"fmt"
	"net"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// acceptRoom counts the connections a Server's listeners have let in that are not serving
// HTTP/2 yet, and wakes the accept loops waiting for room.
type acceptRoom struct {
	limit int64
	// pending: connections inside Server.serve that are not serving HTTP/2 yet.
	pending atomic.Int64
	// unstarted: a listener has let a connection in and its serving goroutine has not
	// counted itself in pending yet (goroutines the scheduler has not run are counted
	// nowhere else).
	unstarted atomic.Bool

	mu     sync.Mutex
	wakes  []func()    // guarded by mu: called once each when room may have come
	expire *time.Timer // guarded by mu: gives up on an unstarted connection after maxStartWait
}

// maxStartWait bounds how long the accept side waits for the last connection's goroutine
// to start (it may never: the accept's owner can close the connection first).
const maxStartWait = 10 * time.Millisecond

func (r *acceptRoom) free() bool { return !r.unstarted.Load() && r.pending.Load() < r.limit }

// room reports whether a listener may let another connection in now. If not, wake is
// called once, from another goroutine and never during room, when there may be room.
func (r *acceptRoom) room(wake func()) bool {
	if r.free() {
		return true
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.free() { // tell takes mu after changing the counts, so it sees wake if this misses
		return true
	}
	r.wakes = append(r.wakes, wake)
	if r.unstarted.Load() && r.expire == nil {
		r.expire = time.AfterFunc(maxStartWait, func() {
			r.mu.Lock()
			r.expire = nil
			r.mu.Unlock()
			r.unstarted.Store(false)
			r.tell()
		})
	}
	return false
}

// admitted records that a listener let a connection in.
func (r *acceptRoom) admitted() { r.unstarted.Store(true) }

// enter counts a connection's serving goroutine in pending.
func (r *acceptRoom) enter() {
	r.pending.Add(1)
	if r.unstarted.Swap(false) {
		r.tell()
	}
}

// left takes a connection off pending (once it serves HTTP/2, or leaves).
func (r *acceptRoom) left() {
	r.pending.Add(-1)
	r.tell()
}

// tell calls the waiting wakes.
func (r *acceptRoom) tell() {
	r.mu.Lock()
	wakes := r.wakes
	r.wakes = nil
	r.mu.Unlock()
	for _, wake := range wakes {
		wake()
	}
}

// AdmitListener is a Server's listener: Accept waits while the server has no room for
// another connection (the shape of x/net/netutil.LimitListener) and refuses a connection
// whose source is past its budgets as it is accepted; an accept loop that takes
// connections off the socket by itself asks Room first, Refuses after each accept (and
// gives a refused one to Hold), and tells Accepted of each connection it keeps.
type AdmitListener struct {
	net.Listener
	s         *Server
	r         *acceptRoom
	done      chan struct{} // closed by Close: ends the waits in Accept
	closeOnce sync.Once
}

// Admit wraps ln so that connections are accepted only while s has room for them.
func (s *Server) Admit(ln net.Listener) *AdmitListener {
	return &AdmitListener{Listener: ln, s: s, r: &s.adm.room, done: make(chan struct{})}
}

// Accept waits for room, then accepts. A connection whose source is past its budgets is
// refused as soon as it is accepted (held until its RST is due: hold.go), and Accept goes
// on to the next.
//
// Accept yields its P after each refusal and after each wait for room. Go's scheduler runs
// a goroutine that another wakes next, on the waker's P and in its time slice (the
// runtime's runnext), and both of the accept loop's hand-offs are such wakes: a
// connection's serving goroutine wakes Accept when it starts, and the loop wakes a serving
// goroutine with each connection. Under a flood of stalled handshakes the two took turns
// on one P while the backlog lasted, for up to the runtime's 10 ms time slice at a time,
// and goroutines the netpoller had made runnable there (the readers of established
// connections) waited behind them (46 ms in one trace, docs/PERFORMANCE.md); refusing
// needs no other goroutine, and would refuse a whole backlog before they ran. Yielding
// puts the loop behind them, once per connection.
func (l *AdmitListener) Accept() (net.Conn, error) {
	for {
		waited, err := l.waitRoom()
		if err != nil {
			return nil, err
		}
		if waited {
			runtime.Gosched()
		}
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if l.s.refusedAtAccept(sourceOf(c)) {
			l.Hold(func() { refuse(c) })
			runtime.Gosched()
			continue
		}
		l.r.admitted()
		return c, nil
	}
}

// waitRoom returns once the server has room for another connection, reporting whether it
// had to wait, or net.ErrClosed once the listener is closed.
func (l *AdmitListener) waitRoom() (waited bool, err error) {
	var wake chan struct{}
	for {
		if wake == nil {
			wake = make(chan struct{}, 1)
		}
		if l.r.room(func() {
			select {
			case wake <- struct{}{}:
			default:
			}
		}) {
			return waited, nil
		}
		select {
		case <-wake:
			waited = true
		case <-l.done:
			return waited, net.ErrClosed
		}
	}
}

// Room reports whether a connection may be accepted now; if not, wake is called once,
// from another goroutine and never during Room, when there may be room.
func (l *AdmitListener) Room(wake func()) bool { return l.r.room(wake) }

// Refuses reports whether a connection from src that was just accepted is to be refused
// (nothing else done with it: no Accepted, no goroutine; Hold takes it), its source being
// past its budgets. The refusal is counted (ServerConfig.OnDrop).
func (l *AdmitListener) Refuses(src netip.AddrPort) bool {
	return l.s.refusedAtAccept(src.Addr().Unmap())
}

// Hold takes a connection Refuses refused: reset sends it an RST and closes it, once, when
// its refusal is due (its handshake deadline, hold.go) or at once while the server is
// closed.
func (l *AdmitListener) Hold(reset func()) { l.s.adm.hold.hold(reset) }

// Accepted tells the server that a connection was accepted after Room said yes and kept.
func (l *AdmitListener) Accepted() { l.r.admitted() }

// Close closes the listener and ends an Accept waiting for room.
func (l *AdmitListener) Close() error {
	l.closeOnce.Do(func() { close(l.done) })
	return l.Listener.Close()
}

// SyscallConn is the wrapped listener's, so that a poller can watch its socket.
func (l *AdmitListener) SyscallConn() (syscall.RawConn, error) {
	sc, ok := l.Listener.(syscall.Conn)
	if !ok {
		return nil, fmt.Errorf("hbone: %T has no file descriptor", l.Listener)
	}
	return sc.SyscallConn()
}
