package hbone

import (
	"io"
	"runtime"
	"testing"
	"time"
)

// A pooled connection that carried bulk data both ways gives its large buffers back
// within a second of going idle, on both ends, and still works afterwards.
func TestIdleConnectionGivesBuffersBack(t *testing.T) {
	const bulk = 8 << 20
	e := newEnv(t, ServerConfig{}, func(r *Request) {
		s, err := r.Accept(nil)
		if err != nil {
			return
		}
		defer s.Close()
		io.Copy(io.Discard, s)
		buf := make([]byte, 1<<20)
		for sent := 0; sent < bulk; sent += len(buf) {
			if _, err := s.Write(buf); err != nil {
				return
			}
		}
		s.CloseWrite()
	})
	st := e.dial(t, "10.0.0.1:80")
	buf := make([]byte, 1<<20)
	for sent := 0; sent < bulk; sent += len(buf) {
		if _, err := st.Write(buf); err != nil {
			t.Fatal(err)
		}
	}
	st.CloseWrite()
	if n, err := io.Copy(io.Discard, st); err != nil || n != bulk {
		t.Fatalf("read %d bytes (%v), want %d", n, err, bulk)
	}
	st.Close()

	retained := func() (client, server int) {
		e.pool.mu.Lock()
		for c := range e.pool.all {
			client += c.retainedBuffers()
		}
		e.pool.mu.Unlock()
		e.srv.mu.Lock()
		for _, c := range e.srv.raws {
			if c != nil {
				server += c.retainedBuffers()
			}
		}
		e.srv.mu.Unlock()
		return client, server
	}
	heap := func() uint64 {
		var ms runtime.MemStats
		runtime.GC()
		runtime.GC() // the first moves sync.Pools' contents to their victim caches
		runtime.ReadMemStats(&ms)
		return ms.HeapAlloc
	}
	idleAt := time.Now()
	cl, sv := retained()
	if cl < 1<<20 || sv < 1<<20 {
		t.Fatalf("right after bulk: client %d, server %d bytes retained; want over 1 MiB each (or this test proves nothing)", cl, sv)
	}
	grown := heap()
	limit := 1500 * time.Millisecond // trimmed between one and two trimTicks after the last frame
	if raceEnabled {
		limit = 3 * time.Second
	}
	for cl > trimKeep || sv > trimKeep {
		if time.Since(idleAt) > limit {
			t.Fatalf("idle for %v: client %d, server %d bytes retained; want at most %d each", time.Since(idleAt), cl, sv, trimKeep)
		}
		time.Sleep(20 * time.Millisecond)
		cl, sv = retained()
	}
	t.Logf("retained %d / %d bytes after %v idle", cl, sv, time.Since(idleAt).Round(time.Millisecond))
	if trimmed := heap(); trimmed+2<<20 > grown {
		t.Errorf("live heap %d after the trim, %d before: want at least 2 MiB less", trimmed, grown)
	}

	// The connection still carries streams, and bulk again.
	st = e.dial(t, "10.0.0.1:80")
	st.CloseWrite()
	if n, err := io.Copy(io.Discard, st); err != nil || n != bulk {
		t.Fatalf("after the trim: read %d bytes (%v), want %d", n, err, bulk)
	}
	st.Close()
	if got := e.serverConns(); got != 1 {
		t.Errorf("server saw %d connections, want 1 (the pooled one reused)", got)
	}
}

// Interrupting the frame reader at any moment (a trim's read deadline, as often as every
// 200 µs while bulk data flows both ways) loses and corrupts nothing: inside a frame it
// reads on, between frames it starts a fresh Framer.
func TestTrimInterruptsNoFrame(t *testing.T) {
	e := newEnv(t, ServerConfig{}, echo)
	st := e.dial(t, "10.0.0.1:80")
	defer st.Close()
	conns := func() (cs []*conn) {
		e.pool.mu.Lock()
		for c := range e.pool.all {
			cs = append(cs, c)
		}
		e.pool.mu.Unlock()
		e.srv.mu.Lock()
		for _, c := range e.srv.raws {
			if c != nil {
				cs = append(cs, c)
			}
		}
		e.srv.mu.Unlock()
		return cs
	}
	stop := make(chan struct{})
	interrupted := make(chan int)
	go func() {
		n := 0
		defer func() { interrupted <- n }()
		for {
			select {
			case <-stop:
				return
			case <-time.After(200 * time.Microsecond):
			}
			for _, c := range conns() {
				c.trimRead.Store(true)
				c.readConn().SetReadDeadline(time.Unix(1, 0))
				n++
			}
		}
	}()
	const total = 32 << 20
	out := make([]byte, 256<<10)
	for i := range out {
		out[i] = byte(i * 7)
	}
	errc := make(chan error, 1)
	go func() {
		for sent := 0; sent < total; sent += len(out) {
			if _, err := st.Write(out); err != nil {
				errc <- err
				return
			}
		}
		errc <- st.CloseWrite()
	}()
	in := make([]byte, len(out))
	for got := 0; got < total; got += len(in) {
		if _, err := io.ReadFull(st, in); err != nil {
			t.Fatalf("after %d bytes: %v", got, err)
		}
		for i := range in {
			if in[i] != out[i] {
				t.Fatalf("byte %d differs", got+i)
			}
		}
	}
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	close(stop)
	if n := <-interrupted; n < 10 {
		t.Fatalf("only %d interruptions: the test proves nothing", n)
	}
	if got := e.serverConns(); got != 1 {
		t.Errorf("server saw %d connections, want 1 (none broke)", got)
	}
}
