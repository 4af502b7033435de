package hbone

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"net"
	"os"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// ReadFrom from a TCP socket waits for readability without a buffer (readFromPoll); the
// generic path reads into a buffer. Both must carry the same bytes, through every buffer
// size class, and see EOF as the end.
func TestReadFromTCPBothPaths(t *testing.T) {
	bothWays(t, &pollReads, "poll", "generic", func(t *testing.T) {
		leaktest.Check(t)
		e := newEnv(t, ServerConfig{}, echo)
		s := e.dial(t, "10.0.0.1:80")
		defer s.Close()
		a, b := tcpPair(t)
		if got := pollable(b) != nil; got != pollReads {
			t.Fatalf("pollable(*net.TCPConn) = %v, want %v", got, pollReads)
		}
		const size = 20 << 20 // bulk: reads climb through every buffer tier
		go func() {
			io.Copy(a, io.LimitReader(newPRNG(3), size))
			a.CloseWrite()
		}()
		sent := make(chan error, 1)
		go func() {
			n, err := io.Copy(s, b) // *net.TCPConn.WriteTo -> Stream.ReadFrom
			if err == nil && n != size {
				err = errors.New("short copy")
			}
			s.CloseWrite()
			sent <- err
		}()
		h := sha256.New()
		n, err := io.Copy(h, s)
		if err != nil || n != size || !bytes.Equal(h.Sum(nil), hashOf(3, size)) {
			t.Fatalf("echoed %d of %d bytes, err %v", n, size, err)
		}
		if err := <-sent; err != nil {
			t.Fatalf("ReadFrom: %v", err)
		}
	})
}

// A blocked ReadFrom on a TCP socket ends with the socket's read deadline, and with its
// Close, as a blocked Read would.
func TestReadFromPollDeadlineAndClose(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	a, b := tcpPair(t)

	b.SetReadDeadline(time.Now().Add(50 * time.Millisecond))
	a.Write([]byte("before"))
	n, err := s.ReadFrom(b)
	if !errors.Is(err, os.ErrDeadlineExceeded) || n != 6 {
		t.Fatalf("ReadFrom with a deadline = %d, %v; want 6, deadline exceeded", n, err)
	}
	got := make([]byte, 6)
	if _, err := io.ReadFull(s, got); err != nil || string(got) != "before" {
		t.Fatalf("echo of the bytes read before the deadline: %q %v", got, err)
	}

	b.SetReadDeadline(time.Time{})
	done := make(chan error, 1)
	go func() {
		_, err := s.ReadFrom(b)
		done <- err
	}()
	time.Sleep(20 * time.Millisecond) // let ReadFrom park in the poller
	b.Close()
	select {
	case err := <-done:
		if !errors.Is(err, net.ErrClosed) {
			t.Fatalf("ReadFrom after Close: %v, want net.ErrClosed", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("ReadFrom still blocked after the socket was closed")
	}
}

// A peer reset reaches the caller as an error, not as a clean EOF.
func TestReadFromPollReset(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	a, b := tcpPair(t)
	a.SetLinger(0)
	a.Write([]byte("x"))
	time.Sleep(10 * time.Millisecond)
	a.Close() // RST
	if _, err := s.ReadFrom(b); err == nil {
		t.Fatal("ReadFrom from a reset socket returned no error (a reset is not an EOF)")
	}
}

// typeRecorder is an io.ReaderFrom that remembers what ReadFrom was handed.
type typeRecorder struct{ r io.Reader }

func (t *typeRecorder) Write(p []byte) (int, error) { return len(p), nil }
func (t *typeRecorder) ReadFrom(r io.Reader) (int64, error) {
	t.r = r
	return io.Copy(io.Discard, r)
}

// peekedConn is a TCP conn with bytes already read off it (a sniffed prefix): its Read
// returns those first, so ReadFrom must not bypass it with raw socket reads.
type peekedConn struct {
	*net.TCPConn
	r io.Reader
}

func (p *peekedConn) Read(b []byte) (int, error) { return p.r.Read(b) }

func TestPollableTypes(t *testing.T) {
	leaktest.Check(t)
	a, b := tcpPair(t)
	if pollable(b) == nil {
		t.Error("pollable(*net.TCPConn) = nil")
	}
	// io.Copy from a *net.TCPConn reaches ReadFrom through the net package's wrapper.
	a.Write([]byte("x"))
	a.CloseWrite()
	rec := &typeRecorder{}
	if _, err := io.Copy(rec, b); err != nil {
		t.Fatal(err)
	}
	if pollable(rec.r) == nil {
		t.Errorf("pollable(%T) = nil: io.Copy from a TCP conn would not take the poll path", rec.r)
	}
	if pollable(&peekedConn{TCPConn: b}) != nil {
		t.Error("pollable accepts a type that embeds *net.TCPConn and overrides Read")
	}
}

// A wrapper whose Read returns buffered bytes first keeps them: ReadFrom uses its Read.
func TestReadFromWrappedTCPKeepsBufferedBytes(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	a, b := tcpPair(t)
	go func() {
		a.Write([]byte(" world"))
		a.CloseWrite()
	}()
	pc := &peekedConn{TCPConn: b, r: io.MultiReader(bytes.NewReader([]byte("hello")), b)}
	if n, err := s.ReadFrom(pc); err != nil || n != 11 {
		t.Fatalf("ReadFrom = %d, %v; want 11 bytes", n, err)
	}
	s.CloseWrite()
	got, err := io.ReadAll(s)
	if err != nil || string(got) != "hello world" {
		t.Fatalf("echo = %q, %v", got, err)
	}
}

// ReadFrom's buffer follows what reads return, not what the stream has carried: a chatty
// connection stays at 16 KiB however long it lives, bulk data climbs to 1 MiB within two
// full reads, and a stream that turns chatty again steps back down.
func TestCopyBufTiers(t *testing.T) {
	var cb copyBuf
	defer cb.release()
	steps := []struct {
		read     int // bytes the read returned, into a buffer of the current tier
		wantNext int // the next buffer's size
	}{
		{1 << 10, 16 << 10},
		{1 << 10, 16 << 10}, // 1 KiB messages: forever 16 KiB
		{16 << 10, 256 << 10},
		{256 << 10, 1 << 20},
		{1 << 20, 1 << 20},
		{100 << 10, 1 << 20}, // a partial bulk read keeps the tier
		{1 << 10, 256 << 10},
		{2 << 10, 16 << 10},
	}
	for i, st := range steps {
		if got := len(cb.get()); i > 0 && got != steps[i-1].wantNext {
			t.Fatalf("step %d: buffer of %d bytes; want %d", i, got, steps[i-1].wantNext)
		}
		cb.adapt(st.read)
		if got := len(cb.get()); got != st.wantNext {
			t.Fatalf("after a read of %d bytes: next buffer %d bytes; want %d", st.read, got, st.wantNext)
		}
		held := 0
		for _, b := range []bool{cb.b16 != nil, cb.b256 != nil, cb.b1m != nil} {
			if b {
				held++
			}
		}
		if held != 1 {
			t.Fatalf("step %d: %d pooled buffers held; want 1", i, held)
		}
	}
}
