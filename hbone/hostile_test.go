package hbone

import (
	"bytes"
	"io"
	"net"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// CVE-2024-27316: HEADERS without END_HEADERS, then CONTINUATION frames forever. The
// header block is cut off at the server's limit and the connection ends, after a
// bounded number of bytes, not when the peer stops.
func TestContinuationFlood(t *testing.T) {
	leaktest.Check(t)
	p, done, stop := serveRaw(t, ServerConfig{}, echo)
	defer stop()
	p.hbuf.Reset()
	p.enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
	p.enc.WriteField(hpack.HeaderField{Name: ":authority", Value: "10.0.0.1:80"})
	p.write(func() error {
		return p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: p.hbuf.Bytes()})
	})
	// Each fragment is a literal header of 16 KiB, never indexed: valid HPACK, so the
	// decoder keeps going until the list is too long.
	var frag bytes.Buffer
	hpack.NewEncoder(&frag).WriteField(hpack.HeaderField{Name: "x-flood", Value: strings.Repeat("a", 16<<10), Sensitive: true})
	sent := 0
	for ; sent < 64<<20; sent += frag.Len() {
		if p.write(func() error { return p.fr.WriteContinuation(1, false, frag.Bytes()) }) != nil {
			break // the server closed the connection
		}
	}
	var err error
	select {
	case err = <-done:
		if err == nil {
			t.Errorf("ServeConn = nil, want a connection error")
		}
		done <- err
	case <-time.After(10 * time.Second):
		t.Fatal("the connection lives on under a CONTINUATION flood")
	}
	if sent >= 64<<20 {
		t.Errorf("the server read %d bytes of one header block before giving up", sent)
	}
	t.Logf("connection ended after %d KiB of CONTINUATION: %v", sent>>10, err)
}

// An HPACK bomb: one large header in the dynamic table, then referenced by its one-byte
// index again and again, decodes to far more than the wire carries. The server stops
// decoding at its header-list limit and answers 400; the connection lives.
func TestHPACKBomb(t *testing.T) {
	leaktest.Check(t)
	p, _, stop := serveRaw(t, ServerConfig{}, echo)
	defer stop()
	var block bytes.Buffer
	enc := hpack.NewEncoder(&block)
	enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
	enc.WriteField(hpack.HeaderField{Name: ":authority", Value: "10.0.0.1:80"})
	big := hpack.HeaderField{Name: "x-bomb", Value: strings.Repeat("b", 4000)}
	enc.WriteField(big) // now in the dynamic table
	before := block.Len()
	for range 4000 {
		enc.WriteField(big) // an indexed reference: one byte
	}
	wire := block.Len()
	p.write(func() error {
		return p.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: block.Bytes(), EndHeaders: true})
	})
	p.waitFor(t, "an answer to the bomb", func(f frameSummary) bool {
		return (f.typ == http2.FrameHeaders && f.status == "400") || f.typ == http2.FrameRSTStream || f.typ == http2.FrameGoAway
	})
	p.write(func() error { return p.fr.WritePing(false, [8]byte{3}) })
	p.waitFor(t, "PING ack: the connection lives", func(f frameSummary) bool { return f.typ == http2.FramePing })
	t.Logf("%d bytes on the wire (%d of references) decode to %d MB", wire, wire-before, 4001*(len(big.Name)+len(big.Value))>>20)
}

// Connections that never start TLS, or stall halfway through the ClientHello
// (slowloris), are dropped at the handshake deadline; until then each costs a goroutine
// and a socket, and nothing is left afterwards.
func TestStalledHandshakesDropped(t *testing.T) {
	leaktest.Check(t)
	const deadline = 300 * time.Millisecond
	e := newEnv(t, ServerConfig{Config: Config{DialTimeout: deadline}, Admission: AdmissionConfig{SourceHandshakes: -1, SourceHandshakeRate: -1, SourceFailedHandshakes: -1}}, echo) // the per-source budgets: admission_test.go
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	heap0, g0 := ms.HeapInuse, runtime.NumGoroutine()
	const n = 200
	var conns []net.Conn
	for i := range n {
		c, err := net.Dial("tcp", e.ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		if i%2 == 1 { // half of a TLS record header and a few bytes of a ClientHello
			c.Write([]byte{0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00})
		}
		conns = append(conns, c)
	}
	time.Sleep(deadline / 3)
	runtime.ReadMemStats(&ms)
	t.Logf("%d stalled handshakes: %d goroutines, %.1f KiB of heap each", n, runtime.NumGoroutine()-g0, float64(int64(ms.HeapInuse)-int64(heap0))/n/1024)
	start := time.Now()
	for i, c := range conns {
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.Copy(io.Discard, c); err != nil { // EOF (nil) when the server closes
			t.Fatalf("connection %d: %v, want the server to close it", i, err)
		}
		c.Close()
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("stalled handshakes dropped after %v, want about %v", d, deadline)
	}
}

// Past MaxHandshakes, the oldest connection still in its handshake is dropped for the
// newcomer: a flood of stalled handshakes holds at most the limit, and an honest client
// arriving after it gets through at once, long before the stalled ones' deadline.
func TestStalledHandshakesEvicted(t *testing.T) {
	leaktest.Check(t)
	const limit, stalled = 20, 100
	var evicted atomic.Int64
	// From one source, as here, the per-source budgets would refuse most of them first
	// (admission_test.go); this is the node-wide limit.
	e := newEnv(t, ServerConfig{Config: Config{DialTimeout: time.Minute, OnDrop: func(r DropReason) {
		if r == DropHandshakeEvicted {
			evicted.Add(1)
		}
	}}, MaxHandshakes: limit, Admission: AdmissionConfig{SourceHandshakes: -1, SourceHandshakeRate: -1, SourceFailedHandshakes: -1}}, echo)
	var conns []net.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	for range stalled {
		c, err := net.Dial("tcp", e.ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	testutil.Eventually(t, "the server to hold every stalled connection it has not dropped", func() bool {
		return e.serverConns() == stalled
	})
	testutil.Eventually(t, "the handshakes past the limit to be dropped", func() bool { return evicted.Load() == stalled-limit })
	// The oldest by the server's clock: its goroutines may start in another order than
	// the dials were made.
	dropped := 0
	for _, c := range conns {
		c.SetReadDeadline(time.Now().Add(100 * time.Millisecond))
		if _, err := c.Read(make([]byte, 1)); err == io.EOF {
			dropped++
		}
	}
	if dropped != stalled-limit {
		t.Errorf("%d of %d stalled connections closed by the server; want %d, the rest waiting", dropped, stalled, stalled-limit)
	}
	s := e.dial(t, "10.0.0.1:80") // one handshake more: the oldest stalled one makes room
	defer s.Close()
	if err := pingEchoStream(s); err != nil {
		t.Fatalf("honest client after a flood of stalled handshakes: %v", err)
	}
	if got := evicted.Load(); got != stalled-limit+1 {
		t.Errorf("%d handshakes dropped; want %d", got, stalled-limit+1)
	}
}
