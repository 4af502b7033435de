package hbone

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
	"github.com/gozt/gozt/internal/testutil"
	"golang.org/x/net/http2"
)

// calmAfterPings opens stream 1 on p (an echo), waits for its 200, then sends PINGs past
// the junk budget until the server's GOAWAY(ENHANCE_YOUR_CALM) arrives; with keepGoing
// it goes on sending them after it.
func calmAfterPings(t *testing.T, p *rawPeer, keepGoing bool) {
	t.Helper()
	p.headers(1, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	p.waitFor(t, "200 for stream 1", func(f frameSummary) bool { return f.typ == http2.FrameHeaders && f.stream == 1 })
	n := junkBurst + 50
	if keepGoing {
		n = 20 * junkBurst
	}
	for i := range n {
		if p.write(func() error { return p.fr.WritePing(false, [8]byte{byte(i)}) }) != nil {
			break
		}
	}
	p.waitFor(t, "GOAWAY ENHANCE_YOUR_CALM", func(f frameSummary) bool {
		return f.typ == http2.FrameGoAway && f.code == http2.ErrCodeEnhanceYourCalm
	})
}

// A calm close drains: after GOAWAY(ENHANCE_YOUR_CALM) the stream already open on the
// connection (an honest client's, pooled with the flood) still gets its echo, a new
// stream is refused, and the connection closes once the stream ends.
func TestCalmDrainFinishesOpenStreams(t *testing.T) {
	leaktest.Check(t)
	var drops dropCounts
	p, done, stop := serveRaw(t, ServerConfig{Config: Config{OnDrop: drops.hook}}, echo)
	defer stop()
	p.ackPings.Store(false)
	calmAfterPings(t, p, false)
	p.headers(3, false, ":method", "CONNECT", ":authority", "10.0.0.1:80")
	p.waitFor(t, "REFUSED_STREAM for a stream past the GOAWAY", func(f frameSummary) bool {
		return f.typ == http2.FrameRSTStream && f.stream == 3 && f.code == http2.ErrCodeRefusedStream
	})
	msg := []byte("still here")
	p.write(func() error { return p.fr.WriteData(1, true, msg) })
	got := p.waitFor(t, "the echo on stream 1", func(f frameSummary) bool { return f.typ == http2.FrameData && f.stream == 1 && f.n > 0 })
	if got.n != len(msg) {
		t.Errorf("echo of %d bytes, want %d", got.n, len(msg))
	}
	p.waitFor(t, "END_STREAM on stream 1", func(f frameSummary) bool { return f.stream == 1 && f.end })
	select {
	case err := <-done: // the last stream ended: the drain is over
		if err == nil || !bytes.Contains([]byte(err.Error()), []byte("ENHANCE_YOUR_CALM")) {
			t.Errorf("ServeConn = %v, want the calm that started the drain", err)
		}
		done <- nil
	case <-time.After(5 * time.Second):
		t.Fatal("the connection did not close once its last stream ended")
	}
	if n := drops[DropConnCalm].Load(); n != 1 {
		t.Errorf("%d calm drops counted, want 1", n)
	}
}

// A peer that keeps flooding after the calm GOAWAY is closed long before the drain
// deadline, its open stream with it.
func TestCalmDrainClosesPeerThatKeepsGoing(t *testing.T) {
	leaktest.Check(t)
	var drops dropCounts
	p, done, stop := serveRaw(t, ServerConfig{Config: Config{OnDrop: drops.hook}}, echo)
	defer stop()
	p.ackPings.Store(false)
	start := time.Now()
	calmAfterPings(t, p, true)
	select {
	case <-p.done:
	case <-time.After(calmDrainTimeout / 2):
		t.Fatal("a peer flooding past the calm GOAWAY was not closed")
	}
	t.Logf("closed %v after the flood began", time.Since(start))
	if err := <-done; err == nil {
		t.Error("ServeConn = nil, want the calm")
	}
	done <- nil
	if n := drops[DropConnCalm].Load(); n != 1 {
		t.Errorf("%d calm drops counted for one connection, want 1", n)
	}
}

// The same for streams: a peer that opens streams past the calm GOAWAY is closed, at once
// if it has read the GOAWAY (acked the PING after it), else past calmGrace of them.
func TestCalmDrainClosesStreamsPastGoAway(t *testing.T) {
	for _, read := range []bool{true, false} {
		t.Run(fmt.Sprintf("read=%v", read), func(t *testing.T) {
			leaktest.Check(t)
			p, done, stop := serveRaw(t, ServerConfig{}, echo)
			defer stop()
			p.ackPings.Store(false)
			calmAfterPings(t, p, false)
			want := calmGrace + 1
			if read {
				p.waitFor(t, "the PING after the GOAWAY", func(f frameSummary) bool { return f.typ == http2.FramePing })
				p.write(func() error { return p.fr.WritePing(true, calmPing) })
				want = 1
			}
			opened := 0
			for id := uint32(3); opened < want; id += 2 {
				if p.headers(id, false, ":method", "CONNECT", ":authority", "10.0.0.1:80") != nil {
					break
				}
				opened++
			}
			select {
			case <-p.done:
			case <-time.After(calmDrainTimeout / 2):
				t.Fatalf("a peer that opened %d streams past the calm GOAWAY was not closed", opened)
			}
			<-done
			done <- nil
		})
	}
}

// Our own client takes a calm GOAWAY as the server meant it: the stream open on the
// connection finishes its echo, and the next Dial opens a new connection instead of a
// stream the server would refuse.
func TestPoolLeavesCalmedConn(t *testing.T) {
	leaktest.Check(t)
	e := newEnv(t, ServerConfig{}, echo)
	s1 := e.dial(t, "10.0.0.1:80")
	defer s1.Close()
	var sc *conn
	e.srv.mu.Lock()
	for _, c := range e.srv.raws {
		sc = c
	}
	e.srv.mu.Unlock()
	if sc == nil {
		t.Fatal("no server connection")
	}
	sc.calmDrain(calm("test"))
	pc := s1.c
	testutil.Eventually(t, "the pool to read the GOAWAY", func() bool { return pc.leaving() })
	s2 := e.dial(t, "10.0.0.1:80")
	defer s2.Close()
	if s2.c == pc || e.serverConns() != 2 {
		t.Fatalf("the stream after the GOAWAY went on the calmed connection (server connections %d)", e.serverConns())
	}
	for i, s := range []*Stream{s1, s2} {
		if err := pingEchoStream(s); err != nil {
			t.Errorf("stream %d: %v", i+1, err)
		}
	}
	s1.CloseWrite()
	if _, err := io.Copy(io.Discard, s1); err != nil {
		t.Errorf("stream 1 after its end: %v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	select {
	case <-pc.done: // drained and closed by the server once s1 ended
	case <-ctx.Done():
		t.Error("the calmed connection did not close once its stream ended")
	}
}
