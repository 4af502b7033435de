//go:build linux

package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"io"
	"net"
	"runtime"
	"sync"
	"testing"

	"github.com/gozt/gozt/identity"
	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/sys/unix"
)

// These run on every host: where the kernel has no TLS (this repo's usual hosts) they
// check the fallback, and in `make test-ktls`'s VM the kernel path.

// kernelHasTLS reports whether setsockopt(TCP_ULP, "tls") works here.
func kernelHasTLS(t testing.TB) bool {
	t.Helper()
	a, _ := tcpPair(t)
	rc, err := a.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	rc.Control(func(fd uintptr) { serr = unix.SetsockoptString(int(fd), unix.SOL_TCP, unix.TCP_ULP, "tls") })
	return serr == nil
}

// tlsInfos collects what Config.OnTLS hears.
type tlsInfos struct {
	mu  sync.Mutex
	got []TLSInfo
}

func (r *tlsInfos) add(i TLSInfo) {
	r.mu.Lock()
	r.got = append(r.got, i)
	r.mu.Unlock()
}

func (r *tlsInfos) take() []TLSInfo {
	r.mu.Lock()
	defer r.mu.Unlock()
	got := r.got
	r.got = nil
	return got
}

// hashEcho sends size bytes of seeded data on s, half-closes, and checks that the echo
// hashes the same.
func hashEcho(t *testing.T, s *Stream, seed byte, size int) {
	t.Helper()
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i*7) ^ seed
	}
	sent := sha256.Sum256(data)
	errc := make(chan error, 1)
	go func() {
		_, err := s.Write(data)
		if err == nil {
			err = s.CloseWrite()
		}
		errc <- err
	}()
	h := sha256.New()
	n, err := io.Copy(h, s)
	if err != nil || n != int64(size) {
		t.Fatalf("echo: read %d of %d bytes: %v", n, size, err)
	}
	if werr := <-errc; werr != nil {
		t.Fatalf("write: %v", werr)
	}
	if got := h.Sum(nil); !bytes.Equal(got, sent[:]) {
		t.Fatalf("echo hash %x, sent %x", got[:4], sent[:4])
	}
}

// TestKernelTLSOrFallback: connections hand their records to the kernel where it has
// kernel TLS and carry on in crypto/tls where it has not; either way they work, and
// OnTLS hears which, once per connection and side.
func TestKernelTLSOrFallback(t *testing.T) {
	leaktest.Check(t)
	kernel := kernelHasTLS(t)
	var infos tlsInfos
	e := newEnv(t, ServerConfig{Config: Config{OnTLS: infos.add}}, echo)
	check := func(t *testing.T, s *Stream, memo bool) {
		t.Helper()
		got := infos.take()
		if len(got) != 2 || got[0].Server == got[1].Server {
			t.Fatalf("OnTLS heard %+v; want one client and one server report", got)
		}
		for _, i := range got {
			switch {
			case kernel && !i.Kernel:
				t.Errorf("kernel has TLS, but %+v", i)
			case !kernel && (i.Kernel || i.Reason != "no_kernel_tls" || i.Err == nil):
				t.Errorf("kernel has no TLS, but %+v; want reason no_kernel_tls with its cause", i)
			case !kernel && memo && i.Err != errKernelMemo:
				t.Errorf("second connection: %v; want it not to ask the kernel again", i.Err)
			}
		}
		if s.KernelTLS() != kernel {
			t.Errorf("Stream.KernelTLS() = %v on a kernel with TLS %v", s.KernelTLS(), kernel)
		}
	}
	s := e.dial(t, "10.0.0.1:80")
	check(t, s, false)
	hashEcho(t, s, 1, 1<<20+5)
	s.Close()

	// A second connection (another source identity, so another pool key).
	k := e.key
	k.Src = identity.MustParse("spiffe://cluster.local/ns/default/sa/other")
	s2, err := e.pool.Dial(context.Background(), k, "10.0.0.1:80", nil)
	if err != nil {
		t.Fatal(err)
	}
	check(t, s2, true)
	hashEcho(t, s2, 2, 100<<10)
	s2.Close()
}

// TestKernelTLSDisabled: DisableKernelTLS keeps connections in crypto/tls, and says so.
func TestKernelTLSDisabled(t *testing.T) {
	var infos tlsInfos
	e := newEnv(t, ServerConfig{Config: Config{DisableKernelTLS: true, OnTLS: infos.add}}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	hashEcho(t, s, 3, 1<<20)
	got := infos.take()
	if len(got) != 2 {
		t.Fatalf("OnTLS heard %+v; want two reports", got)
	}
	for _, i := range got {
		if i.Kernel || i.Reason != "disabled" {
			t.Errorf("%+v; want reason disabled", i)
		}
	}
	if s.KernelTLS() {
		t.Error("Stream.KernelTLS() with DisableKernelTLS")
	}
}

// TestKernelTLSNotTCP: ServeTLS over something that is no TCP socket stays in
// crypto/tls and says why.
func TestKernelTLSNotTCP(t *testing.T) {
	testCA()
	var infos tlsInfos
	srv := NewServer(ServerConfig{Config: Config{OnTLS: infos.add}}, echo)
	a, b := net.Pipe()
	done := make(chan error, 1)
	go func() { done <- srv.ServeTLS(context.Background(), b, srvTLS) }()
	pool := NewPool(ClientConfig{Config: Config{DisableKernelTLS: true}}, nil)
	defer pool.Close()
	// The client side over the pipe, as a pooled connection would be.
	ts := startTLS(a, cliTLS, false, &pool.cfg.Config, &pool.kernel)
	if err := ts.handshake(context.Background()); err != nil {
		t.Fatal(err)
	}
	nc, bc, kc, err := ts.finish(&pool.cfg.Config, &pool.kernel)
	if err != nil || kc != nil {
		t.Fatalf("finish: %v, %v", kc, err)
	}
	c, err := pool.startConn(context.Background(), Key{}, nc, bc, nil)
	if err != nil {
		t.Fatal(err)
	}
	c.tryReserve(true)
	s, err := c.open(context.Background(), pool.deadline(context.Background()), "10.0.0.1:80", nil)
	if err != nil {
		t.Fatal(err)
	}
	hashEcho(t, s, 4, 64<<10)
	s.Close()
	if got := infos.take(); len(got) != 1 || got[0].Kernel || got[0].Reason != "not_tcp" || !got[0].Server {
		t.Errorf("server's OnTLS heard %+v; want reason not_tcp", got)
	}
	pool.Close()
	srv.Close()
	<-done
}

// relay is a proxy's copy between st and tc (proxy's parkCopy, unparked): the frame reader
// delivers st's data to tc, and st is fed from tc until tc's EOF; each end half-closes
// the other, and a failure aborts both (tc with a reset). It returns once both
// directions are done.
func relay(st *Stream, tc *net.TCPConn) (toStream, fromStream int64, err error) {
	return relayReady(st, tc, func() {})
}

// relayReady is relay calling ready once st's data goes to tc.
func relayReady(st *Stream, tc *net.TCPConn, ready func()) (toStream, fromStream int64, err error) {
	abort := func() {
		tc.SetLinger(0)
		tc.Close()
		st.Close()
	}
	down := make(chan error, 1)
	var got int64
	if err := st.DeliverTo(tc, func(n int64, err error) {
		got = n
		if err != nil {
			abort()
		} else {
			tc.CloseWrite()
		}
		down <- err
	}); err != nil {
		return 0, 0, err
	}
	ready()
	toStream, err = st.ReadFrom(tc)
	if err == nil {
		err = st.CloseWrite()
	}
	if err != nil {
		abort()
	}
	derr := <-down
	if err == nil {
		err = derr
	}
	return toStream, got, err
}

// sendHashed writes size seeded bytes to c, half-closes it, and returns their hash.
func sendHashed(c *net.TCPConn, seed byte, size int) <-chan [32]byte {
	ch := make(chan [32]byte, 1)
	go func() {
		h := sha256.New()
		buf := make([]byte, 100003)
		for left := size; left > 0; {
			n := min(left, len(buf))
			for i := range buf[:n] {
				buf[i] = byte(left-i) ^ seed
			}
			h.Write(buf[:n])
			if _, err := c.Write(buf[:n]); err != nil {
				break
			}
			left -= n
		}
		c.CloseWrite()
		var sum [32]byte
		copy(sum[:], h.Sum(nil))
		ch <- sum
	}()
	return ch
}

// recvHashed reads c to EOF and returns the hash and byte count.
func recvHashed(c *net.TCPConn) <-chan [32]byte {
	ch := make(chan [32]byte, 1)
	go func() {
		h := sha256.New()
		io.Copy(h, c)
		var sum [32]byte
		copy(sum[:], h.Sum(nil))
		ch <- sum
	}()
	return ch
}

// TestKernelTLSSplice: TCP → HBONE → TCP both ways at once through relays on both ends,
// as two proxies would carry a connection, with half-closes both ways. In kernel TLS
// every DATA payload sent from a TCP socket is spliced, none copied.
func TestKernelTLSSplice(t *testing.T) {
	leaktest.Check(t)
	const up, down = 2<<20 + 3, 1<<20 + 7
	type result struct {
		st      *Stream
		in, out int64
		err     error
	}
	served := make(chan result, 1)
	hA, hB := tcpPair(t) // the server's backend: the handler relays to hA, the test is hB
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		st, err := r.Accept(nil)
		if err != nil {
			served <- result{err: err}
			return
		}
		defer st.Close()
		in, out, err := relay(st, hA)
		served <- result{st, in, out, err}
	})
	cA, cB := tcpPair(t) // the client's application: cB is the test, the relay has cA
	// Sinks that never fill, where the kernel allows (the VM raises wmem_max), so every
	// payload byte received can be spliced: a full sink makes the frame reader queue.
	roomy := bigSendBuffer(t, hA, up) && bigSendBuffer(t, cA, down)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	upSent, downGot := sendHashed(cB, 5, up), recvHashed(cB)
	downSent, upGot := sendHashed(hB, 6, down), recvHashed(hB)
	toStream, fromStream, err := relay(s, cA)
	if err != nil {
		t.Fatalf("client relay: %v", err)
	}
	r := <-served
	if r.err != nil {
		t.Fatalf("server relay: %v", r.err)
	}
	if a, b := <-upSent, <-upGot; a != b {
		t.Error("client → server: hashes differ")
	}
	if a, b := <-downSent, <-downGot; a != b {
		t.Error("server → client: hashes differ")
	}
	if toStream != up || fromStream != down || r.in != down || r.out != up {
		t.Errorf("relays moved %d/%d (client) and %d/%d (server); want %d/%d and %d/%d",
			toStream, fromStream, r.in, r.out, up, down, down, up)
	}
	if !s.KernelTLS() {
		t.Skip("no kernel TLS here: the user-space path carried it")
	}
	cb, sb := s.KernelTLSBytes(), r.st.KernelTLSBytes()
	t.Logf("client %+v, server %+v", cb, sb)
	if cb.SplicedOut != up || cb.CopiedOut != 0 || sb.SplicedOut != down || sb.CopiedOut != 0 {
		t.Errorf("sent spliced/copied: client %d/%d (want %d/0), server %d/%d (want %d/0)",
			cb.SplicedOut, cb.CopiedOut, up, sb.SplicedOut, sb.CopiedOut, down)
	}
	if cb.SplicedIn+cb.CopiedIn != down || sb.SplicedIn+sb.CopiedIn != up {
		t.Errorf("received spliced+copied: client %d, server %d; want %d and %d",
			cb.SplicedIn+cb.CopiedIn, sb.SplicedIn+sb.CopiedIn, down, up)
	}
	if roomy && (cb.CopiedIn != 0 || sb.CopiedIn != 0) {
		t.Errorf("received copied: client %d, server %d; want 0 with sinks that never fill", cb.CopiedIn, sb.CopiedIn)
	}
	if !roomy {
		t.Log("the kernel capped the sinks' send buffers: received bytes may be copied")
	}
}

// bigSendBuffer asks for a send buffer that holds size bytes and reports whether c got
// one (SO_SNDBUF reads back twice what was granted, bookkeeping included).
func bigSendBuffer(t *testing.T, c *net.TCPConn, size int) bool {
	t.Helper()
	c.SetWriteBuffer(4 * size)
	rc, err := c.SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var got int
	rc.Control(func(fd uintptr) { got, _ = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_SNDBUF) })
	return got >= 4*size
}

// TestKernelTLSSpliceFullSink: a DeliverTo socket that fills (its reader waits) makes the
// frame reader stop splicing and queue the rest of each frame; nothing is lost or
// reordered when the reader catches up.
func TestKernelTLSSpliceFullSink(t *testing.T) {
	leaktest.Check(t)
	const size = 2<<20 + 11
	served := make(chan *Stream, 1)
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		st, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer st.Close()
		served <- st
		io.Copy(io.Discard, st)
		st.CloseWrite()
	})
	cA, cB := tcpPair(t)
	cA.SetWriteBuffer(4096) // fills at once
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	st := <-served
	done := make(chan error, 1)
	if err := s.DeliverTo(cA, func(n int64, err error) { cA.CloseWrite(); done <- err }); err != nil {
		t.Fatal(err)
	}
	sent := make(chan [32]byte, 1)
	go func() {
		h := sha256.New()
		buf := make([]byte, 65537)
		for left := size; left > 0; {
			n := min(left, len(buf))
			for i := range buf[:n] {
				buf[i] = byte(left ^ i)
			}
			h.Write(buf[:n])
			st.Write(buf[:n])
			left -= n
		}
		st.CloseWrite()
		var sum [32]byte
		copy(sum[:], h.Sum(nil))
		sent <- sum
	}()
	if s.KernelTLS() {
		// Read nothing until the frame reader has had to queue.
		for s.KernelTLSBytes().CopiedIn == 0 {
			runtime.Gosched()
		}
	}
	got := recvHashed(cB)
	if a, b := <-sent, <-got; a != b {
		t.Fatal("hashes differ")
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	b := s.KernelTLSBytes()
	t.Logf("received: %d spliced, %d copied", b.SplicedIn, b.CopiedIn)
	if s.KernelTLS() && b.SplicedIn+b.CopiedIn != size {
		t.Errorf("spliced %d + copied %d, want %d", b.SplicedIn, b.CopiedIn, size)
	}
}

// TestKernelTLSRelayAllocs: a round trip through two relays over kernel TLS (spliced
// both ways on both ends) allocates nothing.
func TestKernelTLSRelayAllocs(t *testing.T) {
	if testing.CoverMode() != "" || raceEnabled {
		t.Skip("allocation counts need a build without -race and -cover")
	}
	if !kernelHasTLS(t) {
		t.Skip("no kernel TLS here: run `make test-ktls`")
	}
	leaktest.Check(t)
	hA, hB := tcpPair(t)
	served := make(chan struct{})
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		defer close(served)
		st, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer st.Close()
		relay(st, hA)
	})
	cA, cB := tcpPair(t)
	s := e.dial(t, "10.0.0.1:80")
	relayed := make(chan error, 1)
	go func() { _, _, err := relay(s, cA); relayed <- err }()
	buf := make([]byte, 64<<10)
	round := func() {
		if _, err := cB.Write(buf); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(hB, buf); err != nil {
			t.Fatal(err)
		}
		if _, err := hB.Write(buf); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(cB, buf); err != nil {
			t.Fatal(err)
		}
	}
	for range 100 {
		round()
	}
	allocs := testing.AllocsPerRun(200, round)
	b := s.KernelTLSBytes()
	if allocs != 0 {
		t.Errorf("%v allocations per 64 KiB round trip through kernel TLS relays, want 0", allocs)
	}
	if b.CopiedOut != 0 {
		t.Errorf("client copied %d bytes out; want all spliced", b.CopiedOut)
	}
	t.Logf("%v allocs per round; client %+v", allocs, b)
	cB.CloseWrite()
	hB.CloseWrite()
	if err := <-relayed; err != nil {
		t.Fatal(err)
	}
	<-served
}

// TestKernelTLSFallbackAfterHandshake: a connection that learns only from Enable, after
// its handshake, that the kernel cannot take it (here the question before the handshake
// is skipped) carries on in crypto/tls, its records still coalesced.
func TestKernelTLSFallbackAfterHandshake(t *testing.T) {
	leaktest.Check(t)
	defer func(f func(*net.TCPConn) error) { kernelAvailable = f }(kernelAvailable)
	kernelAvailable = func(*net.TCPConn) error { return nil }
	kernel := kernelHasTLS(t)
	var infos tlsInfos
	e := newEnv(t, ServerConfig{Config: Config{OnTLS: infos.add}}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	hashEcho(t, s, 9, 1<<20+1)
	got := infos.take()
	if len(got) != 2 {
		t.Fatalf("OnTLS heard %+v; want two reports", got)
	}
	for _, i := range got {
		if kernel && !i.Kernel || !kernel && (i.Kernel || i.Reason != "no_kernel_tls" || i.Err == nil || i.Err == errKernelMemo) {
			t.Errorf("%+v; want kernel %v, else no_kernel_tls from Enable", i, kernel)
		}
	}
	if s.KernelTLS() != kernel {
		t.Errorf("KernelTLS() = %v", s.KernelTLS())
	}
	if !kernel && s.c.bc == nil {
		t.Error("the fallback lost its coalescing layer")
	}
}

// TestKernelTLSOnlyWithPeersThatKeepKeys: a connection moves to kernel TLS only when the
// peer negotiated NextProtoNoKeyUpdate (gozt both ends); with a server that offers only
// "h2" (the Rust ztunnel) both ends stay in crypto/tls, which follows KeyUpdates, and say
// why. (The question before the handshake is skipped, so a kernel without kernel TLS
// reaches the decision too.)
func TestKernelTLSOnlyWithPeersThatKeepKeys(t *testing.T) {
	leaktest.Check(t)
	defer func(f func(*net.TCPConn) error) { kernelAvailable = f }(kernelAvailable)
	kernelAvailable = func(*net.TCPConn) error { return nil }
	testCA()
	h2Only := srvTLS.Clone()
	h2Only.NextProtos = []string{"h2"}
	for _, tc := range []struct {
		name      string
		serverTLS *tls.Config
		protocol  string
	}{{"gozt peer", srvTLS, NextProtoNoKeyUpdate}, {"h2-only peer", h2Only, "h2"}} {
		t.Run(tc.name, func(t *testing.T) {
			var infos tlsInfos
			e := newEnvTLS(t, ServerConfig{Config: Config{OnTLS: infos.add}}, ClientConfig{Config: Config{OnTLS: infos.add}}, echo, tc.serverTLS)
			s := e.dial(t, "10.0.0.1:80")
			defer s.Close()
			hashEcho(t, s, 3, 64<<10)
			got := infos.take()
			if len(got) != 2 {
				t.Fatalf("OnTLS heard %+v; want two reports", got)
			}
			for _, i := range got {
				kept := !i.Kernel && i.Reason == reasonPeerMayRekey
				if want := tc.protocol == "h2"; kept != want {
					t.Errorf("server %v: %+v; want kept in user space for the peer: %v", i.Server, i, want)
				}
			}
		})
	}
}
