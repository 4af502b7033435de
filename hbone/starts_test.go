package hbone

import (
	"net/http"
	"sync/atomic"
	"testing"

	"golang.org/x/net/http2"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
)

// noRefill is a StreamStarts so low that its budget never refills within a test (one
// start per 1,000 s, a burst of one): a stream that starts after the first did so because
// a start was given back.
const noRefill = 0.001

// answered matches stream id's answer with status.
func answered(id uint32, status string) func(frameSummary) bool {
	return func(f frameSummary) bool { return f.typ == http2.FrameHeaders && f.status == status && f.stream == id }
}

// Handlers of one connection's streams start within StreamStarts (a burst of ¼ s of it, at
// least one): past it a new stream waits, with no goroutine, until a stream that started
// carries a byte or ends (its start is given back) or the budget refills; another
// connection of the same identity starts its streams at once meanwhile.
func TestStreamStartsBudget(t *testing.T) {
	leaktest.Check(t)
	var drops dropCounts
	var started atomic.Int32
	h := func(r *Request) {
		started.Add(1)
		echo(r)
	}
	e := newEnv(t, ServerConfig{Config: Config{OnDrop: drops.hook}, Admission: AdmissionConfig{StreamStarts: noRefill}}, h)
	p := floodPeer(t, e.addr.String())
	for _, id := range []uint32{1, 3, 5} {
		p.headers(id, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	}
	p.waitFor(t, "stream 1 answered", answered(1, "200"))
	testutil.Eventually(t, "streams 3 and 5 to wait for a start", func() bool { return drops[DropStreamStarts].Load() >= 1 })
	if n := started.Load(); n != 1 {
		t.Errorf("%d handlers started; want 1, the others waiting", n)
	}
	// Another connection of the same identity has starts of its own.
	q := floodPeer(t, e.addr.String())
	q.headers(1, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	q.waitFor(t, "the second connection's stream answered", answered(1, "200"))
	// A byte on stream 1 gives its start back: stream 3 starts (the budget does not refill
	// within the test).
	p.write(func() error { return p.fr.WriteData(1, false, []byte("x")) })
	p.waitFor(t, "stream 3 answered once stream 1 carried a byte", answered(3, "200"))
	if n := started.Load(); n != 3 {
		t.Errorf("%d handlers started; want 3, stream 5 still waiting", n)
	}
	// Stream 3 ends without a byte: its start goes back too, and stream 5 starts.
	p.write(func() error { return p.fr.WriteRSTStream(3, http2.ErrCodeCancel) })
	p.waitFor(t, "stream 5 answered once stream 3 ended", answered(5, "200"))
	if n := started.Load(); n != 4 {
		t.Errorf("%d handlers started; want 4", n)
	}
}

// TestStreamStartGivenBackByAnswer: a handler that answers without a byte (a 5xx, a
// denial) gives its start back as its stream ends, so the next stream starts at once
// rather than when the budget refills (never, here).
func TestStreamStartGivenBackByAnswer(t *testing.T) {
	leaktest.Check(t)
	h := func(r *Request) {
		switch r.Authority {
		case "10.0.0.1:81":
			r.Reject(http.StatusServiceUnavailable)
		case "10.0.0.1:82":
			r.Reject(http.StatusUnauthorized)
		case "10.0.0.1:83": // returns without answering: the server answers 503
		default:
			echo(r)
		}
	}
	e := newEnv(t, ServerConfig{Admission: AdmissionConfig{StreamStarts: noRefill}}, h)
	p := floodPeer(t, e.addr.String())
	steps := []struct {
		authority, status string
	}{{"10.0.0.1:81", "503"}, {"10.0.0.1:82", "401"}, {"10.0.0.1:83", "503"}, {"10.0.0.1:80", "200"}}
	for i, s := range steps {
		p.headers(uint32(2*i+1), false, ":method", "CONNECT", ":authority", s.authority)
	}
	for i, s := range steps {
		p.waitFor(t, "stream "+s.authority+" answered "+s.status, answered(uint32(2*i+1), s.status))
	}
}

// TestStreamStartsBurstOfUsedStreams: a burst of streams that each carry a byte as soon as
// they are answered all start, one after another, although the budget never refills: in
// first-in first-out order, each waiting only for the streams before it to be used.
func TestStreamStartsBurstOfUsedStreams(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{Admission: AdmissionConfig{StreamStarts: noRefill}}, echo)
	p := floodPeer(t, e.addr.String())
	const n = 50
	for i := range n {
		p.headers(uint32(2*i+1), false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	}
	for i := range n {
		id := uint32(2*i + 1)
		p.waitFor(t, "the next stream of the burst answered", answered(id, "200"))
		p.write(func() error { return p.fr.WriteData(id, false, []byte("x")) })
	}
}
