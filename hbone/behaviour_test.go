package hbone

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"flag"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"golang.org/x/net/http2"
)

var long = flag.Bool("hbone.long", false, "run the 1 GiB transfer")

func TestHalfCloseClientFirst(t *testing.T) {
	leaktest.Check(t)
	reply := bytes.Repeat([]byte("r"), 1<<20)
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		got, err := io.ReadAll(s) // until the client's END_STREAM
		if err != nil || string(got) != "request" {
			t.Errorf("server read %q %v", got, err)
		}
		s.Write(reply) // the other direction still flows
		s.CloseWrite()
	})
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	s.Write([]byte("request"))
	if err := s.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Write([]byte("x")); err == nil {
		t.Error("Write after CloseWrite succeeded")
	}
	got, err := io.ReadAll(s)
	if err != nil || !bytes.Equal(got, reply) {
		t.Fatalf("client read %d bytes, %v", len(got), err)
	}
}

func TestHalfCloseServerFirst(t *testing.T) {
	leaktest.Check(t)
	upload := bytes.Repeat([]byte("u"), 2<<20)
	done := make(chan []byte, 1)
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		s.Write([]byte("banner"))
		s.CloseWrite() // server finishes first
		got, _ := io.ReadAll(s)
		done <- got
	})
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	got, err := io.ReadAll(s)
	if err != nil || string(got) != "banner" {
		t.Fatalf("client read %q %v", got, err)
	}
	if _, err := s.Write(upload); err != nil {
		t.Fatal(err)
	}
	s.CloseWrite()
	if got := <-done; !bytes.Equal(got, upload) {
		t.Fatalf("server read %d bytes, want %d", len(got), len(upload))
	}
}

// Both directions at once, hashed: exercises ReadFrom/WriteTo, windows and the fact that
// two peers writing bulk at each other do not deadlock.
func TestLargeTransferHashed(t *testing.T) {
	leaktest.Check(t)
	size := int64(64 << 20)
	if *long {
		size = 1 << 30
	}
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			io.Copy(s, io.LimitReader(newPRNG(2), size))
			s.CloseWrite()
		}()
		h := sha256.New()
		n, _ := io.Copy(h, s)
		wg.Wait()
		s.Write(nil)
		if n != size || !bytes.Equal(h.Sum(nil), hashOf(1, size)) {
			t.Errorf("server received %d bytes, hash mismatch or short", n)
		}
	})
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	go func() {
		io.Copy(s, io.LimitReader(newPRNG(1), size))
		s.CloseWrite()
	}()
	h := sha256.New()
	n, err := io.Copy(h, s)
	if err != nil || n != size || !bytes.Equal(h.Sum(nil), hashOf(2, size)) {
		t.Fatalf("client received %d bytes (want %d), err %v, hash ok=%v", n, size, err, bytes.Equal(h.Sum(nil), hashOf(2, size)))
	}
}

type prng struct{ r *rand.ChaCha8 }

func newPRNG(seed byte) io.Reader {
	var s [32]byte
	s[0] = seed
	return prng{rand.NewChaCha8(s)}
}
func (p prng) Read(b []byte) (int, error) { return p.r.Read(b) }

func hashOf(seed byte, size int64) []byte {
	h := sha256.New()
	io.Copy(h, io.LimitReader(newPRNG(seed), size))
	return h.Sum(nil)
}

func TestThousandStreamsOneConnection(t *testing.T) {
	leaktest.Check(t)
	e := newEnvConfigs(t, ServerConfig{MaxConcurrentStreams: 1000}, ClientConfig{MaxStreamsPerConn: 1000}, echo)
	e.dial(t, "10.0.0.1:80").Close() // warm: one connection
	var wg sync.WaitGroup
	start := make(chan struct{})
	for i := range 1000 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			s, err := e.pool.Dial(context.Background(), e.key, "10.0.0.1:80", nil)
			if err != nil {
				t.Errorf("stream %d: %v", i, err)
				return
			}
			defer s.Close()
			msg := bytes.Repeat([]byte{byte(i)}, 1024+i)
			s.Write(msg)
			s.CloseWrite()
			got, err := io.ReadAll(s)
			if err != nil || !bytes.Equal(got, msg) {
				t.Errorf("stream %d: %d bytes, %v", i, len(got), err)
			}
		}()
	}
	close(start)
	wg.Wait()
	if n := e.serverConns(); n != 1 {
		t.Errorf("%d connections, want 1", n)
	}
}

func TestConcurrentFirstDialsShareOneConnection(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	var wg sync.WaitGroup
	for range 20 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := e.pool.Dial(context.Background(), e.key, "10.0.0.1:80", nil)
			if err != nil {
				t.Error(err)
				return
			}
			s.Close()
		}()
	}
	wg.Wait()
	if n := e.serverConns(); n != 1 {
		t.Errorf("%d connections for 20 concurrent first dials, want 1", n)
	}
}

func TestStreamCapacityOverflow(t *testing.T) {
	for _, tc := range []struct {
		name string
		srv  ServerConfig
		cli  ClientConfig
	}{
		{"client limit", ServerConfig{}, ClientConfig{MaxStreamsPerConn: 2}},
		{"peer limit", ServerConfig{MaxConcurrentStreams: 2}, ClientConfig{}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leaktest.Check(t)
			e := newEnvConfigs(t, tc.srv, tc.cli, echo)
			var ss []*Stream
			for range 3 {
				ss = append(ss, e.dial(t, "10.0.0.1:80"))
			}
			if n := e.serverConns(); n != 2 {
				t.Errorf("3 streams with a limit of 2: %d connections, want 2", n)
			}
			for _, s := range ss {
				s.Close()
			}
			// Capacity came back: a new stream reuses a connection.
			e.dial(t, "10.0.0.1:80").Close()
			if n := e.serverConns(); n != 2 {
				t.Errorf("after closing: %d connections, want 2", n)
			}
		})
	}
}

// A server that never reads: the writer blocks once the stream window is used, and the
// server buffers no more than that window.
func TestPeerStopsReading(t *testing.T) {
	leaktest.Check(t)
	const window = 256 << 10
	got := make(chan *Stream, 1)
	release := make(chan struct{})
	e := newEnv(t, ServerConfig{Config: Config{StreamWindow: window}}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		got <- s
		<-release
	})
	defer close(release)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	srvStream := <-got
	s.SetWriteDeadline(time.Now().Add(300 * time.Millisecond))
	buf := make([]byte, 64<<10)
	total := 0
	var err error
	for total < 64<<20 {
		var n int
		n, err = s.Write(buf)
		total += n
		if err != nil {
			break
		}
	}
	if !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Write error %v after %d bytes, want deadline exceeded", err, total)
	}
	if total != window {
		t.Errorf("wrote %d bytes before blocking, want the stream window %d", total, window)
	}
	c := srvStream.c
	c.mu.Lock()
	buffered := srvStream.rb.n
	c.mu.Unlock()
	if buffered > window {
		t.Errorf("server buffered %d bytes, more than the window %d", buffered, window)
	}
}

func TestReadDeadline(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	s.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	if _, err := s.Read(make([]byte, 10)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("Read = %v, want deadline exceeded", err)
	}
	s.SetReadDeadline(time.Time{})
	s.Write([]byte("after"))
	b := make([]byte, 5)
	if _, err := io.ReadFull(s, b); err != nil || string(b) != "after" {
		t.Fatalf("after clearing the deadline: %q %v", b, err)
	}
}

func TestResetSemantics(t *testing.T) {
	leaktest.Check(t)
	serverErr := make(chan error, 1)
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		if r.Authority == "10.0.0.1:1" { // server aborts: client reads the data, then the reset
			s.Write([]byte("partial"))
			s.Close()
			return
		}
		_, err = io.Copy(io.Discard, s) // client aborts
		serverErr <- err
		s.Close()
	})
	s := e.dial(t, "10.0.0.1:1")
	got, err := io.ReadAll(s)
	if re := (*ResetError)(nil); !errors.As(err, &re) || re.Code != http2.ErrCodeCancel || string(got) != "partial" {
		t.Errorf("after peer RST CANCEL: %q %v, want data then a CANCEL ResetError", got, err)
	}
	s.Close()

	s = e.dial(t, "10.0.0.1:2")
	s.Write([]byte("x"))
	s.Close()
	if err := <-serverErr; !errors.As(err, new(*ResetError)) {
		t.Errorf("server read after client RST CANCEL: %v, want a ResetError", err)
	}
	if _, err := s.Write([]byte("x")); err == nil {
		t.Error("Write after Close succeeded")
	}
}

// TestWriteOnResetConnection: a stream's write that fails because the connection's socket
// was reset fails with ErrConnClosed, like its reads: a proxy must not take the socket's
// ECONNRESET or EPIPE for its TCP peer's reset of the stream and carry it as one (the soak
// caught node A doing so, logging a connection node B's crash cut as a success).
func TestWriteOnResetConnection(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, discard)
	var ss []*Stream
	for range 4 {
		ss = append(ss, e.dial(t, "10.0.0.1:80"))
	}
	e.mu.Lock()
	for _, r := range e.raws {
		r.(*net.TCPConn).SetLinger(0)
		r.Close()
	}
	e.mu.Unlock()
	chunk := make([]byte, 64<<10)
	for i, s := range ss {
		var err error
		for err == nil {
			_, err = s.Write(chunk)
		}
		if !errors.Is(err, ErrConnClosed) {
			t.Errorf("stream %d: Write = %v, want ErrConnClosed", i, err)
		}
		s.Close()
	}
}

func TestAbruptCloseMidStream(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	var ss []*Stream
	for range 5 {
		s := e.dial(t, "10.0.0.1:80")
		s.Write([]byte("hi"))
		b := make([]byte, 2)
		io.ReadFull(s, b)
		ss = append(ss, s)
	}
	e.mu.Lock()
	for _, r := range e.raws {
		r.Close()
	}
	e.mu.Unlock()
	for i, s := range ss {
		_, err := io.ReadAll(s)
		if !errors.Is(err, ErrConnClosed) {
			t.Errorf("stream %d: Read = %v, want ErrConnClosed (not a clean EOF)", i, err)
		}
		if _, err := s.Write([]byte("x")); err == nil {
			t.Errorf("stream %d: Write succeeded on a dead connection", i)
		}
		s.Close()
	}
	// The broken connection is never handed out again.
	s := e.dial(t, "10.0.0.1:80")
	s.Close()
	if n := e.serverConns(); n != 2 {
		t.Errorf("%d connections, want 2 (a fresh one after the break)", n)
	}
}

// A pooled connection can go stale: the peer's pod is gone and its IP reused, so the first
// frame written on it draws a reset. A CONNECT that dies that way, unanswered, is retried on
// a new connection; one that dies on a connection its own Dial just made is not, so a peer
// that breaks every connection costs one extra dial, not a loop.
func TestUnansweredConnectOnBrokenConnection(t *testing.T) {
	for _, tc := range []struct {
		name    string
		kills   int  // requests after the first whose connection the peer resets
		wantErr bool // the second Dial fails
	}{
		{"stale pooled connection is retried", 1, false},
		{"fresh connection is not", 2, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leaktest.Check(t)
			var (
				e    *env
				mu   sync.Mutex
				seen int
			)
			e = newEnv(t, ServerConfig{}, func(r *Request) {
				mu.Lock()
				seen++
				kill := seen > 1 && seen <= 1+tc.kills
				mu.Unlock()
				if !kill {
					echo(r)
					return
				}
				e.mu.Lock()
				raw := e.raws[len(e.raws)-1].(*net.TCPConn)
				e.mu.Unlock()
				raw.SetLinger(0) // the reset a reused IP's new owner answers with
				raw.Close()
			})
			e.dial(t, "10.0.0.1:80").Close() // the connection now waits in the pool

			s, err := e.pool.Dial(context.Background(), e.key, "10.0.0.1:80", nil)
			if tc.wantErr {
				if !errors.Is(err, ErrConnClosed) {
					t.Errorf("Dial = %v, want an ErrConnClosed error", err)
				}
			} else if err != nil {
				t.Errorf("Dial = %v, want a retry on a new connection", err)
			} else {
				s.Write([]byte("hi"))
				s.CloseWrite()
				if got, err := io.ReadAll(s); string(got) != "hi" || err != nil {
					t.Errorf("echo through the retried stream = %q, %v", got, err)
				}
				s.Close()
			}
			if n := e.serverConns(); n != 2 {
				t.Errorf("%d connections, want 2 (the pooled one, then one new)", n)
			}
		})
	}
}

func TestGoAwayDrain(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	shut := make(chan error, 1)
	go func() { shut <- e.srv.Shutdown(context.Background()) }()
	// The client learns of the GOAWAY: the connection leaves the pool.
	deadline := time.Now().Add(5 * time.Second)
	for {
		e.pool.mu.Lock()
		n := len(e.pool.keys)
		e.pool.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("GOAWAYed connection still in the pool")
		}
		time.Sleep(5 * time.Millisecond)
	}
	// New streams go elsewhere (here: nowhere, the server is shutting down).
	if _, err := e.pool.Dial(context.Background(), e.key, "10.0.0.1:80", nil); err == nil {
		t.Error("Dial succeeded against a draining server")
	}
	select {
	case err := <-shut:
		t.Fatalf("Shutdown returned %v while a stream was open", err)
	case <-time.After(20 * time.Millisecond):
	}
	// The existing stream finishes normally.
	msg := bytes.Repeat([]byte("d"), 1<<20)
	go func() { s.Write(msg); s.CloseWrite() }()
	got, err := io.ReadAll(s)
	if err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("draining stream: %d bytes, %v", len(got), err)
	}
	s.Close()
	if err := <-shut; err != nil {
		t.Errorf("Shutdown = %v", err)
	}
}

func TestIdleConnectionLeavesPool(t *testing.T) {
	leaktest.Check(t)
	e := newEnvConfigs(t, ServerConfig{}, ClientConfig{IdleTimeout: 50 * time.Millisecond}, echo)
	e.dial(t, "10.0.0.1:80").Close()
	deadline := time.Now().Add(5 * time.Second)
	for {
		e.pool.mu.Lock()
		n := len(e.pool.keys)
		e.pool.mu.Unlock()
		if n == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("idle connection never left the pool")
		}
		time.Sleep(10 * time.Millisecond)
	}
	e.dial(t, "10.0.0.1:80").Close()
	if n := e.serverConns(); n != 2 {
		t.Errorf("%d connections, want 2", n)
	}
}

func TestKeyCanonical(t *testing.T) {
	a := NewKey(mustID("spiffe://td/ns/a/sa/x"), ids("spiffe://td/ns/b/sa/y", "spiffe://td/ns/a/sa/z", "spiffe://td/ns/b/sa/y"), e0, z0)
	b := NewKey(mustID("spiffe://td/ns/a/sa/x"), ids("spiffe://td/ns/a/sa/z", "spiffe://td/ns/b/sa/y"), e0, z0)
	if a != b {
		t.Errorf("keys differ: %+v vs %+v", a, b)
	}
	if got := a.Expected(); len(got) != 2 || got[0].String() != "spiffe://td/ns/a/sa/z" {
		t.Errorf("Expected() = %v", got)
	}
	_ = http.Header{}
}

// TestResetRacingWriteReturnsWindow: a Write that has taken connection window and then
// finds its stream's RST_STREAM already written (a Close raced it for the write lock)
// sends nothing, so the peer never counts those bytes. The window must come back, or
// every such race shrinks the connection's window until no stream on it can send.
func TestResetRacingWriteReturnsWindow(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, discard)
	s := e.dial(t, "10.0.0.1:80")
	c := s.c
	connWindow := func() int64 {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.sendConnAvail
	}
	before := connWindow()

	c.lockWrite() // the Write below takes window, then waits for the write lock
	werr := make(chan error, 1)
	go func() {
		_, err := s.Write(make([]byte, 16<<10))
		werr <- err
	}()
	testutil.Eventually(t, "Write to take connection window", func() bool { return connWindow() != before })
	s.Close()
	if _, err := c.writeOpsWLocked(); err != nil { // the control writer wins: RST_STREAM first
		t.Fatal(err)
	}
	c.unlockWrite()

	if err := <-werr; !errors.Is(err, net.ErrClosed) {
		t.Errorf("Write = %v, want net.ErrClosed", err)
	}
	if got := connWindow(); got != before {
		t.Errorf("connection send window %d after the reset, want %d back", got, before)
	}
}
