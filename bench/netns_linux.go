//go:build linux

package bench

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// NetnsDialer opens sockets from inside a network namespace. A socket belongs for life to the
// namespace of the thread that created it, so the dialer keeps one goroutine on an OS thread
// switched into the namespace once and for good. That thread keeps unconnected IPv4 TCP
// sockets ready, made in batches, and DialContext connects one from the caller's own
// goroutine: switching a thread per dial would cost a thread and two setns(2) calls per
// connection, and even handing each dial to the namespace thread halves connrate's
// connections per second on loopback (two thread wake-ups per dial); this way costs about a
// tenth (a few more system calls per dial). The connections and listeners it returns are
// ordinary and may be used from any goroutine.
type NetnsDialer struct {
	name  string
	socks chan nsSocket // ready IPv4 TCP sockets, made in the namespace
	low   chan struct{} // tells the thread that socks is running low
	calls chan func()   // work that must run in the namespace (listen, other dials)
	quit  chan struct{}
	wg    sync.WaitGroup
	once  sync.Once
}

// nsSocket is a non-blocking socket made in the namespace, or why none could be made.
type nsSocket struct {
	fd  int
	err error
}

// NewNetnsDialer starts a dialer in the namespace name: a name under /var/run/netns (as
// `ip netns add` makes) or a path such as /proc/PID/ns/net.
func NewNetnsDialer(name string) (*NetnsDialer, error) {
	file := name
	if !strings.Contains(name, "/") {
		file = "/var/run/netns/" + name
	}
	fd, err := unix.Open(file, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("bench: netns %s: %w", name, err)
	}
	defer unix.Close(fd) // once the thread has switched: it reports before serving
	d := &NetnsDialer{name: name, socks: make(chan nsSocket, 64), low: make(chan struct{}, 1), calls: make(chan func()), quit: make(chan struct{})}
	errc := make(chan error, 1)
	d.wg.Add(1)
	go d.serve(fd, errc)
	if err := <-errc; err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// serve makes sockets and runs calls on a thread switched into the namespace. It never
// unlocks the thread, so when serve returns the runtime ends the thread rather than reuse it
// in the wrong namespace.
func (d *NetnsDialer) serve(nsfd int, errc chan<- error) {
	defer d.wg.Done()
	runtime.LockOSThread()
	if err := unix.Setns(nsfd, unix.CLONE_NEWNET); err != nil {
		errc <- fmt.Errorf("bench: setns %s: %w", d.name, err)
		return
	}
	errc <- nil
	d.fill()
	for {
		select {
		case <-d.low:
			d.fill()
		case fn := <-d.calls:
			fn()
		case <-d.quit:
			return
		}
	}
}

// fill tops up the ready sockets in one go, so that the thread wakes once per many dials
// rather than once per dial. A socket that cannot be made is passed on as its error.
func (d *NetnsDialer) fill() {
	for len(d.socks) < cap(d.socks) {
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, 0)
		d.socks <- nsSocket{fd: fd, err: err} // only this thread sends, so there is room
		if err != nil {
			return
		}
	}
}

var errDialerClosed = errors.New("bench: netns dialer closed")

// do runs fn on the namespace's thread and waits for it.
func (d *NetnsDialer) do(ctx context.Context, fn func()) error {
	done := make(chan struct{})
	select {
	case d.calls <- func() { fn(); close(done) }:
	case <-ctx.Done():
		return ctx.Err()
	case <-d.quit:
		return errDialerClosed
	}
	<-done
	return nil
}

// DialContext connects from inside the namespace to an IP address and port; it fits
// Target.DialContext. An IPv4 address is connected on a socket the namespace thread made
// ahead; IPv6 is dialed on the namespace thread itself, slower. Names are refused: their
// lookup, and the dual-stack race that may follow, would run outside the namespace.
func (d *NetnsDialer) DialContext(ctx context.Context, network, addr string) (net.Conn, error) {
	ap, err := netip.ParseAddrPort(addr)
	if err != nil {
		return nil, fmt.Errorf("bench: netns dial %s: want an IP address and port: %w", addr, err)
	}
	if !ap.Addr().Unmap().Is4() || (network != "tcp" && network != "tcp4") {
		var c net.Conn
		if derr := d.do(ctx, func() {
			var nd net.Dialer
			c, err = nd.DialContext(ctx, network, addr)
		}); derr != nil {
			return nil, derr
		}
		return c, err
	}
	var s nsSocket
	select {
	case s = <-d.socks:
		if len(d.socks) < cap(d.socks)/2 {
			select {
			case d.low <- struct{}{}:
			default: // already told
			}
		}
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-d.quit:
		return nil, errDialerClosed
	}
	if s.err != nil {
		return nil, fmt.Errorf("bench: socket in %s: %w", d.name, s.err)
	}
	c, err := connect(ctx, s.fd, &unix.SockaddrInet4{Addr: ap.Addr().Unmap().As4(), Port: int(ap.Port())})
	if err != nil {
		return nil, &net.OpError{Op: "dial", Net: network, Addr: net.TCPAddrFromAddrPort(ap), Err: err}
	}
	return c, nil
}

// connect connects the non-blocking socket fd, which it takes over, to sa, waiting in the
// runtime's poller as net.Dialer does.
func connect(ctx context.Context, fd int, sa unix.Sockaddr) (net.Conn, error) {
	f := os.NewFile(uintptr(fd), "netns-socket") // non-blocking: served by the poller
	defer f.Close()                              // net.FileConn keeps a duplicate
	if deadline, ok := ctx.Deadline(); ok {
		f.SetWriteDeadline(deadline)
	}
	stop := context.AfterFunc(ctx, func() { f.SetWriteDeadline(time.Unix(1, 0)) })
	defer stop()
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	started := false
	var cerr error
	err = rc.Write(func(fd uintptr) bool {
		if !started {
			started = true
			switch err := unix.Connect(int(fd), sa); err {
			case nil:
				return true
			case unix.EINPROGRESS, unix.EALREADY, unix.EINTR:
				return false // wait until writable
			default:
				cerr = err
				return true
			}
		}
		v, err := unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		if err != nil {
			cerr = err
			return true
		}
		switch e := unix.Errno(v); e {
		case unix.EINPROGRESS, unix.EALREADY, unix.EINTR:
			return false
		case 0:
			// Writable with no error can be a spurious wake-up; connected means a peer.
			if _, err := unix.Getpeername(int(fd)); err == unix.ENOTCONN {
				return false
			}
			return true
		default:
			cerr = e
			return true
		}
	})
	if err == nil {
		err = cerr
	}
	if err != nil {
		if ctx.Err() != nil {
			err = ctx.Err()
		}
		return nil, err
	}
	f.SetWriteDeadline(time.Time{})
	return net.FileConn(f)
}

// Listen opens a listener inside the namespace.
func (d *NetnsDialer) Listen(network, addr string) (net.Listener, error) {
	var ln net.Listener
	var err error
	if derr := d.do(context.Background(), func() { ln, err = net.Listen(network, addr) }); derr != nil {
		return nil, derr
	}
	return ln, err
}

// Close ends the namespace thread (a call in progress finishes first), waits for it and
// closes the sockets it made ahead. Connections and listeners already returned stay open.
// It is safe to call more than once.
func (d *NetnsDialer) Close() error {
	d.once.Do(func() { close(d.quit) })
	d.wg.Wait()
	for {
		select {
		case s := <-d.socks:
			if s.fd >= 0 {
				unix.Close(s.fd)
			}
		default:
			return nil
		}
	}
}
