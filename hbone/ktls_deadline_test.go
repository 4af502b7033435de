//go:build linux

package hbone

import (
	"crypto/sha256"
	"errors"
	"io"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/gozt/gozt/internal/leaktest"
)

// TestKernelTLSReadFromDeadline: a read deadline in the past on the TCP socket ends
// ReadFrom with os.ErrDeadlineExceeded and the bytes it moved, having lost none: the
// proxy's idle copies (proxy/idle.go) wake their reader so, again and again, and call
// ReadFrom again, and every byte must reach the peer once and in order. In kernel TLS
// ReadFrom splices (readFromSplice); elsewhere it reads (readFromPoll), so this runs on
// every host.
func TestKernelTLSReadFromDeadline(t *testing.T) {
	leaktest.Check(t)
	const chunk, chunks = 65537, 64
	const size = chunk * chunks
	type result struct {
		sum [32]byte
		n   int64
	}
	served := make(chan result, 1)
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		st, err := r.Accept(nil)
		if err != nil {
			served <- result{}
			return
		}
		defer st.Close()
		h := sha256.New()
		n, _ := io.Copy(h, st)
		var res result
		copy(res.sum[:], h.Sum(nil))
		res.n = n
		served <- res
	})
	cA, cB := tcpPair(t)
	s := e.dial(t, "10.0.0.1:80")
	defer s.Close()

	// The sender pauses now and then, so that some wake-ups find the socket quiet.
	sent := make(chan [32]byte, 1)
	go func() {
		h := sha256.New()
		buf := make([]byte, chunk)
		for i := range chunks {
			for j := range buf {
				buf[j] = byte(i*31 + j)
			}
			h.Write(buf)
			if _, err := cB.Write(buf); err != nil {
				break
			}
			if i%8 == 7 {
				time.Sleep(5 * time.Millisecond)
			}
		}
		cB.CloseWrite()
		var sum [32]byte
		copy(sum[:], h.Sum(nil))
		sent <- sum
	}()

	// The sweep: a past deadline every millisecond, set and cleared under mu as the
	// proxy's streamCopy does.
	var mu sync.Mutex
	stop := make(chan struct{})
	swept := make(chan struct{})
	go func() {
		defer close(swept)
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-stop:
				return
			case <-tick.C:
				mu.Lock()
				cA.SetReadDeadline(time.Unix(1, 0))
				mu.Unlock()
			}
		}
	}()
	var total int64
	var wakes, busyWakes int
	for {
		n, err := s.ReadFrom(cA)
		total += n
		if errors.Is(err, os.ErrDeadlineExceeded) {
			mu.Lock()
			cA.SetReadDeadline(time.Time{})
			mu.Unlock()
			wakes++
			if n > 0 {
				busyWakes++
			}
			continue
		}
		if err != nil {
			t.Fatalf("ReadFrom after %d bytes: %v", total, err)
		}
		break
	}
	close(stop)
	<-swept
	if err := s.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	want, got := <-sent, <-served
	t.Logf("kernel TLS %v: %d wake-ups, %d of them after moving bytes", s.KernelTLS(), wakes, busyWakes)
	if total != size || got.n != size {
		t.Fatalf("ReadFrom moved %d bytes and the peer read %d; want %d", total, got.n, size)
	}
	if got.sum != want {
		t.Fatal("the peer read other bytes than were sent")
	}
	if wakes == 0 {
		t.Error("no ReadFrom ended at the deadline")
	}
	if s.KernelTLS() {
		if b := s.KernelTLSBytes(); b.SplicedOut != size || b.CopiedOut != 0 {
			t.Errorf("sent %d spliced, %d copied; want all %d spliced", b.SplicedOut, b.CopiedOut, size)
		}
	}
}
