//go:build linux

package netns_test

import (
	"context"
	"errors"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netns"
	"github.com/gozt/gozt/internal/netns/netnstest"
)

func isOpen(fd int) bool {
	_, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	return err == nil
}

// FromFD accepts a network namespace and closes anything else it is handed.
func TestFromFD(t *testing.T) {
	own, err := netns.Open("/proc/self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	defer own.Close()
	again, err := netns.Open("/proc/thread-self/ns/net")
	if err != nil {
		t.Fatal(err)
	}
	if own.ID() != again.ID() {
		t.Errorf("two opens of one namespace: IDs %v and %v", own.ID(), again.ID())
	}
	again.Close()
	if err := again.Close(); err != nil {
		t.Errorf("second Close: %v", err)
	}
	if err := again.Do(func() error { return nil }); !errors.Is(err, netns.ErrClosed) {
		t.Errorf("Do after Close = %v; want ErrClosed", err)
	}

	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[1])
	devNull, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	mnt, err := unix.Open("/proc/self/ns/mnt", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	for name, fd := range map[string]int{"pipe": p[0], "/dev/null": devNull, "mount namespace": mnt} {
		if n, err := netns.FromFD(fd); err == nil {
			n.Close()
			t.Errorf("FromFD(%s) accepted it", name)
		}
		if isOpen(fd) {
			t.Errorf("FromFD(%s) failed but left the fd open", name)
			unix.Close(fd)
		}
	}
}

// A listener opened in a fresh namespace is reachable from inside it only, carries the mark
// and SO_REUSEPORT, and dials from inside carry the mark.
func TestSocketsListenInside(t *testing.T) {
	leaktest.Check(t)
	n := netnstest.NewAnonymous(t)
	s := netns.Sockets{NS: n, Mark: 0x539, ReusePort: true}
	ln, err := s.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	if got := intOpt(t, ln.(*net.TCPListener), unix.SO_MARK); got != 0x539 {
		t.Errorf("listener SO_MARK = %#x; want 0x539", got)
	}
	// SO_REUSEPORT: a second ztunnel can bind the same port while the first still serves it.
	ln2, err := s.Listen(t.Context(), "tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("second listener with SO_REUSEPORT: %v", err)
	}
	ln2.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		io.WriteString(c, "inside")
		c.Close()
	}()

	if c, err := net.Dial("tcp", ln.Addr().String()); err == nil {
		c.Close()
		t.Fatalf("dial %s from the host namespace connected", ln.Addr())
	}
	c, err := s.Dial(t.Context(), nil, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("dial from inside: %v", err)
	}
	defer c.Close()
	if got := intOpt(t, c.(*net.TCPConn), unix.SO_MARK); got != 0x539 {
		t.Errorf("dialed SO_MARK = %#x; want 0x539", got)
	}
	if b, _ := io.ReadAll(c); string(b) != "inside" {
		t.Errorf("read %q; want %q", b, "inside")
	}

	pc, err := s.ListenPacket(t.Context(), "udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	pc.Close()
	if _, err := s.Dial(t.Context(), nil, "tcp", "localhost:80"); err == nil {
		t.Error("Dial with a name inside a namespace succeeded; want an error")
	}
}

func intOpt(t *testing.T, c syscall.Conn, opt int) int {
	t.Helper()
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var v int
	var gerr error
	if err := rc.Control(func(fd uintptr) { v, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, opt) }); err != nil {
		t.Fatal(err)
	}
	if gerr != nil {
		t.Fatal(gerr)
	}
	return v
}

// Do runs fn inside the namespace, and afterwards no thread of the process is left there.
func TestDoRestoresThread(t *testing.T) {
	n := netnstest.NewAnonymous(t)
	host := readNS(t, "/proc/thread-self/ns/net")
	var inside string
	for range 20 {
		if err := n.Do(func() error {
			inside = readNS(t, "/proc/thread-self/ns/net")
			return nil
		}); err != nil {
			t.Fatal(err)
		}
	}
	if want := "net:[" + strconv.FormatUint(n.ID().Ino, 10) + "]"; inside != want {
		t.Errorf("inside Do the thread is in %s; want %s", inside, want)
	}
	tasks, _ := filepath.Glob("/proc/self/task/*/ns/net")
	for _, p := range tasks {
		if got, err := os.Readlink(p); err == nil && got != host {
			t.Errorf("thread %s is in %s after Do; want %s", p, got, host)
		}
	}
	if fnErr := errors.New("fn failed"); !errors.Is(n.Do(func() error { return fnErr }), fnErr) {
		t.Error("Do did not return fn's error")
	}
}

func readNS(t *testing.T, p string) string {
	t.Helper()
	s, err := os.Readlink(p)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// CheckCapabilities passes as root and names the capability a thread lacks.
func TestCheckCapabilities(t *testing.T) {
	netnstest.RequireRoot(t)
	if err := netns.CheckCapabilities(); err != nil {
		t.Fatalf("as root: %v", err)
	}
	for _, tc := range []struct {
		drop []int
		want string
	}{
		{[]int{unix.CAP_SYS_ADMIN}, "CAP_SYS_ADMIN"},
		{[]int{unix.CAP_NET_ADMIN, unix.CAP_NET_RAW}, "CAP_NET_ADMIN"},
	} {
		errc := make(chan error, 1)
		go func() {
			// Never unlocked: the thread loses capabilities and dies with this goroutine.
			runtime.LockOSThread()
			hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
			var data [2]unix.CapUserData
			if err := unix.Capget(&hdr, &data[0]); err != nil {
				errc <- err
				return
			}
			for _, c := range tc.drop {
				data[c/32].Effective &^= 1 << (c % 32)
			}
			if err := unix.Capset(&hdr, &data[0]); err != nil {
				errc <- err
				return
			}
			errc <- netns.CheckThread()
		}()
		err := <-errc
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("without %v: %v; want an error naming %s", tc.drop, err, tc.want)
		}
	}
}

// Dial's connect runs outside the namespace on the poller: it binds a local address when
// asked, reports a refusal, and gives up at the dialer's timeout or when ctx ends.
func TestSocketsDialOutcomes(t *testing.T) {
	leaktest.Check(t)
	n := netnstest.NewAnonymous(t)
	s := netns.Sockets{NS: n, Mark: 0x539}
	ln, err := s.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			io.WriteString(c, c.RemoteAddr().String())
			c.Close()
		}
	}()
	d := &net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 9)}}
	c, err := s.Dial(t.Context(), d, "tcp", ln.Addr().String())
	if err != nil {
		t.Fatalf("dial with a local address: %v", err)
	}
	b, _ := io.ReadAll(c)
	c.Close()
	if host, _, _ := net.SplitHostPort(string(b)); host != "127.0.0.9" {
		t.Errorf("the listener saw %q; want the dial from 127.0.0.9", b)
	}
	if _, ok := c.(*net.TCPConn); !ok {
		t.Errorf("Dial returned a %T; want *net.TCPConn (the proxy splices TCP legs)", c)
	}
	if got := c.RemoteAddr().String(); got != ln.Addr().String() {
		t.Errorf("RemoteAddr = %s; want %s", got, ln.Addr())
	}

	port := ln.Addr().(*net.TCPAddr).Port
	if _, err := s.Dial(t.Context(), nil, "tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(port+1))); !errors.Is(err, syscall.ECONNREFUSED) {
		t.Errorf("dial of a closed port: %v; want connection refused", err)
	}

	// A SYN nobody answers: drop it inside the namespace.
	if _, err := exec.LookPath("iptables"); err != nil {
		t.Skip("iptables not installed: the timeout cases need it")
	}
	if err := n.Do(func() error {
		return exec.Command("iptables", "-w", "-A", "OUTPUT", "-p", "tcp", "--dport", "9", "-j", "DROP").Run()
	}); err != nil {
		t.Fatalf("iptables in the namespace: %v", err)
	}
	start := time.Now()
	_, err = s.Dial(t.Context(), &net.Dialer{Timeout: 200 * time.Millisecond}, "tcp", "127.0.0.1:9")
	if err == nil || !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Errorf("dial into a dropped SYN with a 200ms timeout: %v; want a deadline error", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	time.AfterFunc(100*time.Millisecond, cancel)
	_, err = s.Dial(ctx, nil, "tcp", "127.0.0.1:9")
	if !errors.Is(err, context.Canceled) {
		t.Errorf("dial cancelled by its context: %v; want context.Canceled", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Errorf("the two dials that should give up took %v", d)
	}
}

// BenchmarkSocketsDial compares Dial (socket made inside the namespace, connect on the
// poller) with running the whole dial on a thread inside the namespace, as Dial did first.
func BenchmarkSocketsDial(b *testing.B) {
	n := netnstest.NewAnonymous(b)
	s := netns.Sockets{NS: n, Mark: 0x539}
	ln, err := s.Listen(b.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	addr := ln.Addr().String()
	b.Run("poller", func(b *testing.B) {
		for range b.N {
			c, err := s.Dial(b.Context(), nil, "tcp", addr)
			if err != nil {
				b.Fatal(err)
			}
			c.Close()
		}
	})
	b.Run("thread", func(b *testing.B) {
		for range b.N {
			var c net.Conn
			if err := n.Do(func() (err error) { c, err = net.Dial("tcp", addr); return err }); err != nil {
				b.Fatal(err)
			}
			c.Close()
		}
	})
}
