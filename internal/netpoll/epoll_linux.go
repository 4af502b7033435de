//go:build linux

package netpoll

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gozt/gozt/internal/sockopt"
)

// The epoll Poller.
//
// It owns an epoll set whose fd is itself registered, non-blocking, with Go's netpoller,
// so its one goroutine (run) parks like any reader and holds no OS thread while nothing
// happens. Each watched socket stays its owner's net.Listener or net.PacketConn: the
// poller adds it to the set level-triggered (EPOLLIN) under a token that is never reused,
// and on readiness accepts (accept4) or reads (recvmsg) a batch of at most batch, then
// moves on to the next ready socket, so one busy socket cannot hold up the others; level
// triggering reports the rest on the next round. An accepted fd becomes a *net.TCPConn
// through net.FileConn (one dup, and the dup is what Go's netpoller watches), so a
// proxy's copy can still splice it.
//
// The poller touches a watched socket's fd only inside its syscall.RawConn's Control,
// which holds Go's reference to the fd: an owner's Close that races it is deferred until
// Control returns, and Control fails afterwards. So the poller never accepts on, reads
// from or deregisters a reused fd number, and a closed socket leaves the set by itself
// (the kernel drops a file's epoll entries when its last fd closes). Events carry tokens,
// not fds: a token whose watch has stopped is not found and its event is dropped. The
// epoll fd is used inside its own Control likewise, so Close cannot race a registration.
//
// WatchReadable adds a socket one-shot (EPOLLIN|EPOLLRDHUP|EPOLLONESHOT): its first event
// takes it out of the set and calls its owner back once; it reads nothing. Its token is
// in onces; whoever takes the token out of the map, the event or the owner's cancel, has
// the socket's one outcome.
//
// Locks: epoll.mu guards watches and onces (the token maps) and next. watch.mu is held by
// run while it serves the watch, callbacks included, and by stop, so once stop has
// returned no callback runs and none will; it guards stopped, failing, gated and delay.
// Order: watch.mu before epoll.mu (run looks a token up under epoll.mu and releases it
// before taking watch.mu).
//
// A socket whose accept or read fails with something other than "nothing there" is taken
// out of the set and put back after the back-off's delay; the callback is told each
// failure. A listener that is a Gate is asked before each accept; while it says no, the
// socket is out of the set and its connections wait in the kernel's backlog, until the
// gate wakes it. It is asked after each accept too, with the peer's address, whether to
// refuse the connection: a refused one goes to the gate's Hold before it costs a net.Conn,
// FileConn's dup and the syscalls around it, which is all a flood from a source past its
// budgets costs the poller per connection (accept4, and for its RST setsockopt and close).
//
// While sockets stay ready (a flood keeps a listener's backlog full) EpollWait never
// parks the loop, so it yields its P after each round: Go's scheduler would otherwise let
// it run, accepting and refusing, until the runtime's 10 ms time slice ends, while the
// goroutines serving the node's established connections wait behind it on that P.

// batch is how many connections or datagrams one socket gets per round.
const batch = 16

// epoll is the Poller New returns on Linux.
type epoll struct {
	file *os.File        // the epoll fd, registered with Go's netpoller
	rc   syscall.RawConn // file's
	done chan struct{}   // closed when run has returned

	mu      sync.Mutex
	watches map[uint64]*watch   // guarded by mu: by token
	onces   map[uint64]Readable // guarded by mu: WatchReadable's, by token
	next    uint64              // guarded by mu: the last token given out
}

var _ Poller = (*epoll)(nil)

// watch is one watched socket.
type watch struct {
	p      *epoll
	token  uint64
	rc     syscall.RawConn
	accept func(net.Conn, error)                           // for a listener
	gate   Gate                                            // the listener's, or nil
	read   func([]byte, netip.AddrPort, netip.Addr, error) // for a packet socket
	got    func([]byte, netip.AddrPort, netip.Addr)        // read for a datagram, made once

	mu      sync.Mutex
	stopped bool          // guarded by mu: stop has run
	failing bool          // guarded by mu: out of the set after an error, until retry
	gated   bool          // guarded by mu: out of the set until the gate wakes it (open)
	delay   time.Duration // guarded by mu: the next back-off
}

// New starts the node's poller: on Linux an epoll set and its one goroutine.
func New() (Poller, error) {
	fd, err := unix.EpollCreate1(unix.EPOLL_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("netpoll: epoll_create1: %w", err)
	}
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netpoll: set nonblocking: %w", err)
	}
	f := os.NewFile(uintptr(fd), "netpoll") // non-blocking: Go's netpoller watches it
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("netpoll: %w", err)
	}
	p := &epoll{file: f, rc: rc, done: make(chan struct{}), watches: map[uint64]*watch{}, onces: map[uint64]Readable{}}
	go p.run()
	return p, nil
}

// Close stops the poller's goroutine and releases the epoll set.
func (p *epoll) Close() error {
	p.file.Close()
	<-p.done
	return nil
}

// Parks is true: a watched socket costs an epoll entry, no goroutine.
func (p *epoll) Parks() bool { return true }

// Watch accepts on ln's socket itself (accept4), so ln must have SyscallConn and accept
// TCP connections (a *net.TCPListener, or a listener wrapping one); each connection has
// no keepalive, as a net.ListenConfig with KeepAlive -1 would accept it.
func (p *epoll) Watch(ln net.Listener, accepted func(net.Conn, error)) (stop func(), err error) {
	g, _ := ln.(Gate)
	return p.add(ln, &watch{accept: accepted, gate: g})
}

// WatchPacket reads on pc's socket itself (recvmsg), into one buffer shared by every
// packet socket.
func (p *epoll) WatchPacket(pc net.PacketConn, read func(b []byte, from netip.AddrPort, to netip.Addr, err error)) (stop func(), err error) {
	w := &watch{read: read}
	w.got = func(b []byte, from netip.AddrPort, to netip.Addr) { read(b, from, to, nil) }
	return p.add(pc, w)
}

// WatchReadable adds r's socket to the set one-shot (EPOLLIN|EPOLLRDHUP|EPOLLONESHOT);
// r.Ready runs on the poller's goroutine.
func (p *epoll) WatchReadable(r Readable) (uint64, error) {
	rc, err := r.SyscallConn()
	if err != nil {
		return 0, fmt.Errorf("netpoll: %w", err)
	}
	p.mu.Lock()
	p.next++
	token := p.next
	p.onces[token] = r // before the socket is in the set, so its first event finds it
	p.mu.Unlock()
	ev := unix.EpollEvent{Events: unix.EPOLLIN | unix.EPOLLRDHUP | unix.EPOLLONESHOT, Fd: int32(token), Pad: int32(token >> 32)}
	if err := p.ctlReadable(rc, unix.EPOLL_CTL_ADD, &ev); err != nil {
		p.takeReadable(token)
		return 0, fmt.Errorf("netpoll: watch readable: %w", err)
	}
	return token, nil
}

// CancelReadable takes the token's watch out, if its event has not.
func (p *epoll) CancelReadable(token uint64) bool {
	r := p.takeReadable(token)
	if r == nil {
		return false
	}
	p.leaveReadable(r)
	return true
}

// takeReadable removes the token's WatchReadable and returns it, or nil if its event or
// cancel took it first.
func (p *epoll) takeReadable(token uint64) Readable {
	p.mu.Lock()
	defer p.mu.Unlock()
	r := p.onces[token]
	if r != nil {
		delete(p.onces, token)
	}
	return r
}

// leaveReadable takes a taken WatchReadable's socket out of the set (a one-shot one that
// fired is still in it, disabled), so that it can be watched again. It fails harmlessly
// when the owner has closed the socket: it left the set then. The map keeps only r, so a
// parked socket costs the poller one map slot; the RawConn is had again here.
func (p *epoll) leaveReadable(r Readable) {
	if rc, err := r.SyscallConn(); err == nil {
		_ = p.ctlReadable(rc, unix.EPOLL_CTL_DEL, nil)
	}
}

// ctlReadable adds a WatchReadable socket to the set or takes it out, inside both fds'
// Control as ctl does.
func (p *epoll) ctlReadable(rc syscall.RawConn, op int, ev *unix.EpollEvent) error {
	var err error
	cerr := rc.Control(func(fd uintptr) {
		if perr := p.rc.Control(func(epfd uintptr) {
			err = unix.EpollCtl(int(epfd), op, int(fd), ev)
		}); perr != nil {
			err = perr
		}
	})
	if cerr != nil {
		return cerr
	}
	return err
}

func (p *epoll) add(sock any, w *watch) (func(), error) {
	sc, ok := sock.(syscall.Conn)
	if !ok {
		return nil, fmt.Errorf("netpoll: %T has no file descriptor", sock)
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("netpoll: %w", err)
	}
	w.p, w.rc = p, rc
	p.mu.Lock()
	p.next++
	w.token = p.next
	p.watches[w.token] = w // before the socket is in the set, so its first event finds it
	p.mu.Unlock()
	if err := w.ctl(unix.EPOLL_CTL_ADD); err != nil {
		p.forget(w.token)
		return nil, fmt.Errorf("netpoll: watch: %w", err)
	}
	return w.stop, nil
}

func (p *epoll) forget(token uint64) {
	p.mu.Lock()
	delete(p.watches, token)
	p.mu.Unlock()
}

// ctl adds the watch's socket to the epoll set, or takes it out, inside both fds' Control.
func (w *watch) ctl(op int) error {
	ev := unix.EpollEvent{Events: unix.EPOLLIN, Fd: int32(w.token), Pad: int32(w.token >> 32)}
	var err error
	cerr := w.rc.Control(func(fd uintptr) {
		if perr := w.p.rc.Control(func(epfd uintptr) {
			err = unix.EpollCtl(int(epfd), op, int(fd), &ev)
		}); perr != nil {
			err = perr
		}
	})
	if cerr != nil {
		return cerr
	}
	return err
}

// stop takes the socket out of the set and waits for a callback in progress to return.
func (w *watch) stop() {
	w.mu.Lock()
	if !w.stopped {
		w.stopped = true
		if !w.failing && !w.gated {
			// Fails harmlessly when the owner has closed the socket (it left the set then)
			// or the poller is closed.
			_ = w.ctl(unix.EPOLL_CTL_DEL)
		}
	}
	w.mu.Unlock()
	w.p.forget(w.token)
}

// run waits for events and serves each ready socket in turn, until Close.
func (p *epoll) run() {
	defer close(p.done)
	events := make([]unix.EpollEvent, 64)
	buf := make([]byte, maxDatagram)
	oob := make([]byte, sockopt.DstOOBSize)
	for {
		var n int
		err := p.rc.Read(func(epfd uintptr) bool {
			var werr error
			n, werr = unix.EpollWait(int(epfd), events, 0)
			if werr != nil { // EINTR: try again
				n = 0
				return true
			}
			return n > 0 // none ready: park until the set is readable
		})
		if err != nil {
			return // closed
		}
		for _, ev := range events[:n] {
			token := uint64(uint32(ev.Fd)) | uint64(uint32(ev.Pad))<<32
			p.mu.Lock()
			w := p.watches[token]
			p.mu.Unlock()
			if w != nil {
				w.serve(buf, oob)
				continue
			}
			if r := p.takeReadable(token); r != nil {
				p.leaveReadable(r)
				r.Ready()
			}
		}
		runtime.Gosched() // take turns with the goroutines the round made runnable
	}
}

// serve accepts or reads one batch, unless the watch has stopped.
func (w *watch) serve(buf, oob []byte) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped || w.failing || w.gated {
		return
	}
	var err error
	if w.accept != nil {
		err = w.acceptBatch()
	} else {
		err = w.readBatch(buf, oob)
	}
	if err == nil {
		w.delay = 0
		return
	}
	w.backOffLocked()
}

// acceptBatch accepts up to batch connections and hands them over. It returns the error of
// a failed accept4 (after telling the callback), nil when the queue is empty, the batch
// done or the gate closed.
func (w *watch) acceptBatch() error {
	var fds [batch]int
	n := 0
	var aerr error
	refused := false // by the gate
	cerr := w.rc.Control(func(fd uintptr) {
		for tries := 0; tries < batch; tries++ {
			if w.gate != nil && !w.gate.Room(w.open) {
				refused = true
				return
			}
			// Blocking, so that os.NewFile below does not register the fd with the
			// netpoller only for FileConn to register its dup.
			nfd, sa, err := unix.Accept4(int(fd), unix.SOCK_CLOEXEC)
			switch err {
			case nil:
				if w.gate != nil && w.gate.Refuses(sockopt.SockaddrAddrPort(sa)) {
					w.gate.Hold(func() { refuseFD(nfd) })
					continue
				}
				fds[n] = nfd
				n++
				if w.gate != nil {
					w.gate.Accepted()
				}
				continue
			case unix.EINTR, unix.ECONNABORTED:
				continue
			case unix.EAGAIN:
			default:
				aerr = os.NewSyscallError("accept4", err)
			}
			return
		}
	})
	if cerr != nil {
		return nil // the owner closed the listener; its stop follows
	}
	if refused {
		w.gateLocked() // open, which the gate calls, waits for mu: it cannot come first
	}
	for _, fd := range fds[:n] {
		c, err := fileConn(fd)
		w.accept(c, err)
	}
	if aerr != nil {
		w.accept(nil, aerr)
	}
	return aerr
}

// refuseFD closes an accepted socket the gate refused at the least cost: an RST
// (SO_LINGER 0) rather than a FIN, so no TIME_WAIT is kept for it, and no net.Conn made.
func refuseFD(fd int) {
	_ = unix.SetsockoptLinger(fd, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: 0})
	unix.Close(fd)
}

// fileConn makes an accepted socket a *net.TCPConn.
func fileConn(fd int) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "")
	c, err := net.FileConn(f) // a dup of fd, non-blocking and in the netpoller
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("netpoll: accepted socket: %w", err)
	}
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetKeepAlive(false) // FileConn turns Go's default on
	}
	return c, nil
}

// readBatch reads up to batch datagrams and hands each over.
func (w *watch) readBatch(buf, oob []byte) error {
	_, err := sockopt.ReadQueued(w.rc, buf, oob, batch, w.got)
	if err == nil {
		return nil // read them all
	}
	if se := (*os.SyscallError)(nil); !errors.As(err, &se) {
		return nil // the owner closed the socket
	}
	w.read(nil, netip.AddrPort{}, netip.Addr{}, err)
	return err
}

// backOffLocked takes the failing socket out of the set and puts it back after the next
// delay, so that a level-triggered error (EMFILE leaves the connection queued) does not spin.
func (w *watch) backOffLocked() {
	w.delay = nextDelay(w.delay)
	if err := w.ctl(unix.EPOLL_CTL_DEL); err != nil {
		return // closed under us: nothing to retry
	}
	w.failing = true
	time.AfterFunc(w.delay, w.retry)
}

// gateLocked takes a listener whose gate has no room out of the set until open.
func (w *watch) gateLocked() {
	if err := w.ctl(unix.EPOLL_CTL_DEL); err != nil {
		return // closed under us
	}
	w.gated = true
}

// open puts a listener its gate held back in the set again.
func (w *watch) open() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped || !w.gated {
		return
	}
	w.gated = false
	if err := w.ctl(unix.EPOLL_CTL_ADD); err != nil && !errors.Is(err, unix.EEXIST) {
		w.gated = true // closed: leave it out
	}
}

// retry puts a socket that failed back in the set.
func (w *watch) retry() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.stopped || !w.failing {
		return
	}
	w.failing = false
	if err := w.ctl(unix.EPOLL_CTL_ADD); err != nil && !errors.Is(err, unix.EEXIST) {
		w.failing = true // closed: leave it out
	}
}
