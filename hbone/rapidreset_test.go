package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"golang.org/x/net/http2"
)

// openFDs counts this process's open file descriptors.
func openFDs(t testing.TB) int {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd:", err)
	}
	return len(ents)
}

// peaks samples goroutines and fds every few milliseconds until stop is called, and
// returns the highest of each.
func peaks(t testing.TB) (stop func() (goroutines, fds int)) {
	done := make(chan struct{})
	var g, f int
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		tick := time.NewTicker(5 * time.Millisecond)
		defer tick.Stop()
		for {
			g = max(g, runtime.NumGoroutine())
			f = max(f, openFDs(t))
			select {
			case <-done:
				return
			case <-tick.C:
			}
		}
	}()
	return func() (int, int) { close(done); wg.Wait(); return g, f }
}

// rapidReset attacks addr as a hostile peer would, until d has passed: over an mTLS
// connection, HEADERS(CONNECT authority) then at once RST_STREAM(CANCEL), in a loop;
// when the server ends the connection, again on a new one. It returns the streams it
// opened, the connections it used and how many of them ended with GOAWAY
// ENHANCE_YOUR_CALM.
func rapidReset(t testing.TB, addr, authority string, d time.Duration) (streams, conns, calmed int) {
	for deadline := time.Now().Add(d); time.Now().Before(deadline); {
		n, code := rapidResetConn(t, addr, authority, deadline)
		streams += n
		conns++
		if code == http2.ErrCodeEnhanceYourCalm {
			calmed++
		}
	}
	return streams, conns, calmed
}

const noGoAway = http2.ErrCode(1<<32 - 1)

// rapidResetConn is one connection of rapidReset; it returns the streams it opened and
// the GOAWAY code it got (noGoAway: none).
func rapidResetConn(t testing.TB, addr, authority string, deadline time.Time) (int, http2.ErrCode) {
	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Error(err)
		return 0, noGoAway
	}
	tc := tls.Client(raw, cliTLS)
	if err := tc.Handshake(); err != nil {
		t.Error(err)
		return 0, noGoAway
	}
	p := newRawPeer(tc, true)
	defer func() { tc.Close(); <-p.done }()
	var code atomic.Int64
	code.Store(-1)
	go func() { // keep reading so the server's writes never block on us
		for f := range p.frames {
			if f.typ == http2.FrameGoAway {
				code.CompareAndSwap(-1, int64(f.code))
			}
		}
	}()
	streams := 0
	for id := uint32(1); time.Now().Before(deadline) && code.Load() < 0; id += 2 {
		if p.headers(id, false, ":method", "CONNECT", ":authority", authority) != nil {
			break
		}
		if p.write(func() error { return p.fr.WriteRSTStream(id, http2.ErrCodeCancel) }) != nil {
			break
		}
		streams++
	}
	// Wait for the server's answer; it may still be on its way when the deadline ends the loop.
	for end := time.Now().Add(2 * time.Second); code.Load() < 0 && time.Now().Before(end); {
		time.Sleep(5 * time.Millisecond)
	}
	return streams, http2.ErrCode(code.Load())
}

// TestRapidReset is CVE-2023-44487 against a proxy-like server: several mTLS connections
// open CONNECT streams to a real backend and reset each at once. At most
// MAX_CONCURRENT_STREAMS handlers run per connection, however early their streams were
// reset, so the handlers (and their backend sockets) stay within the limit; the attackers
// are told GOAWAY ENHANCE_YOUR_CALM; and a well-behaved client on another connection
// keeps working.
func TestRapidReset(t *testing.T) {
	leaktest.Check(t)
	backend, stopBackend := tcpEcho(t)
	defer stopBackend()
	const maxStreams, attackers = 20, 4
	var refused, early, calm atomic.Int64
	// The per-connection limits: the per-node budgets would slow the attackers'
	// reconnects after each calm close, and refuse them (admission_test.go).
	cfg := ServerConfig{MaxConcurrentStreams: maxStreams, Admission: AdmissionConfig{SourceHandshakeRate: -1, PeerConnRate: -1}}
	cfg.OnDrop = func(r DropReason) {
		switch r {
		case DropRefused:
			refused.Add(1)
		case DropResetUnanswered:
			early.Add(1)
		case DropConnCalm:
			calm.Add(1)
		}
	}
	e := newEnv(t, cfg, proxyTo(backend))

	// Warm up: the victim's connection exists before the attack.
	victim := e.dial(t, "10.0.0.1:80")
	victim.Close()
	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)
	g0, f0 := runtime.NumGoroutine(), openFDs(t)

	stopPeaks := peaks(t)
	victimDone := make(chan int)
	attackOver := make(chan struct{})
	go func() { // the victim: request/response through the same server until the attack ends
		n := 0
		defer func() { victimDone <- n }()
		msg := bytes.Repeat([]byte("v"), 512)
		buf := make([]byte, len(msg))
		for {
			select {
			case <-attackOver:
				return
			default:
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			s, err := e.pool.Dial(ctx, e.key, "10.0.0.1:80", nil)
			cancel()
			if err != nil {
				t.Errorf("victim request %d: %v", n, err)
				return
			}
			s.SetDeadline(time.Now().Add(5 * time.Second))
			_, err = s.Write(msg)
			if err == nil {
				_, err = io.ReadFull(s, buf)
			}
			s.Close()
			if err != nil {
				t.Errorf("victim request %d: %v", n, err)
				return
			}
			n++
		}
	}()
	var wg sync.WaitGroup
	var opened, conns, calmed atomic.Int64
	for range attackers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			n, c, k := rapidReset(t, e.ln.Addr().String(), "10.0.0.1:80", 2*time.Second)
			opened.Add(int64(n))
			conns.Add(int64(c))
			calmed.Add(int64(k))
		}()
	}
	wg.Wait()
	close(attackOver)
	served := <-victimDone
	gPeak, fPeak := stopPeaks()

	// Every attacking connection but maybe the last of each attacker (cut by the
	// deadline) must have been told to calm down. The server counts them all; a GOAWAY
	// can be lost on the wire when the server's close meets the attacker's next frames
	// (the reset discards what the attacker has not read), so the attackers must only
	// have seen some.
	if k := calm.Load(); k < conns.Load()-attackers || calmed.Load() == 0 {
		t.Errorf("%d of %d attacking connections closed with ENHANCE_YOUR_CALM, %d GOAWAYs seen", k, conns.Load(), calmed.Load())
	}
	// Per connection: maxStreams handlers, each with a copy goroutine, plus the
	// connection's reader, writer and serve goroutines; 50 for the test's own.
	if limit := g0 + attackers*(2*maxStreams+4) + 50; gPeak > limit {
		t.Errorf("goroutines peaked at %d during the attack (before: %d), want at most %d", gPeak, g0, limit)
	}
	// Per attacker: maxStreams backend connections, two fds each in this process (and
	// the backend's side closes a moment after ours, so up to half as many again), its
	// connection's two ends and those of the one it just left; 30 spare.
	if limit := f0 + attackers*(3*maxStreams+4) + 30; fPeak > limit {
		t.Errorf("fds peaked at %d during the attack (before: %d), want at most %d", fPeak, f0, limit)
	}
	if served < 50 {
		t.Errorf("the victim completed %d requests in the 2 s of the attack, want at least 50", served)
	}
	if early.Load() == 0 {
		t.Errorf("drops counted: refused %d, reset unanswered %d; want streams reset unanswered", refused.Load(), early.Load())
	}
	t.Logf("%d attacking streams on %d connections (%d calmed, %d GOAWAYs seen); victim served %d; peaks: %d goroutines (from %d), %d fds (from %d); refused %d, reset unanswered %d",
		opened.Load(), conns.Load(), calm.Load(), calmed.Load(), served, gPeak, g0, fPeak, f0, refused.Load(), early.Load())

	// Memory returns: what the attack allocated is garbage once its connections are gone.
	testutil.Eventually(t, "heap in use back within 8 MiB of its size before the attack", func() bool {
		runtime.GC()
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		return after.HeapInuse < before.HeapInuse+8<<20
	})
}

// A reset ends the Request's context at once, with ErrPeerReset as its cause, so the
// handler's dial stops; Accept afterwards fails without harming the connection.
func TestResetEndsRequestContext(t *testing.T) {
	leaktest.Check(t)
	started := make(chan struct{})
	causes := make(chan error, 1)
	accepted := make(chan error, 1)
	p, _, stop := serveRaw(t, ServerConfig{}, func(r *Request) {
		close(started)
		<-r.Context().Done()
		causes <- context.Cause(r.Context())
		_, err := r.Accept(nil)
		accepted <- err
	})
	defer stop()
	p.headers(1, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	<-started // a stream reset before its handler starts never runs one
	p.write(func() error { return p.fr.WriteRSTStream(1, http2.ErrCodeCancel) })
	select {
	case err := <-causes:
		if err != ErrPeerReset {
			t.Errorf("context cause = %v, want ErrPeerReset", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the request's context did not end when the peer reset the stream")
	}
	if err := <-accepted; !errors.Is(err, ErrPeerReset) {
		t.Errorf("Accept after the reset = %v, want ErrPeerReset", err)
	}
	p.write(func() error { return p.fr.WritePing(false, [8]byte{7}) })
	p.waitFor(t, "PING ack: the connection lives", func(f frameSummary) bool { return f.typ == http2.FramePing })
}

// Each flood of frames that make the server work but carry nothing ends in GOAWAY
// ENHANCE_YOUR_CALM, on both sides of a connection.
func TestFloodsGetCalm(t *testing.T) {
	connect := func(p *rawPeer, id uint32) { p.headers(id, false, ":method", "CONNECT", ":authority", "10.0.0.1:80") }
	for _, tc := range []struct {
		name string
		send func(p *rawPeer, i int)
	}{
		{"PING", func(p *rawPeer, i int) { p.write(func() error { return p.fr.WritePing(false, [8]byte{byte(i)}) }) }},
		{"SETTINGS", func(p *rawPeer, i int) { p.write(func() error { return p.fr.WriteSettings() }) }},
		{"PRIORITY", func(p *rawPeer, i int) {
			p.write(func() error { return p.fr.WritePriority(1, http2.PriorityParam{Weight: 1}) })
		}},
		{"empty DATA", func(p *rawPeer, i int) {
			if i == 0 {
				connect(p, 1)
			}
			p.write(func() error { return p.fr.WriteData(1, false, nil) })
		}},
		{"tiny WINDOW_UPDATE", func(p *rawPeer, i int) { p.write(func() error { return p.fr.WriteWindowUpdate(0, 1) }) }},
		{"unknown frame type", func(p *rawPeer, i int) {
			p.write(func() error { return p.fr.WriteRawFrame(0xfa, 0, 0, []byte("x")) })
		}},
		{"RST_STREAM of an ended stream", func(p *rawPeer, i int) {
			if i == 0 {
				connect(p, 1)
				p.write(func() error { return p.fr.WriteRSTStream(1, http2.ErrCodeCancel) })
			}
			p.write(func() error { return p.fr.WriteRSTStream(1, http2.ErrCodeCancel) })
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			leaktest.Check(t)
			p, done, stop := serveRaw(t, ServerConfig{}, echo)
			defer stop()
			for i := 0; i < 10*junkBurst; i++ {
				tc.send(p, i)
				select {
				case <-p.done:
					i = 10 * junkBurst
				default:
				}
			}
			p.waitFor(t, "GOAWAY ENHANCE_YOUR_CALM", func(f frameSummary) bool {
				return f.typ == http2.FrameGoAway && f.code == http2.ErrCodeEnhanceYourCalm
			})
			if err := <-done; err == nil || !strings.Contains(err.Error(), "ENHANCE_YOUR_CALM") {
				t.Errorf("ServeConn = %v, want an ENHANCE_YOUR_CALM connection error", err)
			}
			done <- nil
		})
	}
}

// The control frames we owe a peer queue for the writer; past maxQueuedControl the queue
// stops growing and the frame reader ends the connection (the budgets above stop every
// flood we could build first, so this is the backstop, tested on its own).
func TestControlQueueBounded(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	c := newConn(ServerConfig{}.withDefaults().conn(), true, a, nil, nil)
	c.mu.Lock()
	for range maxQueuedControl + 10 {
		c.queueLocked(ctrlOp{kind: opPingAck})
	}
	n := len(c.ops)
	c.mu.Unlock()
	if n != maxQueuedControl || !c.flooded.Load() {
		t.Fatalf("queued %d control frames (flooded %v), want %d and flooded", n, c.flooded.Load(), maxQueuedControl)
	}
	go func() { // one frame for the reader, which then sees the flood
		b.Write([]byte{0, 0, 0, byte(http2.FrameSettings), 0, 0, 0, 0, 0})
	}()
	err := c.readLoop()
	var ce connError
	if !errors.As(err, &ce) || ce.Code != http2.ErrCodeEnhanceYourCalm {
		t.Errorf("readLoop = %v, want ENHANCE_YOUR_CALM", err)
	}
}

// A client that opens more streams than MAX_CONCURRENT_STREAMS gets REFUSED_STREAM for
// the extra ones, and GOAWAY ENHANCE_YOUR_CALM once it has kept on long enough.
func TestStreamsPastLimitRefused(t *testing.T) {
	leaktest.Check(t)
	const limit = 5
	release := make(chan struct{})
	p, done, stop := serveRaw(t, ServerConfig{MaxConcurrentStreams: limit}, func(r *Request) {
		s, err := r.Accept(nil)
		if err == nil {
			select { // hold the stream open
			case <-release:
			case <-s.c.done:
			}
			s.Close()
		}
	})
	defer stop()
	defer close(release)
	connect := func(id uint32) { p.headers(id, false, ":method", "CONNECT", ":authority", "10.0.0.1:80") }
	for i := range uint32(limit) {
		connect(2*i + 1)
	}
	answered := map[uint32]bool{} // in any order: each handler answers on its own
	for len(answered) < limit {
		f := p.waitFor(t, "200", func(f frameSummary) bool { return f.typ == http2.FrameHeaders && f.status == "200" })
		answered[f.stream] = true
	}
	connect(2*limit + 1)
	p.waitFor(t, "REFUSED_STREAM", func(f frameSummary) bool {
		return f.typ == http2.FrameRSTStream && f.stream == 2*limit+1 && f.code == http2.ErrCodeRefusedStream
	})
	for id := uint32(2*limit + 3); id < 2*limit+3+2*(earlyResetBurstPerSlot*limit+5); id += 2 {
		connect(id)
	}
	p.waitFor(t, "GOAWAY ENHANCE_YOUR_CALM", func(f frameSummary) bool {
		return f.typ == http2.FrameGoAway && f.code == http2.ErrCodeEnhanceYourCalm
	})
	<-done
	done <- nil
}

// A handler that returns without answering a stream the peer reset sends nothing on it:
// no 503 HEADERS on a closed stream (RFC 9113 §5.1), which also cost the server a write
// per reset under a rapid-reset flood.
func TestNoAnswerOnResetStream(t *testing.T) {
	leaktest.Check(t)
	started, returned := make(chan struct{}), make(chan struct{})
	p, _, stop := serveRaw(t, ServerConfig{}, func(r *Request) {
		close(started)
		<-r.Context().Done()
		close(returned) // unanswered: the server would answer 503 for it
	})
	defer stop()
	p.headers(1, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	<-started
	p.write(func() error { return p.fr.WriteRSTStream(1, http2.ErrCodeCancel) })
	<-returned
	p.write(func() error { return p.fr.WritePing(false, [8]byte{5}) })
	f := p.waitFor(t, "HEADERS on the reset stream, or the PING ack after it", func(f frameSummary) bool {
		return f.typ == http2.FrameHeaders && f.stream == 1 || f.typ == http2.FramePing
	})
	if f.typ == http2.FrameHeaders {
		t.Errorf("the server answered %s on a stream the peer had reset", f.status)
	}
}

// When every handler is still busy with a stream the peer has reset, a new stream waits
// for one to return instead of starting another handler.
func TestStreamsWaitForBusyHandlers(t *testing.T) {
	leaktest.Check(t)
	const limit = 2
	release := make(chan struct{}, 4*limit)
	defer func() { // whatever still waits, so ServeConn can end
		for range 4 * limit {
			select {
			case release <- struct{}{}:
			default:
			}
		}
	}()
	var running, most atomic.Int32
	p, _, stop := serveRaw(t, ServerConfig{MaxConcurrentStreams: limit}, func(r *Request) {
		n := running.Add(1)
		defer running.Add(-1)
		for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
		}
		<-release // a handler slow to notice its stream is gone
		r.Accept(nil)
	})
	defer stop()
	connect := func(id uint32) { p.headers(id, false, ":method", "CONNECT", ":authority", "10.0.0.1:80") }
	for i := range uint32(limit) { // two streams, reset once their handlers run: these keep running
		connect(2*i + 1)
		testutil.Eventually(t, "the stream's handler to start", func() bool { return running.Load() == int32(i+1) })
		p.write(func() error { return p.fr.WriteRSTStream(2*i+1, http2.ErrCodeCancel) })
	}
	connect(2*limit + 1) // waits: no handler is free
	time.Sleep(50 * time.Millisecond)
	if n := most.Load(); n != limit {
		t.Fatalf("%d handlers ran at once, want %d", n, limit)
	}
	for range limit + 1 { // the two busy handlers, then the waiting stream's
		release <- struct{}{}
	}
	p.waitFor(t, "200 for the stream that waited", func(f frameSummary) bool {
		return f.typ == http2.FrameHeaders && f.stream == 2*limit+1 && f.status == "200"
	})
}
