package hbone

import (
	"sync/atomic"
	"testing"

	"golang.org/x/net/http2"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// Handlers of one connection's streams start within StreamStarts (a burst of ¼ s of it, at
// least one):
// past it a new stream waits, with no goroutine, until a stream that started carries a
// byte (its start is given back) or the budget refills; another connection of the same
// identity starts its streams at once meanwhile. Here the burst is one start and a refill
// takes 1 s.
func TestStreamStartsBudget(t *testing.T) {
	leaktest.Check(t)
	var drops dropCounts
	var started atomic.Int32
	h := func(r *Request) {
		started.Add(1)
		echo(r)
	}
	e := newEnv(t, ServerConfig{Config: Config{OnDrop: drops.hook}, Admission: AdmissionConfig{StreamStarts: 1}}, h)
	p := floodPeer(t, e.addr.String())
	for _, id := range []uint32{1, 3, 5} {
		p.headers(id, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	}
	ok := func(id uint32) func(frameSummary) bool {
		return func(f frameSummary) bool { return f.typ == http2.FrameHeaders && f.status == "200" && f.stream == id }
	}
	p.waitFor(t, "stream 1 answered", ok(1))
	testutil.Eventually(t, "streams 3 and 5 to wait for a start", func() bool { return drops[DropStreamStarts].Load() >= 1 })
	if n := started.Load(); n != 1 {
		t.Errorf("%d handlers started; want 1, the others waiting", n)
	}
	// Another connection of the same identity has starts of its own.
	q := floodPeer(t, e.addr.String())
	q.headers(1, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	q.waitFor(t, "the second connection's stream answered", ok(1))
	// A byte on stream 1 gives its start back: stream 3 starts at once, before the refill,
	// which then starts stream 5.
	p.write(func() error { return p.fr.WriteData(1, false, []byte("x")) })
	p.waitFor(t, "stream 3 answered once stream 1 carried a byte", ok(3))
	p.waitFor(t, "stream 5 answered once the budget refilled", ok(5))
	if n := started.Load(); n != 4 {
		t.Errorf("%d handlers started; want 4", n)
	}
}
