//go:build linux

package sockopt

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// ip6tSOOriginalDst is IP6T_SO_ORIGINAL_DST from linux/netfilter_ipv6/ip6_tables.h; it has
// the same value as SO_ORIGINAL_DST but lives at level SOL_IPV6.
const ip6tSOOriginalDst = 80

// OriginalDst returns the destination a connection had before iptables REDIRECT changed it:
// SO_ORIGINAL_DST (IPv4, also on a dual-stack socket) first, then IP6T_SO_ORIGINAL_DST.
// IPv4 results are plain IPv4 addresses, never v4-mapped. It fails when neither option
// answers (no conntrack entry, or not a redirected connection); the TPROXY fallback to the
// local address is the caller's choice.
func OriginalDst(c *net.TCPConn) (netip.AddrPort, error) {
	rc, err := c.SyscallConn()
	if err != nil {
		return netip.AddrPort{}, fmt.Errorf("sockopt: original destination: %w", err)
	}
	var ap netip.AddrPort
	var err4, err6 error
	cerr := rc.Control(func(fd uintptr) {
		if ap, err4 = getOriginalDst(int(fd), unix.SOL_IP, unix.SO_ORIGINAL_DST); err4 == nil {
			return
		}
		ap, err6 = getOriginalDst(int(fd), unix.SOL_IPV6, ip6tSOOriginalDst)
	})
	if cerr != nil {
		return netip.AddrPort{}, fmt.Errorf("sockopt: original destination: %w", cerr)
	}
	if err4 != nil && err6 != nil {
		return netip.AddrPort{}, fmt.Errorf("sockopt: original destination: SO_ORIGINAL_DST: %w; IP6T_SO_ORIGINAL_DST: %w", err4, err6)
	}
	return ap, nil
}

func getOriginalDst(fd, level, opt int) (netip.AddrPort, error) {
	var sa unix.RawSockaddrAny
	n := uint32(unsafe.Sizeof(sa))
	_, _, e := unix.Syscall6(unix.SYS_GETSOCKOPT, uintptr(fd), uintptr(level), uintptr(opt),
		uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&n)), 0)
	if e != 0 {
		return netip.AddrPort{}, e
	}
	switch sa.Addr.Family {
	case unix.AF_INET:
		if n < unix.SizeofSockaddrInet4 {
			break
		}
		sa4 := (*unix.RawSockaddrInet4)(unsafe.Pointer(&sa))
		return netip.AddrPortFrom(netip.AddrFrom4(sa4.Addr), ntohs(sa4.Port)), nil
	case unix.AF_INET6:
		if n < unix.SizeofSockaddrInet6 {
			break
		}
		sa6 := (*unix.RawSockaddrInet6)(unsafe.Pointer(&sa))
		return netip.AddrPortFrom(netip.AddrFrom16(sa6.Addr).Unmap(), ntohs(sa6.Port)), nil
	}
	return netip.AddrPort{}, fmt.Errorf("unexpected address family %d (%d bytes)", sa.Addr.Family, n)
}

// ntohs converts the network-order port of a raw sockaddr.
func ntohs(p uint16) uint16 {
	b := (*[2]byte)(unsafe.Pointer(&p))
	return uint16(b[0])<<8 | uint16(b[1])
}

// SetMark sets SO_MARK, which routing rules and iptables use to recognise ztunnel's own
// traffic. It needs CAP_NET_ADMIN.
func SetMark(c syscall.RawConn, mark uint32) error {
	return setInts(c, "SO_MARK", opt{unix.SOL_SOCKET, unix.SO_MARK, int(mark)})
}

// SetReusePort sets SO_REUSEPORT, which lets a second process bind the same address (the old
// and new ztunnel serving one pod during an upgrade). Call it before bind.
func SetReusePort(c syscall.RawConn) error {
	return setInts(c, "SO_REUSEPORT", opt{unix.SOL_SOCKET, unix.SO_REUSEPORT, 1})
}

// SetTransparent lets the socket bind to, and accept for, non-local addresses (TPROXY and
// spoofed-source dials): IP_TRANSPARENT and IP_FREEBIND, or their IPv6 forms when v6. It
// needs CAP_NET_ADMIN.
func SetTransparent(c syscall.RawConn, v6 bool) error {
	if v6 {
		return setInts(c, "IPV6_TRANSPARENT",
			opt{unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1}, opt{unix.SOL_IPV6, unix.IPV6_FREEBIND, 1})
	}
	return setInts(c, "IP_TRANSPARENT",
		opt{unix.SOL_IP, unix.IP_TRANSPARENT, 1}, opt{unix.SOL_IP, unix.IP_FREEBIND, 1})
}

// Control returns a net.Dialer / net.ListenConfig Control function that sets SO_MARK to mark
// before connect or bind; mark 0 sets nothing.
func Control(mark uint32) func(network, address string, c syscall.RawConn) error {
	return func(_, _ string, c syscall.RawConn) error {
		if mark == 0 {
			return nil
		}
		return SetMark(c, mark)
	}
}

type opt struct{ level, name, value int }

func setInts(c syscall.RawConn, what string, opts ...opt) error {
	var serr error
	err := c.Control(func(fd uintptr) {
		for _, o := range opts {
			if serr = unix.SetsockoptInt(int(fd), o.level, o.name, o.value); serr != nil {
				return
			}
		}
	})
	if err = errors.Join(err, serr); err != nil {
		return fmt.Errorf("sockopt: set %s: %w", what, err)
	}
	return nil
}

// SetUserTimeout sets TCP_USER_TIMEOUT, how long sent data may stay unacknowledged before
// the connection is dropped; ztunnel uses keepalive time + retries*interval when
// USER_TIMEOUT_ENABLED is set. Zero restores the system default.
func SetUserTimeout(c *net.TCPConn, d time.Duration) error {
	rc, err := c.SyscallConn()
	if err != nil {
		return fmt.Errorf("sockopt: set TCP_USER_TIMEOUT: %w", err)
	}
	return setInts(rc, "TCP_USER_TIMEOUT", opt{unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT, int(d.Milliseconds())})
}

// SetRecvDst has a UDP socket report each datagram's destination address in a control
// message for ParseDst: IP_PKTINFO, or IPV6_RECVPKTINFO on an IPv6 socket (which reports a
// dual-stack socket's IPv4 datagrams with a v4-mapped address). A socket bound to a
// wildcard needs it to answer from the address a client sent to: the client's resolver
// drops an answer from any other.
func SetRecvDst(c syscall.RawConn) error {
	var domain int
	var gerr error
	if err := errors.Join(c.Control(func(fd uintptr) {
		domain, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_DOMAIN)
	}), gerr); err != nil {
		return fmt.Errorf("sockopt: get SO_DOMAIN: %w", err)
	}
	if domain == unix.AF_INET6 {
		return setInts(c, "IPV6_RECVPKTINFO", opt{unix.IPPROTO_IPV6, unix.IPV6_RECVPKTINFO, 1})
	}
	return setInts(c, "IP_PKTINFO", opt{unix.IPPROTO_IP, unix.IP_PKTINFO, 1})
}

// DstOOBSize is how large an out-of-band buffer must be for SetRecvDst's control message.
var DstOOBSize = unix.CmsgSpace(unix.SizeofInet6Pktinfo)

// ParseDst returns the destination address in a datagram's control messages (oob as
// recvmsg filled it), or the zero Addr when they hold none.
func ParseDst(oob []byte) netip.Addr {
	// ParseOneSocketControlMessage reads a whole header without checking that b holds one.
	for len(oob) >= unix.CmsgLen(0) {
		h, data, rest, err := unix.ParseOneSocketControlMessage(oob)
		if err != nil {
			break
		}
		switch {
		case h.Level == unix.IPPROTO_IP && h.Type == unix.IP_PKTINFO && len(data) >= unix.SizeofInet4Pktinfo:
			return netip.AddrFrom4([4]byte(data[8:12])) // in_pktinfo's ipi_addr, after ifindex and spec_dst
		case h.Level == unix.IPPROTO_IPV6 && h.Type == unix.IPV6_PKTINFO && len(data) >= unix.SizeofInet6Pktinfo:
			return netip.AddrFrom16([16]byte(data[:16])) // in6_pktinfo's ipi6_addr
		}
		oob = rest
	}
	return netip.Addr{}
}

// SrcOOB returns the control message that has sendmsg send from src, or nil for the zero
// Addr: IP_PKTINFO for an IPv4 address, IPV6_PKTINFO for any other (a v4-mapped one, as
// ParseDst reports on a dual-stack socket, included). The interface is the kernel's choice.
func SrcOOB(src netip.Addr) []byte {
	switch {
	case src.Is4():
		return unix.PktInfo4(&unix.Inet4Pktinfo{Spec_dst: src.As4()})
	case src.Is6():
		return unix.PktInfo6(&unix.Inet6Pktinfo{Addr: src.As16()})
	}
	return nil
}

// StopDelivery has the kernel give each UDP socket no new datagram, while it stays open to
// read what it has queued and to answer it: a socket draining out of an SO_REUSEPORT
// group, whose other sockets then get every new datagram. A UDP socket leaves its group
// only by closing, which drops its queue and the address its answers must come from;
// connect(2) serves instead. The kernel's reuseport selection skips connected sockets
// (Linux 5.4 and later), and a connected socket takes only datagrams from its peer, here
// the socket's own address, which no one sends from (a socket bound to a wildcard is
// connected to the loopback address of its family, which also moves it out of its group).
// Sending with an explicit destination still works (Go does not know the socket is
// connected). StopDelivery then waits for an RCU grace period (gracePeriod), within which
// the kernel finishes queueing any datagram it matched to a socket before its connect:
// once StopDelivery returns, what a socket has queued is all it will get.
func StopDelivery(ucs ...*net.UDPConn) error {
	var errs []error
	for _, uc := range ucs {
		rc, err := uc.SyscallConn()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		self := uc.LocalAddr().(*net.UDPAddr).AddrPort()
		var serr error
		if err := rc.Control(func(fd uintptr) {
			serr = unix.Connect(int(fd), sockaddr(self))
		}); err != nil {
			serr = err
		}
		if serr != nil {
			errs = append(errs, fmt.Errorf("sockopt: stop delivery to %s: connect: %w", self, serr))
		}
	}
	gracePeriod()
	return errors.Join(errs...)
}

// membarrierCmdGlobal is MEMBARRIER_CMD_GLOBAL from linux/membarrier.h: membarrier(2) returns
// after an RCU grace period (synchronize_rcu).
const membarrierCmdGlobal = 1

// grace is gracePeriod's state.
var grace struct {
	mu      sync.Mutex
	running bool            // guarded by mu: waitGracePeriods runs
	waiters []chan struct{} // guarded by mu: callers waiting for a grace period to begin
}

// gracePeriod returns after an RCU grace period has passed, in which the kernel finishes
// receiving every datagram it matched to a socket before: membarrier(2), which blocks its
// thread for milliseconds. Callers that come while one is being waited for share the next,
// so that a node draining a few hundred pods at once blocks one thread, not one per pod.
// Where membarrier is refused (nohz_full kernels, a seccomp profile) it returns at once: a
// datagram the kernel was queueing as the connect ran may then arrive microseconds later.
func gracePeriod() {
	done := make(chan struct{})
	grace.mu.Lock()
	grace.waiters = append(grace.waiters, done)
	if !grace.running {
		grace.running = true
		go waitGracePeriods()
	}
	grace.mu.Unlock()
	<-done
}

// waitGracePeriods waits for grace periods for gracePeriod's callers, each batch of them
// for one that begins after they came, until none is waiting.
func waitGracePeriods() {
	for {
		grace.mu.Lock()
		waiters := grace.waiters
		grace.waiters = nil
		if len(waiters) == 0 {
			grace.running = false
			grace.mu.Unlock()
			return
		}
		grace.mu.Unlock()
		unix.Syscall(unix.SYS_MEMBARRIER, membarrierCmdGlobal, 0, 0)
		for _, w := range waiters {
			close(w)
		}
	}
}

// sockaddr is ap as a connect(2) address of its family; a v4-mapped address stays IPv6, as
// an IPv6 socket needs it.
func sockaddr(ap netip.AddrPort) unix.Sockaddr {
	if ap.Addr().Is4() {
		return &unix.SockaddrInet4{Port: int(ap.Port()), Addr: ap.Addr().As4()}
	}
	return &unix.SockaddrInet6{Port: int(ap.Port()), Addr: ap.Addr().As16()}
}

// ReadQueued reads up to max datagrams queued on a UDP socket, without waiting, and hands
// each to read with its sender and the address it was sent to (when the socket reports it:
// SetRecvDst; else the zero Addr); b is valid only during the call. It returns how many it
// read and nil once the queue is empty or max were read, or the failed recvmsg's error (an
// *os.SyscallError), or rc's own error when the socket is closed.
func ReadQueued(rc syscall.RawConn, buf, oob []byte, max int, read func(b []byte, from netip.AddrPort, to netip.Addr)) (int, error) {
	var r struct { // one allocation for what the closure sets, beside the closure's own
		n   int
		err error
	}
	cerr := rc.Control(func(fd uintptr) {
		for r.n < max {
			m, oobn, _, from, err := unix.Recvmsg(int(fd), buf, oob, unix.MSG_DONTWAIT)
			switch err {
			case nil:
				r.n++
				read(buf[:m], SockaddrAddrPort(from), ParseDst(oob[:oobn]))
				continue
			case unix.EINTR:
				continue
			case unix.EAGAIN:
			default:
				r.err = os.NewSyscallError("recvmsg", err)
			}
			return
		}
	})
	if cerr != nil {
		return r.n, cerr
	}
	return r.n, r.err
}

// SockaddrAddrPort is a socket address from the kernel (recvmsg, accept4) as a
// netip.AddrPort, its IPv6 form kept (an IPv4-mapped address is not unmapped); invalid if
// not IP.
func SockaddrAddrPort(sa unix.Sockaddr) netip.AddrPort {
	switch sa := sa.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(sa.Addr), uint16(sa.Port))
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(sa.Addr), uint16(sa.Port))
	}
	return netip.AddrPort{}
}
