//go:build linux

package sockopt

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/sys/unix"
)

func getInt(t *testing.T, rc syscall.RawConn, level, name int) int {
	t.Helper()
	var v int
	var gerr error
	if err := rc.Control(func(fd uintptr) { v, gerr = unix.GetsockoptInt(int(fd), level, name) }); err != nil {
		t.Fatal(err)
	}
	if gerr != nil {
		t.Fatalf("getsockopt(%d, %d): %v", level, name, gerr)
	}
	return v
}

func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root (CAP_NET_ADMIN) for SO_MARK / IP_TRANSPARENT / network namespaces")
	}
}

func loopbackPair(t *testing.T, network, addr string) (client, server *net.TCPConn) {
	t.Helper()
	ln, err := net.Listen(network, addr)
	if err != nil {
		t.Skipf("no %s loopback: %v", network, err)
	}
	defer ln.Close()
	c, err := net.Dial(network, ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	s, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return c.(*net.TCPConn), s.(*net.TCPConn)
}

func TestSetMark(t *testing.T) {
	requireRoot(t)
	_, s := loopbackPair(t, "tcp4", "127.0.0.1:0")
	rc, _ := s.SyscallConn()
	if got := getInt(t, rc, unix.SOL_SOCKET, unix.SO_MARK); got != 0 {
		t.Fatalf("fresh socket has mark %#x", got)
	}
	if err := SetMark(rc, 0x539); err != nil {
		t.Fatal(err)
	}
	if got := getInt(t, rc, unix.SOL_SOCKET, unix.SO_MARK); got != 0x539 {
		t.Errorf("SO_MARK = %#x; want 0x539", got)
	}
}

// Two listeners can bind one port once both set SO_REUSEPORT (no privilege needed).
func TestSetReusePort(t *testing.T) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error { return SetReusePort(c) }}
	a, err := lc.Listen(t.Context(), "tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	b, err := lc.Listen(t.Context(), "tcp4", a.Addr().String())
	if err != nil {
		t.Fatalf("second listener on %s: %v", a.Addr(), err)
	}
	b.Close()
	if c, err := net.Listen("tcp4", a.Addr().String()); err == nil {
		c.Close()
		t.Fatal("a listener without SO_REUSEPORT bound the same port")
	}
}

func TestControlDialer(t *testing.T) {
	requireRoot(t)
	leaktest.Check(t)
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	for _, mark := range []uint32{0, 1337} {
		d := net.Dialer{Control: Control(mark)}
		c, err := d.Dial("tcp4", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		rc, _ := c.(*net.TCPConn).SyscallConn()
		if got := getInt(t, rc, unix.SOL_SOCKET, unix.SO_MARK); got != int(mark) {
			t.Errorf("dialed with Control(%d): SO_MARK = %d", mark, got)
		}
		c.Close()
		if s, err := ln.Accept(); err == nil {
			s.Close()
		}
	}
}

func TestSetTransparent(t *testing.T) {
	requireRoot(t)
	for _, tc := range []struct {
		network, addr string
		v6            bool
		level, tp, fb int
	}{
		{"tcp4", "127.0.0.1:0", false, unix.SOL_IP, unix.IP_TRANSPARENT, unix.IP_FREEBIND},
		{"tcp6", "[::1]:0", true, unix.SOL_IPV6, unix.IPV6_TRANSPARENT, unix.IPV6_FREEBIND},
	} {
		t.Run(tc.network, func(t *testing.T) {
			_, s := loopbackPair(t, tc.network, tc.addr)
			rc, _ := s.SyscallConn()
			if got := getInt(t, rc, tc.level, tc.tp); got != 0 {
				t.Fatalf("fresh socket transparent = %d", got)
			}
			if err := SetTransparent(rc, tc.v6); err != nil {
				t.Fatal(err)
			}
			if got := getInt(t, rc, tc.level, tc.tp); got != 1 {
				t.Errorf("transparent = %d; want 1", got)
			}
			if got := getInt(t, rc, tc.level, tc.fb); got != 1 {
				t.Errorf("freebind = %d; want 1", got)
			}
		})
	}
}

func TestSetKeepalive(t *testing.T) {
	_, s := loopbackPair(t, "tcp4", "127.0.0.1:0")
	if err := SetKeepalive(s, 180*time.Second, 75*time.Second, 9); err != nil {
		t.Fatal(err)
	}
	rc, _ := s.SyscallConn()
	for _, c := range []struct {
		name       string
		level, opt int
		want       int
	}{
		{"SO_KEEPALIVE", unix.SOL_SOCKET, unix.SO_KEEPALIVE, 1},
		{"TCP_KEEPIDLE", unix.IPPROTO_TCP, unix.TCP_KEEPIDLE, 180},
		{"TCP_KEEPINTVL", unix.IPPROTO_TCP, unix.TCP_KEEPINTVL, 75},
		{"TCP_KEEPCNT", unix.IPPROTO_TCP, unix.TCP_KEEPCNT, 9},
	} {
		if got := getInt(t, rc, c.level, c.opt); got != c.want {
			t.Errorf("%s = %d; want %d", c.name, got, c.want)
		}
	}
}

func TestSetUserTimeout(t *testing.T) {
	_, s := loopbackPair(t, "tcp4", "127.0.0.1:0")
	rc, _ := s.SyscallConn()
	if err := SetUserTimeout(s, 1800*time.Second); err != nil {
		t.Fatal(err)
	}
	if got := getInt(t, rc, unix.IPPROTO_TCP, unix.TCP_USER_TIMEOUT); got != 1800000 {
		t.Errorf("TCP_USER_TIMEOUT = %d ms; want 1800000", got)
	}
}

func TestRaiseFileLimit(t *testing.T) {
	var orig unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &orig); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Setrlimit(unix.RLIMIT_NOFILE, &orig) })
	if orig.Max <= 64 {
		t.Skipf("hard RLIMIT_NOFILE %d too low to test", orig.Max)
	}
	// Lower the soft limit so that raising it is observable.
	low := unix.Rlimit{Cur: 64, Max: orig.Max}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	got, err := RaiseFileLimit()
	if err != nil {
		t.Fatal(err)
	}
	var now unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &now); err != nil {
		t.Fatal(err)
	}
	if got != orig.Max || now.Cur != orig.Max {
		t.Errorf("RaiseFileLimit = %d, soft limit now %d; want both %d (hard)", got, now.Cur, orig.Max)
	}
	if again, err := RaiseFileLimit(); err != nil || again != orig.Max {
		t.Errorf("second RaiseFileLimit = %d, %v; want %d, nil", again, err, orig.Max)
	}
}

func TestOriginalDstNotRedirected(t *testing.T) {
	_, s := loopbackPair(t, "tcp4", "127.0.0.1:0")
	s.Close()
	if ap, err := OriginalDst(s); err == nil {
		t.Errorf("OriginalDst on a closed conn = %v, nil; want an error", ap)
	}
}

// netns is a throwaway network namespace made with ip(8).
type netns struct {
	name string
	fd   int
}

func newNetns(t *testing.T) *netns {
	t.Helper()
	requireRoot(t)
	for _, tool := range []string{"ip", "iptables"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("%s not installed (apt-get install -y iproute2 iptables): %v", tool, err)
		}
	}
	n := &netns{name: fmt.Sprintf("gozt-sockopt-%d", os.Getpid())}
	if out, err := exec.Command("ip", "netns", "add", n.name).CombinedOutput(); err != nil {
		t.Skipf("cannot create a network namespace: %v: %s", err, out)
	}
	t.Cleanup(func() { exec.Command("ip", "netns", "del", n.name).Run() })
	n.run(t, "ip", "link", "set", "lo", "up")
	fd, err := unix.Open("/var/run/netns/"+n.name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	n.fd = fd
	return n
}

// run runs a command inside the namespace.
func (n *netns) run(t *testing.T, args ...string) error {
	t.Helper()
	out, err := exec.Command("ip", append([]string{"netns", "exec", n.name}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s: %w: %s", strings.Join(args, " "), err, out)
	}
	return nil
}

// do runs f on a thread switched into the namespace, so sockets f creates live there; the
// thread is switched back before it is released (or never released if that fails).
func (n *netns) do(t *testing.T, f func()) {
	t.Helper()
	done := make(chan error)
	go func() {
		runtime.LockOSThread()
		orig, err := unix.Open("/proc/thread-self/ns/net", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			done <- err
			return
		}
		defer unix.Close(orig)
		if err := unix.Setns(n.fd, unix.CLONE_NEWNET); err != nil {
			done <- err
			return
		}
		f()
		if err := unix.Setns(orig, unix.CLONE_NEWNET); err != nil {
			done <- errors.New("cannot return to the original network namespace; thread discarded")
			return // exits locked: the runtime kills the thread
		}
		runtime.UnlockOSThread()
		done <- nil
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// TestOriginalDstRedirect redirects connections with iptables -t nat OUTPUT REDIRECT inside a
// fresh network namespace and reads the pre-NAT destination back.
func TestOriginalDstRedirect(t *testing.T) {
	leaktest.Check(t)
	n := newNetns(t)
	for _, tc := range []struct {
		name, listen, dialIP, iptables string
	}{
		{"v4", "127.0.0.1:0", "127.0.0.1", "iptables"},
		{"v4 on dual-stack listener", "[::]:0", "127.0.0.1", "iptables"},
		{"v6", "[::1]:0", "::1", "ip6tables"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var ln net.Listener
			var err error
			n.do(t, func() { ln, err = net.Listen("tcp", tc.listen) })
			if err != nil {
				t.Skipf("listen %s in netns: %v", tc.listen, err)
			}
			defer ln.Close()
			port := ln.Addr().(*net.TCPAddr).Port
			const origPort = 5555
			if err := n.run(t, tc.iptables, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", tc.dialIP,
				"--dport", fmt.Sprint(origPort), "-j", "REDIRECT", "--to-ports", fmt.Sprint(port)); err != nil {
				t.Skipf("cannot install the REDIRECT rule: %v", err)
			}
			defer n.run(t, tc.iptables, "-t", "nat", "-F", "OUTPUT")

			want := netip.AddrPortFrom(netip.MustParseAddr(tc.dialIP), origPort)
			var c net.Conn
			n.do(t, func() { c, err = net.DialTimeout("tcp", want.String(), 5*time.Second) })
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			s, err := ln.Accept()
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			if got := s.LocalAddr().(*net.TCPAddr).Port; got != port {
				t.Fatalf("accepted on port %d; want %d (redirected)", got, port)
			}
			got, err := OriginalDst(s.(*net.TCPConn))
			if err != nil {
				t.Fatal(err)
			}
			if got != want {
				t.Errorf("OriginalDst = %v; want %v", got, want)
			}
		})
	}
}

// A wildcard UDP socket with SetRecvDst learns that a datagram was sent to 127.0.0.2 and
// answers from it, on an IPv4 socket (IP_PKTINFO) and a dual-stack one (IPV6_PKTINFO,
// v4-mapped); the client's connected socket drops an answer from any other address.
func TestRecvDst(t *testing.T) {
	for _, network := range []string{"udp4", "udp"} { // "udp" on 0.0.0.0 is dual-stack
		t.Run(network, func(t *testing.T) {
			pc, err := net.ListenPacket(network, "0.0.0.0:0")
			if err != nil {
				t.Fatal(err)
			}
			defer pc.Close()
			uc := pc.(*net.UDPConn)
			rc, err := uc.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			if err := SetRecvDst(rc); err != nil {
				t.Fatal(err)
			}
			port := uc.LocalAddr().(*net.UDPAddr).Port
			c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr("127.0.0.2"), uint16(port))))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := c.Write([]byte("q")); err != nil {
				t.Fatal(err)
			}
			buf, oob := make([]byte, 16), make([]byte, DstOOBSize)
			uc.SetReadDeadline(time.Now().Add(5 * time.Second))
			_, oobn, _, from, err := uc.ReadMsgUDPAddrPort(buf, oob)
			if err != nil {
				t.Fatal(err)
			}
			dst := ParseDst(oob[:oobn])
			if dst.Unmap() != netip.MustParseAddr("127.0.0.2") {
				t.Fatalf("ParseDst = %v; want 127.0.0.2", dst)
			}
			if _, _, err := uc.WriteMsgUDPAddrPort([]byte("a"), SrcOOB(dst), from); err != nil {
				t.Fatal(err)
			}
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if n, err := c.Read(buf); err != nil || string(buf[:n]) != "a" {
				t.Errorf("answer: %q, %v; want \"a\" from 127.0.0.2", buf[:n], err)
			}
		})
	}
}

// ParseDst reads no further than the bytes it is given.
func FuzzParseDst(f *testing.F) {
	f.Add(unix.PktInfo4(&unix.Inet4Pktinfo{Addr: [4]byte{127, 0, 0, 2}}))
	f.Add(SrcOOB(netip.MustParseAddr("::1")))
	f.Add([]byte{1, 2, 3})
	f.Fuzz(func(t *testing.T, oob []byte) { ParseDst(oob) })
}

// Two UDP sockets share a port in an SO_REUSEPORT group and datagrams from fresh source
// ports are spread over them. After StopDelivery on one, every new datagram goes to the
// other; the stopped one still reads what it had queued (ReadQueued) and answers from the
// group's port. On a socket bound to an address of each family, and on a wildcard one.
func TestStopDelivery(t *testing.T) {
	lc := net.ListenConfig{Control: func(_, _ string, c syscall.RawConn) error { return SetReusePort(c) }}
	for _, tc := range []struct{ network, bind, dst string }{
		{"udp4", "127.0.0.1", "127.0.0.1"},
		{"udp6", "::1", "::1"},
		{"udp4", "0.0.0.0", "127.0.0.1"},
	} {
		t.Run(tc.network+" "+tc.bind, func(t *testing.T) {
			var socks [2]*net.UDPConn
			addr := net.JoinHostPort(tc.bind, "0")
			for i := range socks {
				pc, err := lc.ListenPacket(t.Context(), tc.network, addr)
				if err != nil {
					t.Skipf("no %s on %s: %v", tc.network, tc.bind, err)
				}
				defer pc.Close()
				socks[i] = pc.(*net.UDPConn)
				addr = pc.LocalAddr().String()
			}
			a, b := socks[0], socks[1]
			dst := netip.AddrPortFrom(netip.MustParseAddr(tc.dst), uint16(a.LocalAddr().(*net.UDPAddr).Port))
			send := func(n int) {
				for range n {
					c, err := net.DialUDP("udp", nil, net.UDPAddrFromAddrPort(dst))
					if err != nil {
						t.Fatal(err)
					}
					if _, err := c.Write([]byte("q")); err != nil {
						t.Fatal(err)
					}
					c.Close()
				}
			}
			rc, err := a.SyscallConn()
			if err != nil {
				t.Fatal(err)
			}
			buf, oob := make([]byte, 16), make([]byte, DstOOBSize)
			readA := func() (senders []netip.AddrPort) {
				t.Helper()
				n, err := ReadQueued(rc, buf, oob, 1000, func(_ []byte, from netip.AddrPort, _ netip.Addr) {
					senders = append(senders, from)
				})
				if err != nil || n != len(senders) {
					t.Fatalf("ReadQueued: %d, %v", n, err)
				}
				return senders
			}
			readB := func(n int) {
				t.Helper()
				b.SetReadDeadline(time.Now().Add(5 * time.Second))
				for i := range n {
					if _, _, err := b.ReadFromUDPAddrPort(buf); err != nil {
						t.Fatalf("datagram %d of %d on the other socket: %v", i+1, n, err)
					}
				}
			}

			const n = 64
			send(n)
			if err := StopDelivery(a); err != nil {
				t.Fatal(err)
			}
			queued := readA()
			if len(queued) == 0 {
				t.Fatalf("none of %d datagrams reached the first socket; want them spread over the group", n)
			}
			readB(n - len(queued))
			send(n)
			readB(n)
			if got := readA(); len(got) != 0 {
				t.Errorf("%d datagrams reached the socket after StopDelivery", len(got))
			}

			// It answers from the group's port, to an address it is not connected to.
			c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(netip.MustParseAddr(tc.dst), 0)))
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := a.WriteToUDPAddrPort([]byte("a"), c.LocalAddr().(*net.UDPAddr).AddrPort()); err != nil {
				t.Fatalf("answer from the stopped socket: %v", err)
			}
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, from, err := c.ReadFromUDPAddrPort(buf); err != nil || from.Port() != dst.Port() {
				t.Errorf("answer: from %v, %v; want from port %d", from, err, dst.Port())
			}
		})
	}
}
