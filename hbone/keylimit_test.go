package hbone

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"io"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// TestRecordCounter: records split anywhere across writes are each counted once.
func TestRecordCounter(t *testing.T) {
	var stream []byte
	const records = 300
	for i := range records {
		body := make([]byte, i*7%1500)
		stream = append(stream, 23, 3, 3, byte(len(body)>>8), byte(len(body)))
		stream = append(stream, body...)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	for range 20 {
		var rc recordCounter
		for p := stream; len(p) > 0; {
			k := min(len(p), 1+rng.IntN(40))
			rc.add(p[:k])
			p = p[k:]
		}
		if got := rc.n.Load(); got != records {
			t.Fatalf("counted %d records; want %d", got, records)
		}
	}
}

// TestSendKeys: sendKeys tells crypto/tls's KeyUpdates from application records of the
// same length (5 bytes of plaintext) by whether a Write is partly written, and the count
// under the current key restarts after each KeyUpdate.
func TestSendKeys(t *testing.T) {
	var rc recordCounter
	k := &sendKeys{}
	rc.keys = k
	record := func(plain int) {
		body := plain + tls13RecordOverhead
		rc.add(append([]byte{23, 3, 3, byte(body >> 8), byte(body)}, make([]byte, body)...))
	}
	// write is a Write of crypto/tls, split into records of these plaintext sizes.
	write := func(sizes ...int) {
		n := 0
		for _, s := range sizes {
			n += s
		}
		k.pending.Add(int64(n))
		for _, s := range sizes {
			record(s)
		}
	}
	check := func(what string, start uint64) {
		t.Helper()
		if got := k.start.Load(); got != start || k.pending.Load() != 0 {
			t.Fatalf("%s: the current key starts after record %d, %d bytes pending; want %d, 0", what, got, k.pending.Load(), start)
		}
	}
	write(16384, 5)
	write(1369, 2738, 5)
	write(9)
	check("a Write's 5-byte tail", 0)
	record(keyUpdateMsgLen)
	check("a KeyUpdate between Writes", 7)
	write(24)
	check("a Write after it", 7)
	k.pending.Add(16389) // a Write waiting for crypto/tls's write lock
	record(keyUpdateMsgLen)
	record(16384)
	record(5)
	check("a KeyUpdate before a Write's records", 9)
	if got := rc.n.Load() - k.start.Load(); got != 2 {
		t.Fatalf("%d records under the current key; want 2", got)
	}
}

// keyEvents collects OnKeyLimit's reports.
type keyEvents struct {
	mu  sync.Mutex
	got []KeyLimit
	ch  chan KeyLimit
}

func newKeyEvents() *keyEvents { return &keyEvents{ch: make(chan KeyLimit, 16)} }

func (k *keyEvents) on(l KeyLimit) {
	k.mu.Lock()
	k.got = append(k.got, l)
	k.mu.Unlock()
	select {
	case k.ch <- l:
	default:
	}
}

func (k *keyEvents) wait(t *testing.T, event string) KeyLimit {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		select {
		case l := <-k.ch:
			if l.Event == event {
				return l
			}
		case <-timeout:
			t.Fatalf("no %q key limit event", event)
		}
	}
}

// pingPong sends n messages on s, each read back by the echo handler before the next: a
// record or more each way per message. It returns the hash of what came back, and fails
// the test if it differs from what was sent.
func pingPong(t *testing.T, s *Stream, n int, seed byte) error {
	t.Helper()
	sent, got := sha256.New(), sha256.New()
	buf := make([]byte, 64)
	for i := range n {
		msg := bytes.Repeat([]byte{seed + byte(i)}, 64)
		sent.Write(msg)
		if _, err := s.Write(msg); err != nil {
			return err
		}
		if _, err := io.ReadFull(s, buf); err != nil {
			return err
		}
		got.Write(buf)
	}
	if !bytes.Equal(sent.Sum(nil), got.Sum(nil)) {
		t.Fatalf("echoed bytes differ from those sent")
	}
	return nil
}

// waitLeaving waits for the pool to stop putting new streams on s's connection.
func waitLeaving(t *testing.T, s *Stream) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !s.c.leaving() {
		if time.Now().After(deadline) {
			t.Fatal("the connection is still taking new streams after its key drain")
		}
		time.Sleep(time.Millisecond)
	}
}

// carriesOnAfterDrain checks what follows s1's connection's key drain: once it takes no
// new stream, a new one goes to a fresh connection and carries data, and s1 carries on
// across the drain. It returns the new stream, for the caller to close.
func carriesOnAfterDrain(t *testing.T, e *env, s1 *Stream) *Stream {
	t.Helper()
	waitLeaving(t, s1)
	s2 := e.dial(t, "10.0.0.1:80")
	if s2.c == s1.c {
		s2.Close()
		t.Fatal("a new stream went to the drained connection")
	}
	if err := pingPong(t, s2, 5, 'c'); err != nil {
		s2.Close()
		t.Fatal(err)
	}
	if err := pingPong(t, s1, 20, 'd'); err != nil {
		s2.Close()
		t.Fatalf("the stream open across the drain: %v", err)
	}
	return s2
}

// TestKeyLimitDrain: a connection whose sent records reach KeyDrainRecords drains, on
// either side: the server sends GOAWAY, the client leaves the pool. The next stream goes
// to a fresh connection, and the stream open across the drain carries on to its end,
// every byte echoed back (user-space TLS; the kernel TLS case is
// TestKernelTLSKeyLimitDrain).
func TestKeyLimitDrain(t *testing.T) {
	for _, side := range []string{"server", "client"} {
		t.Run(side, func(t *testing.T) {
			leaktest.Check(t)
			ev := newKeyEvents()
			limited := Config{KeyDrainRecords: 64, OnKeyLimit: ev.on, DisableKernelTLS: true}
			off := Config{KeyDrainRecords: -1, KeyMaxRecords: -1, DisableKernelTLS: true}
			scfg, ccfg := limited, off
			if side == "client" {
				scfg, ccfg = off, limited
			}
			e := newEnvConfigs(t, ServerConfig{Config: scfg}, ClientConfig{Config: ccfg}, echo)
			s1 := e.dial(t, "10.0.0.1:80")
			defer s1.Close()
			if err := pingPong(t, s1, 10, 'a'); err != nil {
				t.Fatal(err)
			}
			if s1.c.leaving() {
				t.Fatal("drained after 10 messages; the limit is 64 records")
			}
			if err := pingPong(t, s1, 100, 'b'); err != nil {
				t.Fatal(err)
			}
			l := ev.wait(t, "drain")
			if l.Server != (side == "server") || l.TX < 64 || l.Streams != 1 || l.Kernel {
				t.Errorf("OnKeyLimit heard %+v; want the %s, TX >= 64, 1 stream, user space", l, side)
			}
			s2 := carriesOnAfterDrain(t, e, s1)
			defer s2.Close()
			// The stream open across the drain ends cleanly.
			s1.CloseWrite()
			if n, err := io.Copy(io.Discard, s1); n != 0 || err != nil {
				t.Fatalf("after the half-close: %d bytes, %v; want 0, clean EOF", n, err)
			}
			if got := e.serverConns(); got != 2 {
				t.Errorf("server accepted %d connections; want 2", got)
			}
		})
	}
}

// TestKeyLimitMax: a stream that outlives the drain until the connection's sent records
// reach KeyMaxRecords fails loudly at both ends (ErrConnClosed, never a clean EOF), and
// OnKeyLimit hears of it with the stream counted.
func TestKeyLimitMax(t *testing.T) {
	leaktest.Check(t)
	ev := newKeyEvents()
	scfg := Config{KeyDrainRecords: 32, KeyMaxRecords: 96, OnKeyLimit: ev.on, DisableKernelTLS: true}
	ccfg := Config{KeyDrainRecords: -1, KeyMaxRecords: -1, DisableKernelTLS: true}
	handlerErr := make(chan error, 1)
	e := newEnvConfigs(t, ServerConfig{Config: scfg}, ClientConfig{Config: ccfg}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			handlerErr <- err
			return
		}
		defer s.Close()
		_, err = io.Copy(s, s)
		handlerErr <- err
	})
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()
	err := pingPong(t, s, 1000, 'x')
	if err == nil {
		t.Fatal("1000 messages went through; the server's limit is 96 records")
	}
	if !errors.Is(err, ErrConnClosed) {
		t.Fatalf("client stream: %v; want ErrConnClosed (the proxy resets its TCP peer on it)", err)
	}
	if herr := <-handlerErr; !errors.Is(herr, ErrConnClosed) || !errors.Is(herr, errKeyLimit) {
		t.Fatalf("server stream: %v; want ErrConnClosed for errKeyLimit", herr)
	}
	ev.wait(t, "drain")
	l := ev.wait(t, "tx_limit")
	if l.TX < 96 || l.Streams != 1 || !l.Server {
		t.Errorf("OnKeyLimit heard %+v; want TX >= 96, 1 stream, server", l)
	}
}
