//go:build linux

package netns

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gozt/gozt/internal/sockopt"
)

// nsGetNSType is NS_GET_NSTYPE, _IO(0xb7, 0x3) from linux/nsfs.h (Linux 4.11); x/sys does
// not define it.
const nsGetNSType = 0xb703

func openFD(path string) (int, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("netns: open %s: %w", path, err)
	}
	return fd, nil
}

func closeFD(fd int) error { return unix.Close(fd) }

// check reports fd's ID if fd is a network namespace. Kernels before 4.11 lack
// NS_GET_NSTYPE; there any nsfs file passes.
func check(fd int) (ID, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return ID{}, fmt.Errorf("netns: fstat: %w", err)
	}
	typ, err := unix.IoctlRetInt(fd, nsGetNSType)
	switch {
	case err == nil && typ != unix.CLONE_NEWNET:
		return ID{}, fmt.Errorf("netns: fd is a namespace of type %#x, not a network namespace", typ)
	case err != nil:
		var fs unix.Statfs_t
		if serr := unix.Fstatfs(fd, &fs); serr != nil || fs.Type != unix.NSFS_MAGIC {
			return ID{}, fmt.Errorf("netns: fd is not a network namespace (NS_GET_NSTYPE: %w)", err)
		}
	}
	return ID{Dev: st.Dev, Ino: st.Ino}, nil
}

func (n *NetNS) do(fn func() error) error {
	return onThread(func() error {
		n.mu.RLock()
		defer n.mu.RUnlock()
		if n.fd < 0 {
			return ErrClosed
		}
		if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
			return fmt.Errorf("netns: setns %s: %w", n.id, err)
		}
		return nil
	}, fn)
}

// onThread runs enter and then fn on a fresh goroutine locked to its OS thread, then moves the
// thread back to the network namespace it started in. enter either moves the thread into
// another namespace or fails leaving it where it was. A thread that cannot be moved back stays
// locked, and the runtime discards it when the goroutine exits, so no other goroutine ever runs
// in the wrong namespace.
func onThread(enter, fn func() error) error {
	errc := make(chan error, 1)
	go func() { // owned by onThread, which waits for its one result
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("netns: open own namespace: %w", err)
			return
		}
		// orig is closed before the result is sent, so that no fd outlives the call.
		if err := enter(); err != nil {
			unix.Close(orig)
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		ferr := fn()
		err = unix.Setns(orig, unix.CLONE_NEWNET)
		unix.Close(orig)
		if err != nil {
			errc <- errors.Join(ferr, fmt.Errorf("netns: return to own namespace: %w", err))
			return // still locked: the thread dies with this goroutine
		}
		runtime.UnlockOSThread()
		errc <- ferr
	}()
	return <-errc
}

func (s Sockets) listen(ctx context.Context, network, address string) (net.Listener, error) {
	lc := net.ListenConfig{Control: s.listenControl, KeepAlive: -1}
	var ln net.Listener
	err := s.do(func() (err error) {
		ln, err = lc.Listen(ctx, network, address)
		return err
	})
	return ln, err
}

func (s Sockets) listenPacket(ctx context.Context, network, address string) (net.PacketConn, error) {
	lc := net.ListenConfig{Control: s.listenControl}
	var pc net.PacketConn
	err := s.do(func() (err error) {
		pc, err = lc.ListenPacket(ctx, network, address)
		return err
	})
	return pc, err
}

func (s Sockets) dial(ctx context.Context, d *net.Dialer, network, address string) (net.Conn, error) {
	var dd net.Dialer
	if d != nil {
		dd = *d
	}
	if s.NS == nil {
		control, controlCtx := dd.Control, dd.ControlContext
		dd.Control = nil
		dd.ControlContext = func(ctx context.Context, network, address string, c syscall.RawConn) error {
			return s.dialControl(ctx, &net.Dialer{Control: control, ControlContext: controlCtx}, network, address, c)
		}
		return dd.DialContext(ctx, network, address)
	}
	ap, err := netip.ParseAddrPort(address)
	if err != nil {
		return nil, fmt.Errorf("netns: dial %s: want an IP address and port: %w", address, err)
	}
	if network != "tcp" && network != "tcp4" && network != "tcp6" {
		return nil, fmt.Errorf("netns: dial %s %s: only TCP", network, address)
	}
	c, err := s.dialInside(ctx, &dd, network, ap)
	if err != nil {
		return nil, &net.OpError{Op: "dial", Net: network, Addr: net.TCPAddrFromAddrPort(ap), Err: err}
	}
	return c, nil
}

// dialControl marks the socket, then runs d's own control function, if any.
func (s Sockets) dialControl(ctx context.Context, d *net.Dialer, network, address string, c syscall.RawConn) error {
	if s.Mark != 0 {
		if err := sockopt.SetMark(c, s.Mark); err != nil {
			return err
		}
	}
	switch {
	case d.ControlContext != nil:
		return d.ControlContext(ctx, network, address, c)
	case d.Control != nil:
		return d.Control(network, address, c)
	}
	return nil
}

// dialInside makes a non-blocking TCP socket inside the namespace, applies d's options, and
// connects it to dst, waiting on the poller within d's timeout and ctx.
func (s Sockets) dialInside(ctx context.Context, d *net.Dialer, network string, dst netip.AddrPort) (net.Conn, error) {
	dst = netip.AddrPortFrom(dst.Addr().Unmap(), dst.Port())
	family := unix.AF_INET6
	if dst.Addr().Is4() {
		family = unix.AF_INET
	}
	fd := -1
	if err := s.NS.Do(func() (err error) {
		fd, err = unix.Socket(family, unix.SOCK_STREAM|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.IPPROTO_TCP)
		return err
	}); err != nil {
		return nil, fmt.Errorf("socket: %w", err)
	}
	f := os.NewFile(uintptr(fd), "netns-dial") // non-blocking: registered with the poller
	defer f.Close()                            // net.FileConn keeps a dup of its own
	rc, err := f.SyscallConn()
	if err != nil {
		return nil, err
	}
	if err := s.dialControl(ctx, d, network, dst.String(), rc); err != nil {
		return nil, err
	}
	var serr error
	if err := rc.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_TCP, unix.TCP_NODELAY, 1) // as net.Dial does
		if serr == nil && d.LocalAddr != nil {
			if la, ok := d.LocalAddr.(*net.TCPAddr); ok {
				ap := la.AddrPort()
				serr = unix.Bind(int(fd), sockaddr(netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())))
			}
		}
		if serr == nil {
			serr = unix.Connect(int(fd), sockaddr(dst))
		}
	}); err != nil {
		return nil, err
	}
	if serr != nil && serr != unix.EINPROGRESS {
		return nil, serr
	}
	if serr == unix.EINPROGRESS {
		if err := waitConnected(ctx, d, f, rc); err != nil {
			return nil, err
		}
	}
	c, err := net.FileConn(f)
	if err != nil {
		return nil, err
	}
	if d.KeepAlive >= 0 {
		if tc, ok := c.(*net.TCPConn); ok {
			tc.SetKeepAlive(true) // net.Dialer's default; the proxy sets its own period
		}
	}
	return c, nil
}

// waitConnected waits until the connect in progress on f ends, within d.Timeout and ctx,
// and returns its result.
func waitConnected(ctx context.Context, d *net.Dialer, f *os.File, rc syscall.RawConn) error {
	deadline, _ := ctx.Deadline()
	if d.Timeout > 0 {
		if t := time.Now().Add(d.Timeout); deadline.IsZero() || t.Before(deadline) {
			deadline = t
		}
	}
	if !d.Deadline.IsZero() && (deadline.IsZero() || d.Deadline.Before(deadline)) {
		deadline = d.Deadline
	}
	if !deadline.IsZero() {
		f.SetWriteDeadline(deadline)
	}
	stop := context.AfterFunc(ctx, func() { f.SetWriteDeadline(time.Unix(1, 0)) })
	defer stop()
	var serr error
	err := rc.Write(func(fd uintptr) bool {
		var v int
		v, serr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_ERROR)
		if serr == nil && v != 0 {
			serr = unix.Errno(v)
		}
		// Not writable yet: the poller calls again once it is (or the deadline passes).
		if serr == nil {
			_, perr := unix.Getpeername(int(fd))
			return perr == nil
		}
		return true
	})
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if err != nil {
		return err
	}
	return serr
}

func sockaddr(ap netip.AddrPort) unix.Sockaddr {
	if ap.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}

func (s Sockets) listenControl(network, _ string, c syscall.RawConn) error {
	if s.Mark != 0 {
		if err := sockopt.SetMark(c, s.Mark); err != nil {
			return err
		}
	}
	if s.Transparent {
		// One flag serves both families: IPV6_TRANSPARENT on a dual-stack [::] socket
		// covers its IPv4 connections too.
		if err := sockopt.SetTransparent(c, strings.HasSuffix(network, "6")); err != nil {
			return err
		}
	}
	if s.ReusePort {
		return sockopt.SetReusePort(c)
	}
	return nil
}

// do runs fn inside the namespace, or right here when there is none.
func (s Sockets) do(fn func() error) error {
	if s.NS == nil {
		return fn()
	}
	return s.NS.Do(fn)
}

func checkCapabilities() error {
	errc := make(chan error, 1)
	go func() { // owned by checkCapabilities, which waits for its result
		runtime.LockOSThread()
		defer runtime.UnlockOSThread() // checkThread leaves the thread as it found it
		errc <- checkThread()
	}()
	return <-errc
}

// checkThread runs the checks on the calling (locked) thread: setns into the namespace it is
// already in, and SO_MARK on a fresh socket.
func checkThread() error {
	var errs []error
	if fd, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0); err != nil {
		errs = append(errs, fmt.Errorf("netns: open own namespace: %w", err))
	} else {
		if err := unix.Setns(fd, unix.CLONE_NEWNET); err != nil {
			errs = append(errs, fmt.Errorf("netns: setns: %w (needs CAP_SYS_ADMIN)", err))
		}
		unix.Close(fd)
	}
	if s, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0); err != nil {
		errs = append(errs, fmt.Errorf("netns: socket: %w", err))
	} else {
		if err := unix.SetsockoptInt(s, unix.SOL_SOCKET, unix.SO_MARK, 1); err != nil {
			errs = append(errs, fmt.Errorf("netns: set SO_MARK: %w (needs CAP_NET_ADMIN, or CAP_NET_RAW on Linux 5.17+)", err))
		}
		unix.Close(s)
	}
	return errors.Join(errs...)
}
