package hbone

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"net"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

type deliverResult struct {
	n   int64
	err error
}

// deliver starts DeliverTo into one end of a fresh TCP pair and returns the other end and
// the channel done reports on.
func deliver(t *testing.T, s *Stream) (*net.TCPConn, chan deliverResult) {
	t.Helper()
	a, b := tcpPair(t)
	done := make(chan deliverResult, 2) // 2: a second call would be a bug the test reports
	if err := s.DeliverTo(a, func(n int64, err error) {
		a.CloseWrite()
		done <- deliverResult{n, err}
	}); err != nil {
		t.Fatal(err)
	}
	return b, done
}

func waitDone(t *testing.T, done chan deliverResult) deliverResult {
	t.Helper()
	select {
	case r := <-done:
		select {
		case r2 := <-done:
			t.Fatalf("done called twice: %+v then %+v", r, r2)
		case <-time.After(50 * time.Millisecond):
		}
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("done was not called")
		return deliverResult{}
	}
}

// Every byte arrives in order, through both the frame reader's direct writes and the drain
// goroutine (a consumer that stalls makes the socket refuse writes), and done reports the
// count and a clean end once, after END_STREAM.
func TestDeliverToCarriesEveryByte(t *testing.T) {
	bothWays(t, &directDelivery, "direct", "buffered", func(t *testing.T) {
		leaktest.Check(t)
		e := newEnv(t, ServerConfig{}, echo)
		s := e.dial(t, "10.0.0.1:80")
		defer s.Close()
		out, done := deliver(t, s)
		const size = 24 << 20
		go func() {
			io.Copy(s, io.LimitReader(newPRNG(5), size))
			s.CloseWrite()
		}()
		h := sha256.New()
		var got int64
		buf := make([]byte, 64<<10)
		for {
			if got > 4<<20 && got < 5<<20 {
				time.Sleep(time.Millisecond) // stall: the socket buffer fills, the drain path runs
			}
			n, err := out.Read(buf)
			h.Write(buf[:n])
			got += int64(n)
			if err == io.EOF {
				break
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		if got != size || !bytes.Equal(h.Sum(nil), hashOf(5, size)) {
			t.Fatalf("got %d of %d bytes, or different ones", got, size)
		}
		if r := waitDone(t, done); r.err != nil || r.n != size {
			t.Fatalf("done(%d, %v); want (%d, nil)", r.n, r.err, size)
		}
	})
}

// An idle delivering stream holds no goroutine: with many streams delivering and no data
// moving, the goroutine count does not grow with them.
func TestDeliverToIdleHoldsNoGoroutine(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	const streams = 50
	before := runtime.NumGoroutine()
	var ss []*Stream
	for range streams {
		s := e.dial(t, "10.0.0.1:80")
		ss = append(ss, s)
		deliver(t, s)
	}
	// The server's echo handlers each hold a goroutine (the peer's business); ours hold none.
	time.Sleep(50 * time.Millisecond)
	if grown := runtime.NumGoroutine() - before; grown > streams+10 {
		t.Errorf("%d goroutines more for %d idle delivering streams; want about one per server handler only", grown, streams)
	}
	for _, s := range ss {
		s.Close()
	}
}

// A reset from the peer, a local Close and a lost connection each end delivery with an
// error, once.
func TestDeliverToEnds(t *testing.T) {
	t.Run("peer reset", func(t *testing.T) {
		leaktest.Check(t)
		e := newEnv(t, ServerConfig{}, func(r *Request) {
			s, err := r.Accept(nil)
			if err != nil {
				return
			}
			s.Write([]byte("partial"))
			time.Sleep(20 * time.Millisecond)
			s.Close() // RST_STREAM(CANCEL) before END_STREAM: the data, then the reset
		})
		s := e.dial(t, "10.0.0.1:80")
		defer s.Close()
		out, done := deliver(t, s)
		b, _ := io.ReadAll(out)
		if string(b) != "partial" {
			t.Errorf("delivered %q, want %q", b, "partial")
		}
		if r := waitDone(t, done); !errors.As(r.err, new(*ResetError)) || r.n != 7 {
			t.Errorf("done(%d, %v) after RST_STREAM(CANCEL); want (7, a ResetError)", r.n, r.err)
		}
	})
	t.Run("local close", func(t *testing.T) {
		leaktest.Check(t)
		e := newEnv(t, ServerConfig{}, echo)
		s := e.dial(t, "10.0.0.1:80")
		_, done := deliver(t, s)
		s.Close()
		if r := waitDone(t, done); !errors.Is(r.err, net.ErrClosed) {
			t.Errorf("done(%d, %v) after Close; want net.ErrClosed", r.n, r.err)
		}
	})
	t.Run("connection lost", func(t *testing.T) {
		leaktest.Check(t)
		e := newEnv(t, ServerConfig{}, echo)
		s := e.dial(t, "10.0.0.1:80")
		defer s.Close()
		_, done := deliver(t, s)
		e.mu.Lock()
		for _, raw := range e.raws {
			raw.Close()
		}
		e.mu.Unlock()
		if r := waitDone(t, done); !errors.Is(r.err, ErrConnClosed) {
			t.Errorf("done(%d, %v) after the connection dropped; want ErrConnClosed", r.n, r.err)
		}
	})
	t.Run("second reader refused", func(t *testing.T) {
		leaktest.Check(t)
		e := newEnv(t, ServerConfig{}, echo)
		s := e.dial(t, "10.0.0.1:80")
		_, done := deliver(t, s)
		a, _ := tcpPair(t)
		if err := s.DeliverTo(a, func(int64, error) { t.Error("second done called") }); err == nil {
			t.Error("a second DeliverTo on the same stream succeeded")
		}
		s.Close()
		waitDone(t, done)
	})
}

// A clean END_STREAM with nothing left to write ends delivery on the frame reader itself:
// starting a goroutine only to call done costs a wakeup per proxied connection.
func TestDeliverToEndsOnFrameReader(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	a, b := tcpPair(t)
	stacks := make(chan string, 1)
	if err := s.DeliverTo(a, func(n int64, err error) {
		buf := make([]byte, 64<<10)
		stacks <- string(buf[:runtime.Stack(buf, false)])
	}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, 5)
	if _, err := io.ReadFull(b, got); err != nil || string(got) != "hello" {
		t.Fatalf("read %q, %v", got, err)
	}
	s.CloseWrite() // the echo handler answers with END_STREAM
	select {
	case st := <-stacks:
		if !strings.Contains(st, "(*conn).readLoop") {
			t.Errorf("done ran off the frame reader:\n%s", st)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("done was not called")
	}
}

// A Close while the frame reader's direct write is in flight (the proxy aborting the other
// direction) drops what the socket did not take. Those bytes were counted against the
// connection's receive window, so they must be released, or the peer's send window
// shrinks for good with every such race.
func TestCloseDuringDirectWriteReleasesWindow(t *testing.T) {
	leaktest.Check(t)
	send := make(chan struct{})
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		<-send
		s.Write(make([]byte, 1000))
		io.Copy(io.Discard, s)
	})
	s := e.dial(t, "10.0.0.1:80")
	_, done := deliver(t, s)
	c := s.c
	c.mu.Lock()
	c.sinkWrite = func(uintptr) bool { // the socket takes nothing, and the stream is closed meanwhile
		s.Close()
		c.directN = 0
		return true
	}
	c.mu.Unlock()
	close(send)
	if r := waitDone(t, done); !errors.Is(r.err, net.ErrClosed) {
		t.Fatalf("DeliverTo ended with %v, want net.ErrClosed", r.err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if held := int64(c.cfg.ConnWindow) - (c.recvConnAvail + c.connUnacked); held != 0 {
		t.Errorf("%d bytes of connection window still held after the stream closed, want 0", held)
	}
}

// A drain goroutine is the connection's: Pool.Close returns only after it has, and a
// DeliverTo on a stream whose connection already closed delivers what was queued before
// it returns, with no goroutine left behind.
func TestDeliverToDrainsAreWaitedFor(t *testing.T) {
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	out, done := deliver(t, s)
	// Fill out's socket buffers so the rest waits in the stream's queue for a drain.
	const size = 8 << 20
	go func() { io.Copy(s, io.LimitReader(newPRNG(7), size)) }()
	testutil.Eventually(t, "a drain goroutine to start once out is full", func() bool { return drainsRunning() > 0 })
	closed := make(chan struct{})
	go func() { e.pool.Close(); close(closed) }()
	select {
	case <-closed:
		t.Fatalf("Pool.Close returned with %d drain goroutines blocked on a full socket", drainsRunning())
	case <-time.After(200 * time.Millisecond):
	}
	go io.Copy(io.Discard, out) // the drain can finish now
	<-closed
	select {
	case <-done: // a drain's last act
	default:
		t.Error("Pool.Close returned before the drain had ended DeliverTo")
	}

	// A stream whose connection closed with data queued.
	e2 := newEnv(t, ServerConfig{}, func(r *Request) {
		w, err := r.Accept(nil)
		if err != nil {
			return
		}
		w.Write([]byte("last words"))
		w.CloseWrite()
	})
	s2 := e2.dial(t, "10.0.0.1:80")
	testutil.Eventually(t, "the server's reply", func() bool {
		s2.c.mu.Lock()
		defer s2.c.mu.Unlock()
		return s2.recvEnd
	})
	e2.pool.Close()
	out2, done2 := deliver(t, s2)
	select {
	case r := <-done2:
		if r.err != nil || r.n != int64(len("last words")) {
			t.Errorf("DeliverTo on a closed connection: done(%d, %v); want %d bytes, nil", r.n, r.err, len("last words"))
		}
	default:
		t.Fatal("DeliverTo on a closed connection returned before calling done")
	}
	if got, _ := io.ReadAll(out2); string(got) != "last words" {
		t.Errorf("delivered %q; want %q", got, "last words")
	}
}

// drainsRunning counts goroutines in a DeliverTo drain.
func drainsRunning() int {
	buf := make([]byte, 1<<20)
	return strings.Count(string(buf[:runtime.Stack(buf, true)]), "hbone.(*Stream).drainCounted")
}
