package hbone

import (
	"context"
	"errors"
	"io"
	"net"
	"testing"
	"testing/synctest"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"golang.org/x/net/http2"
)

// WINDOW_UPDATEs are batched: 192 DATA frames (3 MiB) consumed by the handler cost a
// handful of updates, not one per frame.
func TestWindowUpdatesBatched(t *testing.T) {
	leaktest.Check(t)
	const frames = 192
	read := make(chan int64, 1)
	p, _, stop := serveRaw(t, ServerConfig{}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		// ReadFull, not a read to EOF: with END_STREAM already in, a slow handler's reads
		// would owe the peer no stream WINDOW_UPDATE at all.
		n, _ := io.ReadFull(s, make([]byte, frames*16<<10))
		read <- int64(n)
	})
	defer stop()
	p.headers(1, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	p.waitFor(t, "200", func(f frameSummary) bool { return f.typ == http2.FrameHeaders && f.status == "200" })
	chunk := make([]byte, 16<<10)
	for range frames {
		p.write(func() error { return p.fr.WriteData(1, false, chunk) })
	}
	if n := <-read; n != frames*int64(len(chunk)) {
		t.Fatalf("handler read %d bytes", n)
	}
	p.write(func() error { return p.fr.WritePing(false, [8]byte{9}) }) // a marker after the updates
	updates := 0
	for f := range p.frames {
		if f.typ == http2.FrameWindowUpdate && f.stream != 0 {
			updates++
		}
		if f.typ == http2.FramePing {
			break
		}
	}
	if updates < 1 || updates > 4 {
		t.Errorf("%d stream WINDOW_UPDATEs for %d DATA frames (3 MiB, 4 MiB window), want 1-4", updates, frames)
	}
}

// The client side drops a connection whose peer stops answering PINGs, and its streams
// fail. Fake time; the "server" is a hand-driven framer on a pipe.
func TestClientPingTimeout(t *testing.T) {
	leaktest.Check(t)
	synctest.Test(t, func(t *testing.T) {
		a, b := net.Pipe()
		pool := NewPool(ClientConfig{}, nil)
		defer pool.Close()
		fr := http2.NewFramer(b, b)
		go func() { // server: read the preface, send SETTINGS, keep reading, never answer
			var pre [len(http2.ClientPreface)]byte
			io.ReadFull(b, pre[:])
			go io.Copy(io.Discard, b)
			fr.WriteSettings()
		}()
		c, err := pool.startConn(context.Background(), Key{}, a, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		start := time.Now()
		<-c.done
		if d := time.Since(start); d < 20*time.Second || d > 31*time.Second {
			t.Errorf("connection dropped after %v, want 20-30s", d)
		}
		c.mu.Lock()
		err = c.err
		c.mu.Unlock()
		if !errors.Is(err, errPingTimeout) || !errors.Is(err, ErrConnClosed) {
			t.Errorf("connection error %v, want a PING timeout", err)
		}
		b.Close()
	})
}
