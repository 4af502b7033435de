//go:build linux

package netpoll_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/netpoll"
	"github.com/gozt/gozt/internal/sockopt"
	"github.com/gozt/gozt/internal/testutil"
)

// newPoller is the epoll poller, closed when the test ends.
func newPoller(t *testing.T) netpoll.Poller {
	t.Helper()
	leaktest.Check(t)
	p, err := netpoll.New()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

// forEach runs test against both Pollers, the epoll one and PerSocket.
func forEach(t *testing.T, test func(t *testing.T, p netpoll.Poller)) {
	t.Run("epoll", func(t *testing.T) { test(t, newPoller(t)) })
	t.Run("per socket", func(t *testing.T) {
		leaktest.Check(t)
		test(t, netpoll.PerSocket{})
	})
}

// listen opens a listener as a proxy does: its connections get no keepalive from Go.
func listen(t *testing.T) *net.TCPListener {
	t.Helper()
	ln, err := (&net.ListenConfig{KeepAlive: -1}).Listen(context.Background(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln.(*net.TCPListener)
}

// accepts watches ln and returns the channel its connections arrive on.
func accepts(t *testing.T, p netpoll.Poller, ln net.Listener) (<-chan net.Conn, func()) {
	t.Helper()
	conns := make(chan net.Conn, 64)
	stop, err := p.Watch(ln, func(c net.Conn, err error) {
		if err != nil {
			t.Errorf("accept: %v", err)
			return
		}
		conns <- c
	})
	if err != nil {
		t.Fatal(err)
	}
	return conns, stop
}

func recv(t *testing.T, conns <-chan net.Conn) net.Conn {
	t.Helper()
	select {
	case c := <-conns:
		t.Cleanup(func() { c.Close() })
		return c
	case <-time.After(5 * time.Second):
		t.Fatal("no connection handed over")
		return nil
	}
}

// Connections are handed over as *net.TCPConn (so the proxy's copy can splice them)
// without keepalive and carry data both ways; more than a batch waiting at once all arrive.
func TestWatchAccept(t *testing.T) { forEach(t, testWatchAccept) }

func testWatchAccept(t *testing.T, p netpoll.Poller) {
	ln := listen(t)
	conns, stop := accepts(t, p, ln)
	defer stop()
	var clients []net.Conn
	for range 40 {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		clients = append(clients, c)
	}
	for i := range clients {
		c := recv(t, conns)
		tc, ok := c.(*net.TCPConn)
		if !ok {
			t.Fatalf("connection %d is a %T; want *net.TCPConn", i, c)
		}
		rc, _ := tc.SyscallConn()
		var ka int
		rc.Control(func(fd uintptr) { ka, _ = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_KEEPALIVE) })
		if ka != 0 {
			t.Errorf("connection %d: SO_KEEPALIVE %d; want 0", i, ka)
		}
		if c.RemoteAddr().String() == "" || c.LocalAddr().String() != ln.Addr().String() {
			t.Errorf("connection %d: addresses %v -> %v", i, c.RemoteAddr(), c.LocalAddr())
		}
	}
	// Data both ways through a fresh one.
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	srv := recv(t, conns)
	if _, err := c.Write([]byte("ping")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 4)
	srv.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(srv, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("server read %q, %v", buf, err)
	}
	if _, err := srv.Write([]byte("pong")); err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "pong" {
		t.Fatalf("client read %q, %v", buf, err)
	}
	select {
	case extra := <-conns:
		t.Errorf("an extra connection from %v", extra.RemoteAddr())
	default:
	}
}

// Once stop has returned, the poller accepts nothing more: a new connection waits in the
// listener's queue for its owner.
func TestStop(t *testing.T) { forEach(t, testStop) }

func testStop(t *testing.T, p netpoll.Poller) {
	ln := listen(t)
	conns, stop := accepts(t, p, ln)
	c1, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close()
	recv(t, conns)
	stop()
	stop() // idempotent
	c2, err := net.Dial("tcp", c1.RemoteAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	ln.SetDeadline(time.Now().Add(5 * time.Second))
	got, err := ln.Accept()
	if err != nil {
		t.Fatalf("owner's accept after stop: %v", err)
	}
	got.Close()
	if got.RemoteAddr().String() != c2.LocalAddr().String() {
		t.Errorf("owner accepted %v; want %v", got.RemoteAddr(), c2.LocalAddr())
	}
	select {
	case c := <-conns:
		t.Errorf("handed over %v after stop", c.RemoteAddr())
	case <-time.After(50 * time.Millisecond):
	}
}

// stop waits for a callback in progress: after it returns, the callback has returned.
func TestStopWaitsForCallback(t *testing.T) { forEach(t, testStopWaitsForCallback) }

func testStopWaitsForCallback(t *testing.T, p netpoll.Poller) {
	ln := listen(t)
	entered := make(chan struct{})
	var inside, after atomic.Bool
	stop, err := p.Watch(ln, func(c net.Conn, err error) {
		if c != nil {
			defer c.Close()
		}
		inside.Store(true)
		close(entered)
		time.Sleep(100 * time.Millisecond)
		inside.Store(false)
		if after.Load() {
			t.Error("callback ran on after stop returned")
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	c, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	<-entered
	stop()
	after.Store(true)
	if inside.Load() {
		t.Error("stop returned while the callback ran")
	}
}

// An owner that closes its listener without stopping the watch first, then opens a socket
// that gets the same fd number, does not have the new one accepted on by the poller: it
// holds the closed listener's Go fd, not the number.
func TestClosedListenerFDReused(t *testing.T) { forEach(t, testClosedListenerFDReused) }

func testClosedListenerFDReused(t *testing.T, p netpoll.Poller) {
	ln := listen(t)
	conns, stop := accepts(t, p, ln)
	defer stop()
	fdOf := func(l *net.TCPListener) (n int) {
		rc, _ := l.SyscallConn()
		rc.Control(func(fd uintptr) { n = int(fd) })
		return n
	}
	old := fdOf(ln)
	ln.Close()
	var again *net.TCPListener
	for range 10 { // the number is free; the next socket usually takes it
		again = listen(t)
		if fdOf(again) == old {
			break
		}
	}
	if fdOf(again) != old {
		t.Skip("the closed listener's fd number was not reused")
	}
	c, err := net.Dial("tcp", again.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	again.SetDeadline(time.Now().Add(5 * time.Second))
	got, err := again.Accept()
	if err != nil {
		t.Fatalf("the new listener's own accept: %v", err)
	}
	got.Close()
	select {
	case c := <-conns:
		t.Errorf("the poller accepted %v on the reused fd", c.RemoteAddr())
	case <-time.After(50 * time.Millisecond):
	}
}

// Datagrams arrive whole with their sender and, on a socket that reports it, the address
// they were sent to; a reply goes back through the socket.
func TestWatchPacket(t *testing.T) { forEach(t, testWatchPacket) }

func testWatchPacket(t *testing.T, p netpoll.Poller) {
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	rc, err := pc.(*net.UDPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	if err := sockopt.SetRecvDst(rc); err != nil {
		t.Fatal(err)
	}
	type dgram struct {
		b    string
		from netip.AddrPort
		to   netip.Addr
	}
	got := make(chan dgram, 64)
	stop, err := p.WatchPacket(pc, func(b []byte, from netip.AddrPort, to netip.Addr, err error) {
		if err != nil {
			t.Errorf("read: %v", err)
			return
		}
		got <- dgram{string(b), from, to}
		pc.WriteTo(append([]byte("re:"), b...), net.UDPAddrFromAddrPort(from))
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	c, err := net.Dial("udp", pc.LocalAddr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	big := string(make([]byte, 9000))
	for _, msg := range []string{"one", big, "three"} {
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		select {
		case d := <-got:
			if d.b != msg || d.from.String() != c.LocalAddr().String() || d.to != netip.MustParseAddr("127.0.0.1") {
				t.Errorf("got %d bytes from %v to %v; want %d from %v to 127.0.0.1", len(d.b), d.from, d.to, len(msg), c.LocalAddr())
			}
		case <-time.After(5 * time.Second):
			t.Fatal("no datagram")
		}
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 10000)
		n, err := c.Read(buf)
		if err != nil || string(buf[:n]) != "re:"+msg {
			t.Errorf("reply: %d bytes, %v", n, err)
		}
	}
}

// Out of file descriptors, accept4 fails: the callback is told, the listener is taken out
// of the set and retried with a growing delay rather than reported again at once, and once
// descriptors are free the waiting connection is handed over. The limit is the process's
// real RLIMIT_NOFILE, lowered for the test.
func TestAcceptBackoff(t *testing.T) { forEach(t, testAcceptBackoff) }

func testAcceptBackoff(t *testing.T, p netpoll.Poller) {
	ln := listen(t)
	var failures atomic.Int32
	conns := make(chan net.Conn, 4)
	stop, err := p.Watch(ln, func(c net.Conn, err error) {
		if err != nil {
			if !errors.Is(err, syscall.EMFILE) {
				t.Errorf("accept error %v; want EMFILE", err)
			}
			failures.Add(1)
			return
		}
		conns <- c
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	var old syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &old); err != nil {
		t.Skip(err)
	}
	restore := func() { syscall.Setrlimit(syscall.RLIMIT_NOFILE, &old) }
	defer restore()
	ents, _ := os.ReadDir("/proc/self/fd")
	low := old
	low.Cur = uint64(len(ents) + 32)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Skip("cannot lower RLIMIT_NOFILE:", err)
	}
	var fillers []*os.File
	defer func() {
		for _, f := range fillers {
			f.Close()
		}
	}()
	for {
		f, err := os.Open(os.DevNull)
		if err != nil {
			break
		}
		fillers = append(fillers, f)
	}
	var c net.Conn
	for c == nil && len(fillers) > 0 { // free one descriptor for the client's socket
		fillers[len(fillers)-1].Close()
		fillers = fillers[:len(fillers)-1]
		c, err = net.Dial("tcp", ln.Addr().String()) // the kernel completes it; accept4 fails
		if err != nil && !errors.Is(err, syscall.EMFILE) {
			t.Fatal(err)
		}
	}
	if c == nil {
		t.Fatal("no descriptor left for the client")
	}
	defer c.Close()
	testutil.Eventually(t, "the callback to hear of the failed accept", func() bool { return failures.Load() >= 1 })
	// Delays of 5, 10, 20, 40, 80 and 160 ms fit in the next 300 ms: about six tries, not
	// thousands (a loaded machine makes fewer, never more).
	n0 := failures.Load()
	time.Sleep(300 * time.Millisecond)
	if n := failures.Load() - n0; n > 12 {
		t.Errorf("%d failed accepts in 300 ms out of descriptors; want a few, backing off", n)
	}
	for _, f := range fillers {
		f.Close()
	}
	fillers = nil
	restore()
	select {
	case got := <-conns:
		got.Close()
	case <-time.After(5 * time.Second):
		t.Fatal("the waiting connection was not accepted once descriptors were free")
	}
}

// gate is a listener that holds accepts back until let is called, and refuses the
// connections refuse says to (if set). Its Accept waits for room and refuses, as hbone's
// AdmitListener does, for PerSocket, which calls it; the epoll poller accepts on the
// socket and asks Room and Refuses itself.
type gate struct {
	*net.TCPListener
	refuse   func(netip.AddrPort) bool
	mu       sync.Mutex
	open     bool
	wake     func()
	refused  int // guarded by mu
	accepted atomic.Int64
}

func (g *gate) Accept() (net.Conn, error) {
	woken := make(chan struct{}, 1)
	for !g.Room(func() { woken <- struct{}{} }) {
		<-woken
	}
	for {
		c, err := g.TCPListener.Accept()
		if err != nil {
			return nil, err
		}
		if g.Refuses(c.RemoteAddr().(*net.TCPAddr).AddrPort()) {
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
			continue
		}
		g.Accepted()
		return c, nil
	}
}

func (g *gate) Refuses(src netip.AddrPort) bool { return g.refuse != nil && g.refuse(src) }
func (g *gate) Hold(reset func())               { reset() }

func (g *gate) Room(wake func()) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.open {
		g.refused++
		g.wake = wake
	}
	return g.open
}

func (g *gate) Accepted() { g.accepted.Add(1) }

func (g *gate) refusals() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.refused
}

func (g *gate) let() {
	g.mu.Lock()
	g.open = true
	wake := g.wake
	g.wake = nil
	g.mu.Unlock()
	wake()
}

// A listener that is a Gate is asked before each accept: while it has no room, the poller
// takes nothing (its connections wait in the backlog) and asks no more until woken; woken,
// it accepts them all, each counted by Accepted.
func TestGate(t *testing.T) { forEach(t, testGate) }

func testGate(t *testing.T, p netpoll.Poller) {
	g := &gate{TCPListener: listen(t)}
	conns, stop := accepts(t, p, g)
	defer stop()
	dial := func(ln net.Listener) {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
	}
	dial(g)
	testutil.Eventually(t, "the gate to be asked", func() bool { return g.refusals() == 1 })
	dial(g)
	dial(g)
	// A round of the poller over another listener: the gated one is out of the set, so
	// its new connections make it ask nothing.
	other := listen(t)
	others, stopOther := accepts(t, p, other)
	defer stopOther()
	dial(other)
	recv(t, others)
	select {
	case c := <-conns:
		t.Fatalf("a connection from %v accepted while the gate had no room", c.RemoteAddr())
	default:
	}
	if n := g.refusals(); n != 1 {
		t.Errorf("the gate was asked %d times while closed; want 1", n)
	}
	g.let()
	for range 3 {
		recv(t, conns)
	}
	if n := g.accepted.Load(); n != 3 {
		t.Errorf("Accepted told %d times; want 3", n)
	}
}

// A gate that refuses a connection as it is accepted: its peer gets an RST, and the
// callback does not see it nor is Accepted told (the epoll poller refuses it before it
// becomes a net.Conn); the connections the gate keeps are handed over as before.
func TestGateRefuses(t *testing.T) { forEach(t, testGateRefuses) }

func testGateRefuses(t *testing.T, p netpoll.Poller) {
	refusedSrc := netip.MustParseAddr("127.0.0.2")
	g := &gate{TCPListener: listen(t), open: true, refuse: func(src netip.AddrPort) bool { return src.Addr() == refusedSrc }}
	conns, stop := accepts(t, p, g)
	defer stop()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: refusedSrc.AsSlice()}}
	rc, err := d.Dial("tcp", g.Addr().String())
	if err == nil { // on loopback the RST can beat connect's return
		defer rc.Close()
		rc.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = rc.Read(make([]byte, 1))
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the refused connection: %v; want a reset", err)
	}
	kc, err := net.Dial("tcp", g.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer kc.Close()
	if got := recv(t, conns).RemoteAddr().String(); got != kc.LocalAddr().String() {
		t.Errorf("handed over the connection from %s; want the kept one, from %s", got, kc.LocalAddr())
	}
	if n := g.accepted.Load(); n != 1 {
		t.Errorf("Accepted told %d times; want 1 (the refused connection is not accepted)", n)
	}
}

// refuseAll is a Gate with room for every connection that refuses each, counting the
// accepts; its first Room call runs first.
type refuseAll struct {
	*net.TCPListener
	accepts atomic.Int64
	once    sync.Once
	first   func()
}

func (g *refuseAll) Room(func()) bool {
	g.once.Do(g.first)
	g.accepts.Add(1)
	return true
}
func (g *refuseAll) Refuses(netip.AddrPort) bool { return true }
func (g *refuseAll) Hold(reset func())           { reset() }
func (g *refuseAll) Accepted()                   {}

// While a listener stays ready (a flood's backlog), the epoll poller takes turns with the
// goroutines waiting for the CPU instead of serving the backlog through: on one P, a
// goroutine made runnable during its first round runs after that round (a batch of 16
// accepts) or, when the scheduler's fairness check (every 61st turn) picks the poller
// first, after the next, not after the whole backlog. (The node's established
// connections' readers are such goroutines.) The race detector randomizes which goroutine
// runs next, so this runs without it (make test-norace: the name ends in Yields).
func TestPollerYields(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector randomizes which goroutine runs next (make test-norace runs this)")
	}
	prev := runtime.GOMAXPROCS(1)
	defer runtime.GOMAXPROCS(prev)
	p := newPoller(t)
	const backlog = 128
	ran := make(chan int64, 1)
	g := &refuseAll{TCPListener: listen(t)}
	g.first = func() { go func() { ran <- g.accepts.Load() }() } // runnable during the first round
	for range backlog {
		c, err := net.Dial("tcp", g.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
	}
	stop, err := p.Watch(g, func(c net.Conn, err error) {
		if err == nil {
			c.Close()
		}
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	if n := <-ran; n > 2*16+1 {
		t.Errorf("a goroutine made runnable during the poller's first round ran after %d accepts of a backlog of %d; want it to run after that round or the next (16 accepts each)", n, backlog)
	}
}

// pair returns both ends of a loopback TCP connection.
func pair(t *testing.T) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	ln := listen(t)
	c, err := net.Dial("tcp", ln.Addr().String())
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

// readyFunc is a Readable that calls its func.
type readyFunc struct {
	*net.TCPConn
	f func()
}

func (r readyFunc) Ready() { r.f() }

// readyCh watches c once and returns the channel ready is told on, and cancel.
func readyCh(t *testing.T, p netpoll.Poller, c *net.TCPConn) (<-chan struct{}, func() bool) {
	t.Helper()
	ch := make(chan struct{}, 2)
	token, err := p.WatchReadable(readyFunc{c, func() { ch <- struct{}{} }})
	if err != nil {
		t.Fatal(err)
	}
	return ch, func() bool { return p.CancelReadable(token) }
}

func TestWatchReadable(t *testing.T) {
	p := newPoller(t)
	a, b := pair(t)
	fired, cancel := readyCh(t, p, b)
	select {
	case <-fired:
		t.Fatal("ready before anything arrived")
	case <-time.After(50 * time.Millisecond):
	}
	a.Write([]byte("x"))
	select {
	case <-fired:
	case <-time.After(5 * time.Second):
		t.Fatal("no ready after a write")
	}
	if cancel() {
		t.Error("cancel after ready reported it came first")
	}
	// Readiness present at the call counts, and a fired socket can be watched again.
	fired, _ = readyCh(t, p, b)
	select {
	case <-fired:
	case <-time.After(5 * time.Second):
		t.Fatal("no ready for a byte already queued")
	}
	buf := make([]byte, 1)
	b.Read(buf)
	// A FIN wakes it (EPOLLRDHUP), once.
	fired, _ = readyCh(t, p, b)
	a.CloseWrite()
	select {
	case <-fired:
	case <-time.After(5 * time.Second):
		t.Fatal("no ready after the peer's FIN")
	}
	select {
	case <-fired:
		t.Fatal("one-shot watch fired twice")
	case <-time.After(50 * time.Millisecond):
	}
}

func TestWatchReadableCancel(t *testing.T) {
	p := newPoller(t)
	a, b := pair(t)
	fired, cancel := readyCh(t, p, b)
	if !cancel() {
		t.Fatal("cancel before any event reported it came second")
	}
	if cancel() {
		t.Error("second cancel reported it came first")
	}
	a.Write([]byte("x"))
	select {
	case <-fired:
		t.Fatal("ready after cancel")
	case <-time.After(100 * time.Millisecond):
	}
	// A closed socket leaves the set with no event; cancel still takes the watch.
	fired, cancel = readyCh(t, p, a)
	a.Close()
	b.Write([]byte("y"))
	select {
	case <-fired:
		t.Fatal("ready for a closed socket")
	case <-time.After(100 * time.Millisecond):
	}
	if !cancel() {
		t.Error("cancel of a closed socket's watch reported it came second")
	}
}

// PerSocket watches no readability: it would take the goroutine a caller parks to give up.
func TestPerSocketDoesNotPark(t *testing.T) {
	var p netpoll.PerSocket
	if p.Parks() {
		t.Error("PerSocket.Parks() = true; want false")
	}
	a, _ := pair(t)
	if _, err := p.WatchReadable(readyFunc{a, func() {}}); !errors.Is(err, errors.ErrUnsupported) {
		t.Errorf("PerSocket.WatchReadable: %v; want errors.ErrUnsupported", err)
	}
	ep := newPoller(t)
	if !ep.Parks() {
		t.Error("the epoll poller's Parks() = false; want true")
	}
}

// A stopped packet watch leaves its socket open and as it was: the owner reads what is
// queued on it (a draining DNS proxy's queries) and answers through it.
func TestStopPacketKeepsSocket(t *testing.T) { forEach(t, testStopPacketKeepsSocket) }

func testStopPacketKeepsSocket(t *testing.T, p netpoll.Poller) {
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	stop, err := p.WatchPacket(pc, func([]byte, netip.AddrPort, netip.Addr, error) {})
	if err != nil {
		t.Fatal(err)
	}
	stop()
	c, err := net.DialUDP("udp", nil, pc.LocalAddr().(*net.UDPAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("queued")); err != nil {
		t.Fatal(err)
	}
	// No deadline of the test's own: one the watch left behind would end this read.
	buf := make([]byte, 16)
	var n int
	var from *net.UDPAddr
	read := make(chan struct{})
	go func() {
		defer close(read)
		n, from, err = pc.ReadFromUDP(buf)
	}()
	select {
	case <-read:
	case <-time.After(5 * time.Second):
		pc.Close()
		<-read
		t.Fatal("the owner's read after stop got nothing")
	}
	if err != nil || string(buf[:n]) != "queued" {
		t.Fatalf("owner's read after stop: %q, %v; want the datagram", buf[:n], err)
	}
	if _, err := pc.WriteToUDP([]byte("answer"), from); err != nil {
		t.Errorf("owner's write after stop: %v", err)
	}
}
