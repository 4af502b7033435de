package hbone

import (
	"bytes"
	"io"
	"runtime"
	"testing"

	"github.com/gozt/gozt/internal/leaktest"
)

// goid is the current goroutine's id, from its stack header ("goroutine N [running]:").
func goid() string {
	var b [64]byte
	n := runtime.Stack(b[:], false)
	f := bytes.Fields(b[:n])
	if len(f) < 2 {
		return ""
	}
	return string(f[1])
}

// Streams opened one after another on one connection run their handlers on one
// goroutine (its grown stack is reused); streams open at the same time get their own.
func TestHandlerGoroutineReused(t *testing.T) {
	leaktest.Check(t)
	ids := make(chan string, 32)
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		ids <- goid()
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		io.Copy(io.Discard, s)
		s.CloseWrite()
	})
	run := func() string {
		s := e.dial(t, "10.0.0.1:80")
		defer s.Close()
		id := <-ids
		s.CloseWrite()
		if _, err := io.Copy(io.Discard, s); err != nil {
			t.Fatal(err)
		}
		return id
	}
	// A handler goroutine is back to idle a moment after its stream ends, and the next
	// stream may come sooner; over many sequential streams most must find one.
	const n = 20
	seen := map[string]bool{}
	for range n {
		seen[run()] = true
	}
	if len(seen) > n/2 {
		t.Errorf("%d sequential streams ran on %d goroutines: handler goroutines not reused", n, len(seen))
	}

	// Two streams at once: two goroutines.
	a := e.dial(t, "10.0.0.1:80")
	defer a.Close()
	b := e.dial(t, "10.0.0.1:80")
	defer b.Close()
	if ga, gb := <-ids, <-ids; ga == gb {
		t.Errorf("concurrent streams share goroutine %s", ga)
	}
	a.CloseWrite()
	b.CloseWrite()
	io.Copy(io.Discard, a)
	io.Copy(io.Discard, b)
}
